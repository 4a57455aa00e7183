"""Embedding throughput: LLM.embed over random prompts, against the same prompts' prefill alone.

`jaxserve bench embed --model DIR --prompts 64 --lengths 32,128,512 --out bench/out/embed.json`

Each row embeds --prompts prompts of one length (random ordinary tokens, no shared prefix, the
prefix cache reset between runs) and runs them again as plain one-token generations: the
difference is what pooling costs (the pool bucket's hidden-state readback and the host pooling).
A first untimed pass of each row compiles the buckets it meets.
"""

from __future__ import annotations

import argparse
import time

from bench import common


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench embed", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF model directory (default: the embedded model)")
    p.add_argument("--prompts", type=int, default=64, help="prompts per run (default 64)")
    p.add_argument("--lengths", default="32,128,512", help="prompt lengths in tokens (default 32,128,512)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--out", default=None, help="write JSON here")
    args = p.parse_args(argv)

    import numpy as np

    from jaxserve import LLM, SamplingParams

    lengths = [int(x) for x in args.lengths.split(",")]
    llm = LLM(args.model, use_tqdm=False, precompile=False, max_model_len=max(lengths) + 8,
              max_num_batched_tokens=args.max_num_batched_tokens)
    vocab = common.ordinary_token_ids(llm.engine.model_config.vocab_size,
                                      common.special_token_ids(llm.get_tokenizer()))
    rng = np.random.default_rng(0)
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def timed(fn, prompts) -> float:
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        fn(prompts)
        return time.perf_counter() - t0

    results = []
    for n in lengths:
        prompts = [rng.choice(vocab, n).tolist() for _ in range(args.prompts)]
        embed = lambda ps: llm.embed(ps, use_tqdm=False)  # noqa: E731
        prefill = lambda ps: llm.generate(ps, one, use_tqdm=False)  # noqa: E731
        timed(embed, prompts), timed(prefill, prompts)  # compile every bucket this row meets
        t_embed, t_prefill = timed(embed, prompts), timed(prefill, prompts)
        results.append({"length": n, "prompts": args.prompts, "embed_s": t_embed, "prefill_s": t_prefill,
                        "embed_tok_s": n * args.prompts / t_embed, "prefill_tok_s": n * args.prompts / t_prefill})
    print(common.table([(r["length"], r["embed_tok_s"], r["prefill_tok_s"], r["embed_s"] / r["prefill_s"])
                        for r in results], ("prompt tokens", "embed tok/s", "prefill tok/s", "embed / prefill time"),
                       f"LLM.embed, {args.prompts} prompts per row"))
    common.report("embed", argv, model=common.model_info(llm.engine.loaded), config=vars(args),
                  results={"rows": results}, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
