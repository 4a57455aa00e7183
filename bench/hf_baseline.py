"""HF transformers baseline (torch, float32, CPU) on the same model and prompts as `bench offline`.

Two figures, counting only each request's own wanted tokens as useful output:
  * one request at a time: `generate(max_new_tokens=m, min_new_tokens=m)` per request (greedy, EOS
    suppressed until m tokens: the same lengths as jaxserve's ignore_eos);
  * padded static batches of --batch-size (prompt order, left padding, attention mask, every row
    generating the batch's largest m; tokens past a row's own m are wasted work, not output).
Plus single-request decode tok/s: (generate(n) - generate(1)) / (n - 1) on one prompt.

The model loads as bench/hf_reference.py loads the suite's numerical reference (a GGUF through
transformers' own reader, which dequantizes it to float32: the same weights jaxserve runs). Threads:
`torch.set_num_threads(os.cpu_count())`.

    jaxserve bench hf_baseline [--model PATH] [--num-prompts 64] [--batch-size 16] [--out f.json]
    python -m bench.hf_baseline --prompts-file prompts.json ...   (what `bench offline --hf` runs)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from bench import common


def load_hf_model(model: str | None):
    from bench.hf_reference import load_float32
    from jaxserve.model.loader import resolve_model_path

    path = Path(resolve_model_path(model))
    return load_float32(path), path


def _pad_id(model) -> int:
    cfg = model.generation_config
    for t in (cfg.pad_token_id, cfg.eos_token_id, model.config.eos_token_id, 0):
        if isinstance(t, (list, tuple)):
            t = t[0] if t else None
        if t is not None:
            return int(t)
    return 0


def _generate(model, batch: list[list[int]], new_tokens: int, pad: int):
    """Greedy generation of exactly `new_tokens` per row; rows left-padded with an attention mask."""
    import torch

    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                             num_beams=1, use_cache=True)
    return out[:, width:]


def run(model, requests: list[tuple[list[int], int]], *, batch_size: int = 16, max_single: int | None = None,
        single_prompt: list[int] | None = None, single_tokens: int = 128, single_repeats: int = 3,
        log=print) -> dict:
    pad = _pad_id(model)
    _generate(model, [requests[0][0][:16]], 2, pad)  # warm-up (allocations, lazy init)

    single_reqs = requests if max_single is None else requests[:max_single]
    t0 = time.perf_counter()
    produced = 0
    for i, (p, m) in enumerate(single_reqs):
        out = _generate(model, [p], m, pad)
        produced += min(out.shape[1], m)
        log(f"[hf] one at a time: {i + 1}/{len(single_reqs)}")
    wall = time.perf_counter() - t0
    n_in = sum(len(p) for p, _ in single_reqs)
    single = {"requests": len(single_reqs), "prompt_tokens": n_in, "output_tokens": produced, "wall_s": wall,
              "output_tok_s": produced / wall, "total_tok_s": (n_in + produced) / wall}

    t0 = time.perf_counter()
    useful = generated = 0
    for b in range(0, len(requests), batch_size):
        chunk = requests[b:b + batch_size]
        m_max = max(m for _, m in chunk)
        out = _generate(model, [p for p, _ in chunk], m_max, pad)
        generated += out.shape[0] * out.shape[1]
        useful += sum(min(out.shape[1], m) for _, m in chunk)
        log(f"[hf] batches: {min(b + batch_size, len(requests))}/{len(requests)}")
    wall = time.perf_counter() - t0
    n_in = sum(len(p) for p, _ in requests)
    batched = {"requests": len(requests), "batch_size": batch_size, "prompt_tokens": n_in, "output_tokens": useful,
               "generated_tokens": generated, "wall_s": wall, "output_tok_s": useful / wall,
               "total_tok_s": (n_in + useful) / wall}

    decode = None
    if single_prompt and single_tokens > 1:
        runs = []
        for _ in range(max(1, single_repeats)):
            t0 = time.perf_counter()
            _generate(model, [single_prompt], 1, pad)
            t1 = time.perf_counter()
            _generate(model, [single_prompt], single_tokens, pad)
            t2 = time.perf_counter()
            runs.append({"first_token_s": t1 - t0, "e2e_s": t2 - t1,
                         "decode_tok_s": (single_tokens - 1) / max((t2 - t1) - (t1 - t0), 1e-9)})
        decode = {"prompt_tokens": len(single_prompt), "new_tokens": single_tokens, "runs": runs,
                  "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs)}
    return {"single": single, "batched": batched, "single_decode": decode,
            "best_output_tok_s": max(single["output_tok_s"], batched["output_tok_s"])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench hf_baseline", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", "-m", default=None, help="HF dir or .gguf (default: the embedded default model)")
    p.add_argument("--prompts-file", default=None,
                   help='JSON {"requests": [[ids, max_tokens], ...], "single_prompt": ids, "single_tokens": n}; '
                   "default: the mixed workload")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", default="20,400")
    p.add_argument("--output-len", default="16,256")
    p.add_argument("--batch-size", type=int, default=16, help="padded static batch size (default 16)")
    p.add_argument("--max-single", type=int, default=None, help="one at a time: only the first N requests")
    p.add_argument("--single-tokens", type=int, default=128)
    p.add_argument("--single-repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, path = load_hf_model(args.model)
    load_s = time.perf_counter() - t0
    if args.prompts_file:
        with open(args.prompts_file) as f:
            spec = json.load(f)
        requests = [(list(r[0]), int(r[1])) for r in spec["requests"]]
        single_prompt, single_tokens = spec.get("single_prompt"), int(spec.get("single_tokens", args.single_tokens))
    else:
        tok = common.load_tokenizer(args.model)
        vocab = min(model.config.vocab_size, len(tok))
        lo, hi = (int(x) for x in args.prompt_len.split(","))
        olo, ohi = (int(x) for x in args.output_len.split(","))
        requests = common.mixed_workload(args.num_prompts, args.seed, vocab, common.special_token_ids(tok),
                                         (lo, hi), (olo, ohi))
        single_prompt, single_tokens = requests[0][0][:32], args.single_tokens
    res = run(model, requests, batch_size=args.batch_size, max_single=args.max_single, single_prompt=single_prompt,
              single_tokens=single_tokens, single_repeats=args.single_repeats,
              log=(lambda *a: None) if args.quiet else (lambda s: print(s, flush=True)))
    res["load_s"] = load_s
    res["threads"] = torch.get_num_threads()
    rows = [("one at a time", res["single"]["requests"], res["single"]["output_tokens"], res["single"]["wall_s"],
             res["single"]["output_tok_s"], res["single"]["total_tok_s"]),
            (f"padded batches of {args.batch_size}", res["batched"]["requests"], res["batched"]["output_tokens"],
             res["batched"]["wall_s"], res["batched"]["output_tok_s"], res["batched"]["total_tok_s"])]
    print(common.table(rows, ("HF transformers (torch float32)", "reqs", "useful out tok", "wall s",
                              "out tok/s", "total tok/s"), f"HF baseline, {torch.get_num_threads()} threads"))
    if res["single_decode"]:
        print(f"  single-request decode: {res['single_decode']['decode_tok_s']:.1f} tok/s")
    cfg = model.config
    common.report("hf_baseline", argv, model={"name": path.name, "path": str(path), "model_type": cfg.model_type,
                                               "transformers_dtype": "float32"},
                  config={k: v for k, v in vars(args).items() if k != "prompts_file"}, results=res, out=args.out,
                  jax_devices=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
