"""`jaxserve bench quality`: what each weight format costs in quality, next to its size and speed.

For every format (`--formats`; `none` is the float32 reference, `gguf` a GGUF file's own blocks),
and every quantized KV cache (`--kv-cache-dtypes`: int8, fp8_e4m3, fp8_e5m2, each with float32
weights, against the same reference, whose KV is the default: bfloat16 for a bfloat16 checkpoint):
  perplexity   on the text the package ships (jaxserve/data/quality.txt), teacher-forced in one
               forward (each token a one-token sequence over the same pages, so the LM head sees
               every position)
  top-1        the share of the text's positions where the argmax matches the reference's
  greedy       over a fixed prompt set, the share of the reference's greedy tokens (--max-tokens
               each) that this format picks too given the same prefix (teacher-forced: one early
               difference does not make every later token count as a miss)
  free-running the share of this format's own greedy tokens equal, position by position, to the
               reference's (after a first difference the two texts part ways: on a small random
               model, whose next-token distributions are nearly flat, this falls fast)
  weights      bytes held by the parameters after load, and their share of float32
  decode tok/s one stream, `LLM.generate` (time for --decode-tokens more tokens after the first)
  vs transformers  with --reference transformers: each format's greedy texts against transformers'
               float32 forward of the same file (bench/hf_reference.py): how many prompts match in
               full, and where one parts, whether the reference's top-2 margin there is a near-tie
               (< 0.05) or not ("far": a real numerical difference). Needs the test extras (torch).

    jaxserve bench quality [--model PATH] [--formats none,int8,q8_0,q4_0,q4_1,q4_k,q6_k]
                           [--kv-cache-dtypes int8,fp8_e4m3,fp8_e5m2] [--reference transformers]
                           [--out f.json]
"""

from __future__ import annotations

import argparse
import gc
import time
import weakref
from importlib import resources

import numpy as np

from bench import common, hf_reference

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at a temperature of",
    "The quick brown fox",
    "In the year 1969, astronauts",
]


def quality_text() -> str:
    return resources.files("jaxserve.data").joinpath("quality.txt").read_text()


_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # runner -> its jitted forward


