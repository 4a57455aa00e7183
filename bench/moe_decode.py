"""A tiny mixture-of-experts model's engine decode tok/s at 1 and 32 streams, next to a dense model
of the same active parameters (issue 27's acceptance), per expert format.

`jaxserve bench moe_decode --out bench/out/moe_decode.json`

Both models are random-initialised with transformers and saved to a temporary directory: a Qwen3-MoE
(H 512, 4 layers, 8 heads of 64, 4 kv heads; 32 experts of width 256, top 4: 1,024 active FFN
columns a token) and a dense Qwen3 of the same attention with one FFN of width 1,024. Each
`--quantizations` value (`none`: float32 experts and linear layers; w8a8, w4a8, bfloat16: every
matrix, the experts as an ExpertStack: runtime/expert_matmul.py) gets one engine per model; greedy,
ignore_eos, 16-token prompts, `--tokens` new tokens each; the timed run follows an identical warm-up
run (which compiles the buckets it uses). tok/s = generated tokens / wall time of the timed run.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench import common

SHAPE = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             max_position_embeddings=512, tie_word_embeddings=False)
MOE = dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
           intermediate_size=1024)
DENSE = dict(intermediate_size=1024)


def make_models(root: Path) -> dict[str, str]:
    import torch
    import transformers

    from tests.tiny_models import build_tokenizer

    tok = build_tokenizer()
    out = {}
    for name, cls, extra in (("moe", "Qwen3MoeConfig", MOE), ("dense", "Qwen3Config", DENSE)):
        cfg = getattr(transformers, cls)(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                         eos_token_id=tok.eos_token_id, **SHAPE, **extra)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
        path = root / name
        model.save_pretrained(path, safe_serialization=True)
        tok.save_pretrained(path)
        out[name] = str(path)
    return out


def active_params(name: str) -> int:
    h, layers = SHAPE["hidden_size"], SHAPE["num_hidden_layers"]
    ffn = MOE["num_experts_per_tok"] * MOE["moe_intermediate_size"] if name == "moe" else DENSE["intermediate_size"]
    attn = h * SHAPE["head_dim"] * (2 * SHAPE["num_attention_heads"] + 2 * SHAPE["num_key_value_heads"])
    return layers * (attn + 3 * h * ffn + (h * MOE["num_experts"] if name == "moe" else 0))


def run(path: str, quantization: str | None, streams: list[int], tokens: int) -> dict:
    from jaxserve import LLM, SamplingParams

    llm = LLM(path, use_tqdm=False, precompile=False, max_model_len=256, max_num_seqs=max(streams),
              max_num_batched_tokens=512, num_blocks=320, quantization=quantization)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    out = {}
    for n in streams:
        prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 300 for j in range(16)]} for i in range(n)]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles this shape's buckets
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        out[n] = n * tokens / (time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench moe_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--quantizations", default="none,w8a8", help="comma-separated: none, w8a8, w4a8, bfloat16, ...")
    p.add_argument("--streams", default="1,32", help="comma-separated concurrent streams (default 1,32)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per stream (default 64)")
    p.add_argument("--out", default=None, help="write JSON here")
    p.add_argument("--save-models", default=None, metavar="DIR",
                   help="write the two models to DIR/moe and DIR/dense and keep them (e.g. for `jaxserve bench "
                   "vllm_compare --model DIR/moe`); --quantizations '' only writes them")
    args = p.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        models = make_models(Path(args.save_models or tmp))
        for q in filter(None, args.quantizations.split(",")):
            for name, path in models.items():
                tps = run(path, None if q == "none" else q, streams, args.tokens)
                results.append({"model": name, "quantization": q, "active_params": active_params(name),
                                **{f"tok_s_{n}": v for n, v in tps.items()}})
                print(results[-1], flush=True)
    print(common.table([(r["model"], r["quantization"], f"{r['active_params'] / 1e6:.2f}M",
                         *(f"{r[f'tok_s_{n}']:.1f}" for n in streams)) for r in results],
                       ("model", "quantization", "active params", *(f"{n} streams tok/s" for n in streams)),
                       "tiny MoE vs dense decode"))
    common.report("moe_decode", argv, model={"shape": SHAPE, "moe": MOE, "dense": DENSE}, config=vars(args),
                  results={"cases": results}, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
