"""Single-stream decode tok/s in `LLM.generate` per weight format, the engines side by side and
timed in alternating rounds (so a busy machine slows every format alike).

`jaxserve bench quant_decode [--model PATH] [--formats none,gguf,q8_0,int8] [--out f.json]`

Each round, for each format: one prompt, greedy with ignore_eos, 1 token then 1 + --tokens tokens;
the difference of the two times is --tokens decode steps. Reported: median and best round.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench import common


def decode_rate(llm, prompt: str, tokens: int) -> float:
    """One stream's decode tok/s in `llm.generate`: greedy with ignore_eos, 1 token then 1 + tokens;
    the difference of the two times is `tokens` decode steps (prefill and start-up cancel out)."""
    from jaxserve import SamplingParams

    short, long = (SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 1 + tokens))
    t0 = time.perf_counter()
    llm.generate([prompt], short, use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate([prompt], long, use_tqdm=False)
    return tokens / max((time.perf_counter() - t1) - (t1 - t0), 1e-9)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench quant_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded default model)")
    p.add_argument("--formats", default="none,gguf,q8_0,int8",
                   help="comma-separated: none (float32), int8, q8_0, q4_0, q4_1, gguf (default none,gguf,q8_0,int8)")
    p.add_argument("--tokens", type=int, default=128, help="decode steps timed per round (default 128)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument("--out", default=None, help="write JSON here")
    args = p.parse_args(argv)

    from jaxserve import LLM

    formats = args.formats.split(",")
    llms = {f: LLM(args.model, quantization=f, precompile=False, use_tqdm=False,
                   max_num_seqs=1, max_num_batched_tokens=64, num_blocks=64) for f in formats}
    prompt = "The capital of France is"
    for llm in llms.values():  # warm-up: compiles every bucket one stream meets
        decode_rate(llm, prompt, args.tokens)
    rates: dict[str, list[float]] = {f: [] for f in formats}
    for _ in range(args.rounds):
        for f, llm in llms.items():
            rates[f].append(decode_rate(llm, prompt, args.tokens))
    rows = [(f, statistics.median(r), max(r), ", ".join(f"{x:.0f}" for x in r)) for f, r in rates.items()]
    print(common.table(rows, ("format", "median tok/s", "best tok/s", "rounds"),
                       f"Single-stream decode, LLM.generate, {args.tokens} tokens a round"))
    common.report("quant_decode", argv, model={"model": args.model or "default"}, config=vars(args),
                  results={"rates": rates}, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
