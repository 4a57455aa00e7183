"""Grammar backends compared on the default model's tokenizer: compile time and mask time per token.

    python -m bench.structured [--fields 50] [--out out.json]
    python -m bench.structured --itl [--streams 1 32]   # needs the engine to apply grammars

For a schema with N fields of mixed types (strings with patterns, bounded numbers, enums, arrays,
a nested object), each backend compiles the schema cold (no cache), then walks the tokens of one
valid instance, filling the packed bitmask before each token and accepting it after: the per-token
cost the engine pays on the host. Tokenizer setup (once per server) is reported apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def big_schema(n: int) -> tuple[dict, dict]:
    """A schema with n properties of rotating kinds, and one instance that satisfies it."""
    props, inst = {}, {}
    for i in range(n):
        k = i % 5
        name = f"field_{i}"
        if k == 0:
            props[name], inst[name] = {"type": "string", "maxLength": 20}, f"value {i}"
        elif k == 1:
            props[name], inst[name] = {"type": "integer", "minimum": 0, "maximum": 1000}, i * 7
        elif k == 2:
            props[name], inst[name] = {"enum": ["red", "green", "blue"]}, "green"
        elif k == 3:
            props[name] = {"type": "array", "items": {"type": "number"}, "maxItems": 4}
            inst[name] = [1.5, 2.25]
        else:
            props[name] = {
                "type": "object",
                "properties": {"id": {"type": "string", "pattern": "^[a-z]{3}[0-9]{2}$"},
                               "ok": {"type": "boolean"}},
                "required": ["id", "ok"], "additionalProperties": False,
            }
            inst[name] = {"id": "abc12", "ok": True}
    schema = {"type": "object", "properties": props, "required": list(props),
              "additionalProperties": False}
    return schema, inst


def run_llguidance(hf, vocab: int, schema: dict, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    setup = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False})
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    assert not m.is_error(), m.get_error()
    mask = llguidance.numpy.allocate_token_bitmask(1, vocab)
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(m, mask)
        times.append(time.perf_counter() - t0)
        assert m.consume_token(t), m.get_error()
    return {"setup_s": setup, "compile_s": compile_s, "mask_us": _us(times),
            "batch32_fill_us": _batch_fill(lltok, grammar, tokens, vocab, 32)}


def _batch_fill(lltok, grammar: str, tokens: list[int], vocab: int, rows: int) -> dict:
    """One step's mask for `rows` sequences at spread-out positions of the instance, filled in
    parallel by jaxserve's BitmaskFiller (what the engine calls per step)."""
    import llguidance

    from jaxserve.structured.matcher import BitmaskFiller, Matcher, bitmask_width

    template = llguidance.LLMatcher(lltok, grammar)
    ms = []
    for r in range(rows):
        m = Matcher(template.deep_copy(), vocab)
        for t in tokens[: r * len(tokens) // rows]:
            m.accept(t)
        ms.append(m)
    mask = np.zeros((rows, bitmask_width(vocab)), np.int32)
    filler = BitmaskFiller()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        filler.fill(ms, mask)
        times.append(time.perf_counter() - t0)
    return _us(times)


def run_xgrammar(hf, vocab: int, schema: dict, tokens: list[int]) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    comp = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    cg = comp.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - t0
    m = xgr.GrammarMatcher(cg)
    mask = np.zeros((1, (vocab + 31) // 32), np.int32)
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t0)
        assert m.accept_token(t)
    return {"setup_s": setup, "compile_s": compile_s, "mask_us": _us(times)}


def _us(times: list[float]) -> dict:
    us = sorted(x * 1e6 for x in times)
    return {"mean": statistics.fmean(us), "p50": us[len(us) // 2], "p99": us[int(len(us) * .99)],
            "max": us[-1]}


def itl(streams: list[int], steps: int = 32, reps: int = 3) -> dict:
    """Median decode step time (= inter-token latency) on the default model, all rows constrained
    by a JSON schema vs none, with every stream decoding."""
    from jaxserve import LLM
    from jaxserve.engine import LLMEngine
    from jaxserve.model.default_model import default_model_path
    from jaxserve.sampling_params import SamplingParams

    if not hasattr(LLMEngine, "supports_structured_outputs"):
        raise SystemExit("this engine does not apply structured-output grammars yet")
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
              "minItems": 200, "maxItems": 200}
    llm = LLM(str(default_model_path()), max_num_seqs=max(streams), max_model_len=1024)
    eng = llm.engine
    out = {}
    for n in streams:
        runs: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
        for rep in range(reps):  # alternate, so drifting machine load hits both alike
            for label, so in (("unconstrained", None), ("json_schema", {"json": schema})):
                p = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True,
                                   structured_outputs=so)
                for i in range(n):
                    eng.add_request(f"{label}-{n}-{rep}-{i}", f"List numbers, run {i}:", p)
                times = []
                while eng.has_unfinished_requests():
                    t0 = time.perf_counter()
                    eng.step()
                    if eng.scheduler.num_waiting == 0:
                        times.append(time.perf_counter() - t0)
                times = sorted(times[2:-2])  # steady decode: drop the ramp and the tail
                runs[label].append(times[len(times) // 2] * 1e3)
        for label, v in runs.items():
            out[f"{label}@{n}"] = statistics.median(v)
            print(f"{n:>3} streams {label:<14} ITL p50 {out[f'{label}@{n}']:.1f} ms "
                  f"(runs: {', '.join(f'{x:.1f}' for x in v)})")
        ratio = out[f"json_schema@{n}"] / out[f"unconstrained@{n}"] - 1
        print(f"{n:>3} streams overhead {100 * ratio:+.1f} %")
    return out


def main(argv=None) -> None:
    from bench.common import report

    ap = argparse.ArgumentParser()
    ap.add_argument("--fields", type=int, default=50)
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--itl", action="store_true", help="ITL with a json_schema vs unconstrained")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    args = ap.parse_args(argv)
    model = {"name": "SmolLM2-135M-Instruct", "vocab_size": 49152}
    if args.itl:
        report("structured", argv, model=model, config={"itl": True, "streams": args.streams},
               results=itl(args.streams), out=args.out)
        return
    from jaxserve.model.default_model import default_model_path
    from jaxserve.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_model_path())
    vocab = 49152  # the model's embedding rows
    schema, inst = big_schema(args.fields)
    tokens = tok.encode(json.dumps(inst, separators=(",", ":")), add_special_tokens=False)
    rows = {}
    for name, fn in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar)):
        try:
            rows[name] = fn(tok.hf, vocab, schema, tokens)
        except ImportError:  # xgrammar is not a dependency (it needs torch): pip install it
            print(f"{name}: not installed, skipped")
    print(f"{args.fields}-field schema, {len(tokens)} tokens, vocab {vocab}")
    print(f"{'backend':<12}{'setup s':>9}{'compile s':>11}{'mask mean us':>14}{'p50':>8}"
          f"{'p99':>8}{'max':>8}")
    for name, r in rows.items():
        m = r["mask_us"]
        print(f"{name:<12}{r['setup_s']:>9.3f}{r['compile_s']:>11.4f}{m['mean']:>14.1f}"
              f"{m['p50']:>8.1f}{m['p99']:>8.1f}{m['max']:>8.1f}")
    if "llguidance" in rows:
        b = rows["llguidance"]["batch32_fill_us"]
        print(f"llguidance: one step's mask for 32 rows: mean {b['mean']:.0f} us, "
              f"p50 {b['p50']:.0f} us, max {b['max']:.0f} us")
    report("structured", argv, model=model, config={"fields": args.fields, "tokens": len(tokens)},
           results=rows, out=args.out)


if __name__ == "__main__":
    main()