def text_logprobs(runner, ids: list[int]) -> np.ndarray:
    """float64 [n, V] log-probabilities of the next token after each of `ids`, in one forward: token
    i is sequence i, of length i + 1, and all n share one block table, so each attends to tokens
    0..i (this step writes every K/V before attending) and every row reaches the LM head."""
    import jax

    from jaxserve.runtime.attention import AttentionMetadata

    n, bs = len(ids), runner.cfg.block_size
    t = 1 << (n - 1).bit_length()  # one compile per power of two
    blocks = np.arange(1, -(-n // bs) + 1, dtype=np.int32)  # block 0 is the null block
    if len(blocks) >= runner.cfg.num_blocks or len(blocks) > runner.max_blocks:
        raise ValueError(f"the text's {n} tokens need {len(blocks)} KV blocks: raise num_blocks/max_model_len")
    pad = lambda a: np.concatenate([np.asarray(a, np.int32), np.zeros(t - n, np.int32)])
    pos = np.arange(n)
    table = np.zeros((t, runner.max_blocks), np.int32)
    table[:n, :len(blocks)] = blocks
    md = AttentionMetadata(pad(blocks[pos // bs] * bs + pos % bs), pad(pos + 1),
                           np.minimum(np.arange(t + 1), n).astype(np.int32), table, np.asarray([n], np.int32))
    fwd = _FORWARDS.get(runner)
    if fwd is None:  # one jit per runner: each length bucket compiles once, not once per call
        # It must not hold the runner (the weak key), or the entry and its executables live forever.
        model, inv_freq = runner.model, runner.inv_freq
        fwd = _FORWARDS[runner] = jax.jit(lambda params, layers, ids, pos, md: model.apply(
            {"params": params}, ids, pos, layers, md, pos, inv_freq)[0])  # no donation: the engine's
    logits = fwd(runner.params, runner.kv_caches, pad(ids), pad(pos), md)  # pages stay as they were
    x = np.asarray(logits[:n], np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def greedy_agreement(runner, prompts: list[list[int]], tokens: list[list[int]]) -> float:
    """The share of `tokens` (each prompt's reference greedy continuation) that `runner`'s model
    predicts as the argmax given the same prefix."""
    hits = total = 0
    for prompt, out in zip(prompts, tokens):
        logp = text_logprobs(runner, prompt + out)
        picked = logp[len(prompt) - 1:-1].argmax(axis=1)
        hits, total = hits + int((picked == np.asarray(out)).sum()), total + len(out)
    return hits / total


def measure(model: str | None, fmt: str, ids: list[int], args, ref: dict | None, kv: str | None = None,
            hf: dict | None = None) -> dict:
    """One row: weights in `fmt`, the KV cache in `kv` (None: the engine's default); `hf`: the
    transformers reference's model, and its greedy texts once the first row computed them."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.runtime import quant_params

    llm = LLM(model, quantization=fmt, precompile=False, use_tqdm=False,
              max_num_seqs=len(PROMPTS), max_num_batched_tokens=256, num_blocks=args.num_blocks,
              kv_cache_dtype=kv)
    runner = llm.engine.runner
    ids = ids[:runner.cfg.max_model_len]  # the same for every format of one model
    logp = text_logprobs(runner, ids)
    nll = -logp[np.arange(len(ids) - 1), ids[1:]]
    top1 = logp.argmax(axis=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    prompts, tokens = [o.prompt_token_ids for o in outs], [o.outputs[0].token_ids for o in outs]
    one = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 1 + args.decode_tokens)]
    llm.generate(PROMPTS[:1], one[1], use_tqdm=False)  # warm-up: every bucket a single stream meets
    times = []
    for sp in one:
        t0 = time.perf_counter()
        llm.generate(PROMPTS[:1], sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    out = {"format": fmt, "kv_cache_dtype": runner.kv_cache_dtype, "text_tokens": len(ids),
           "perplexity": float(np.exp(nll.mean())), "weight_bytes": quant_params.weight_bytes(runner.params),
           "decode_tok_s": args.decode_tokens / max(times[1] - times[0], 1e-9), "top1": top1, "tokens": tokens}
    if hf is not None:
        if "greedy" not in hf:  # the same prompt ids for every format of one model
            hf["greedy"] = hf_reference.greedy(hf["model"], prompts, args.max_tokens)
        out["vs_transformers"] = hf_reference.compare(tokens, hf["greedy"])
    if ref is not None:
        out["top1_agreement"] = float(np.mean(top1 == ref["top1"]))
        pairs = [(a, b) for x, y in zip(tokens, ref["tokens"]) for a, b in zip(x, y)]
        out["free_running_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
        out["greedy_agreement"] = greedy_agreement(runner, prompts, ref["tokens"])
        out["perplexity_vs_ref"] = out["perplexity"] / ref["perplexity"] - 1
        out["weights_vs_float32"] = out["weight_bytes"] / ref["weight_bytes"]
    del llm, runner
    gc.collect()
    return out


def versus(seen: dict) -> str:
    """A row's greedy texts against transformers': '7/8 exact, 1 near-tie'."""
    parts = [f"{seen['exact']}/{seen['prompts']} exact"]
    if seen["near_ties"]:
        parts.append(f"{len(seen['near_ties'])} near-tie{'s' if len(seen['near_ties']) > 1 else ''}")
    if seen["far"]:
        parts.append(f"{len(seen['far'])} far")
    return ", ".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded default model)")
    p.add_argument("--formats", default=None,
                   help="comma-separated: none (float32, the reference), int8, q8_0, q4_0, q4_1, q4_k, q6_k, gguf "
                        "(default: all that apply; gguf for a .gguf model)")
    p.add_argument("--kv-cache-dtypes", default="int8,fp8_e4m3,fp8_e5m2",
                   help="comma-separated quantized KV caches measured with float32 weights ('' for none)")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    p.add_argument("--text-tokens", type=int, default=1024, help="at most this many tokens of the text (default 1024)")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens timed for decode tok/s (default 64)")
    p.add_argument("--num-blocks", type=int, default=160, help="KV blocks of 16 tokens (default 160)")
    p.add_argument("--reference", choices=("transformers",), default=None,
                   help="also compare each format's greedy texts with transformers' float32 forward (test extras)")
    p.add_argument("--out", default=None, help="write JSON here")
    args = p.parse_args(argv)

    from jaxserve.model.loader import resolve_model_path
    from jaxserve.tokenizer import Tokenizer

    path = resolve_model_path(args.model)
    is_gguf = path.suffix == ".gguf"
    formats = (args.formats or "none,int8,q8_0,q4_0,q4_1,q4_k,q6_k" + (",gguf" if is_gguf else "")).split(",")
    if formats[0] != "none":
        formats.insert(0, "none")
    ids = Tokenizer.from_gguf(path) if is_gguf else Tokenizer.from_pretrained(path)
    ids = ids.encode(quality_text())[:args.text_tokens]
    hf = None
    if args.reference == "transformers":
        try:
            hf = {"model": hf_reference.load_float32(path)}
        except ImportError as e:
            raise SystemExit(f"--reference transformers needs torch and transformers ({e}): "
                             "pip install -e '.[test]'") from None
    results, ref = [], None
    runs = [(fmt, None) for fmt in formats] + [("none", kv) for kv in args.kv_cache_dtypes.split(",") if kv]
    for fmt, kv in runs:
        r = measure(args.model, fmt, ids, args, ref, kv, hf)
        ref = ref or r
        results.append(r)
        print(f"  {fmt}, KV {r['kv_cache_dtype']}: perplexity {r['perplexity']:.3f}, {r['decode_tok_s']:.1f} tok/s",
              flush=True)
    pct = lambda r, k: f"{100 * r.get(k, 1.0):.1f}%"
    rows = [(r["format"], r["kv_cache_dtype"], r["weight_bytes"] / 2**20, pct(r, "weights_vs_float32"),
             f"{r['perplexity']:.3f}",
             f"{100 * r.get('perplexity_vs_ref', 0):+.2f}%", pct(r, "top1_agreement"), pct(r, "greedy_agreement"),
             pct(r, "free_running_agreement"), r["decode_tok_s"], *([versus(r["vs_transformers"])] if hf else []))
            for r in results]
    print(common.table(rows, ("format", "KV", "weights MiB", "of float32", "perplexity", "vs float32", "top-1",
                              "greedy", "free-running", "decode tok/s", *(["vs transformers"] if hf else [])),
                       f"Weight formats and KV caches on {path.name}: {results[0]['text_tokens']} text tokens, "
                       f"{len(PROMPTS)} "
                       f"prompts x {args.max_tokens} greedy tokens"))
    for r in results if hf else []:
        for kind in ("near_ties", "far"):
            for i, at, margin in r["vs_transformers"][kind]:
                print(f"  {r['format']}, KV {r['kv_cache_dtype']}: {PROMPTS[i]!r} parts at token {at}, reference "
                      f"top-2 margin {margin} ({'near-tie' if kind == 'near_ties' else 'far'})")
    for r in results:
        r.pop("top1"), r.pop("tokens")
    common.report("quality", argv, model={"path": str(path), "text_tokens": len(ids)}, config=vars(args),
                  results={"formats": results}, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
