"""Speculative decoding on the default model: output tok/s with n-gram drafting against without,
on a repetitive workload (edit this code, quote and summarise, reformat a JSON record) and on
non-repetitive prompts, single stream and batched; the engines side by side, timed in alternating
rounds (a busy machine slows both alike), with the mean acceptance length.

`jaxserve bench spec_decode [--model PATH] [--k 4] [--batch 1,32] [--rounds 3] [--out f.json]`

Greedy, so both engines emit the same tokens (checked); each request stops at EOS or --max-tokens.
`--sweep 1,2,4,8,16` times speculation forced on at each batch size (disable_by_batch_size off) to
find where drafts stop paying: the engine's default disable_by_batch_size comes from it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench import common

CODE = '''def parse_config(path):
    with open(path) as f:
        lines = f.read().splitlines()
    config = {}
    for line in lines:
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config
'''
QUOTE = ("The committee met on Tuesday to review the budget. Spending on roads rose by four percent, "
         "while the parks department asked for two new staff members to maintain the riverside trail. "
         "The chair noted that the library would close early on Fridays during the summer months.")
RECORD = {"id": 4182, "name": "Ada Lovelace", "email": "ada@example.org", "roles": ["admin", "editor"],
          "address": {"street": "12 St James's Square", "city": "London", "postcode": "SW1Y 4JH"},
          "active": True}

REPETITIVE = [
    "Rename the function parse_config to load_settings in this code and print the whole code:\n\n" + CODE,
    "Add a docstring to this function and repeat the full code:\n\n" + CODE,
    "Quote the following paragraph exactly, then summarise it in one sentence:\n\n" + QUOTE,
    "Reformat this JSON record with one key per line, indented by 4 spaces:\n\n" + json.dumps(RECORD),
    "Convert this JSON record to YAML:\n\n" + json.dumps(RECORD),
    "Repeat this paragraph, replacing 'Tuesday' with 'Monday':\n\n" + QUOTE,
]
FRESH = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how photosynthesis works to a ten-year-old.",
    "Give me five ideas for a rainy weekend with children.",
    "What are the main differences between a violin and a cello?",
    "Describe the water cycle in a few paragraphs.",
    "Write a poem about autumn in a big city.",
]


def chat(llm, texts):
    tok = llm.engine.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


def timed(llm, prompts, params, batch):
    """(seconds, output tokens, token ids) for the prompts, `batch` requests at a time."""
    t0, n, ids = time.perf_counter(), 0, []
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompts[i:i + batch], params, use_tqdm=False)
        n += sum(len(o.outputs[0].token_ids) for o in outs)
        ids += [o.outputs[0].token_ids for o in outs]
    return time.perf_counter() - t0, n, ids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench spec_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded default model)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    p.add_argument("--batch", default="1,32", help="requests at a time (default 1,32)")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sweep", default="", help="batch sizes to time with speculation forced on, e.g. 1,2,4,8,16")
    p.add_argument("--out", default=None, help="write JSON here")
    args = p.parse_args(argv)

    from jaxserve import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    kw = dict(precompile=False, use_tqdm=False, max_num_seqs=32, max_num_batched_tokens=256)
    engines = {"off": LLM(args.model, **kw), "ngram": LLM(args.model, **kw, speculative_config=spec)}
    if args.sweep:
        engines["ngram-forced"] = LLM(args.model, **kw, speculative_config={**spec, "disable_by_batch_size": 64})
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    # sampled: the fresh prompts at temperature 0.8 (seeded): drafts are rejected more often, so this
    # bounds what speculation costs when it misses; outputs differ between the engines (other draws)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_tokens=args.max_tokens)
    sets = {"repetitive": chat(engines["off"], REPETITIVE), "fresh": chat(engines["off"], FRESH),
            "sampled": chat(engines["off"], FRESH)}
    cases = [(w, b) for w in sets for b in map(int, args.batch.split(","))]
    sweep = [int(b) for b in args.sweep.split(",") if b]
    results: dict = {}
    # warm-up: compiles the buckets each case meets
    for w, b in cases + [(w, b) for w in ("repetitive", "fresh") for b in sweep]:
        prompts = (sets[w] * (b // len(sets[w]) + 1))[:max(b, len(sets[w]))]
        for name, llm in engines.items():
            timed(llm, prompts, sampled if w == "sampled" else params, b)
    for _ in range(args.rounds):
        for w, b in cases:
            prompts = (sets[w] * (b // len(sets[w]) + 1))[:max(b, len(sets[w]))]
            ref = None
            for name in ("off", "ngram"):
                llm = engines[name]
                before = dict(llm.engine.speculator.stats)
                secs, n, ids = timed(llm, prompts, sampled if w == "sampled" else params, b)
                ref = ids if ref is None else ref
                if ids != ref and w != "sampled":
                    raise SystemExit(f"{w} batch {b}: ngram changed the greedy output")
                r = results.setdefault(f"{w} b={b} {name}", {"tok_s": [], "accept": []})
                r["tok_s"].append(n / secs)
                st = llm.engine.speculator.stats
                ver = st["verifications"] - before.get("verifications", 0)
                acc = st["accepted_tokens"] - before.get("accepted_tokens", 0)
                r["accept"].append(1 + acc / ver if ver else None)
        for w in ("repetitive", "fresh"):
            for b in sweep:
                prompts = (sets[w] * (b // 6 + 1))[:max(b, 6)]
                for name in ("off", "ngram-forced"):
                    secs, n, _ = timed(engines[name], prompts, params, b)
                    results.setdefault(f"sweep {w} b={b} {name}", {"tok_s": [], "accept": []})["tok_s"].append(n / secs)
    rows = []
    for key, r in results.items():
        acc = [a for a in r["accept"] if a is not None]
        rows.append((key, statistics.median(r["tok_s"]), ", ".join(f"{x:.1f}" for x in r["tok_s"]),
                     f"{statistics.mean(acc):.2f}" if acc else "-"))
    print(common.table(rows, ("case", "median out tok/s", "rounds", "mean acceptance length"),
                       f"n-gram speculative decoding (k={args.k}), greedy, LLM.generate"))
    for w, b in cases:
        off, on = (statistics.median(results[f"{w} b={b} {n}"]["tok_s"]) for n in ("off", "ngram"))
        print(f"{w} b={b}: ngram / off = {on / off:.2f}x")
    for w in ("repetitive", "fresh"):
        for b in sweep:
            off, on = (statistics.median(results[f"sweep {w} b={b} {n}"]["tok_s"]) for n in ("off", "ngram-forced"))
            print(f"sweep {w} b={b}: forced ngram / off = {on / off:.2f}x")
    common.report("spec_decode", argv, model={"model": args.model or "default"}, config=vars(args),
                  results=results, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
