"""`jaxserve bench grammar_bounds`: what llguidance does with deep and big grammars (issue 31).

Each case is compiled (validate_grammar + LLMatcher, as GrammarCompiler._compile does, but without
the admission bounds of jaxserve/limits.py) in a fresh subprocess whose compile thread has the
given stack, so a stack overflow shows up as a signal instead of killing the benchmark. Per case:
the outcome (ok, a grammar error, or the signal that ended the process) and the compile seconds.
It answers two questions: at what depth llguidance overflows a stack (the 8 MiB default of a
thread vs the pool's COMPILE_STACK_BYTES), and how long the slowest grammar that passes the
admission bounds takes to compile (what one request can hold a compile worker for).

    jaxserve bench grammar_bounds [--vocab default|tiny] [--out bench/out/grammar_bounds.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

from bench.common import report, table


def chain(n: int) -> str:
    return "\n".join(["start: r0"] + [f'r{i}: r{i + 1} "a"' for i in range(n)] + [f'r{n}: "b"'])


def parens(n: int) -> str:
    return "start: " + "(" * n + '"a"' + ")" * n


def schema_depth(n: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def wide_schema(props: int) -> dict:  # ~256 KiB canonical: the MAX_SCHEMA_BYTES bound
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,8}",
                                                       "description": "x" * 20} for i in range(props)},
            "required": [f"p{i}" for i in range(0, props, 2)]}


def alternatives(n: int) -> str:
    return "start: " + " | ".join(json.dumps(f"{i:04d}" + "q" * 56) for i in range(n))


def alternation(n: int) -> str:
    return "|".join(f"w{i}[a-z]{{2,5}}" for i in range(n))


BUILDERS = {"chain": chain, "parens": parens, "schema_depth": schema_depth, "wide_schema": wide_schema,
            "alternatives": alternatives, "alternation": alternation}


def cases() -> list[tuple[str, str, str, int]]:
    """(name, kind, builder, size): the child builds the value (a 10,000-deep schema cannot be
    pickled to it)."""
    out = [(f"lark chain, {n} rules", "lark", "chain", n) for n in (2000, 3000, 4000, 5000, 10_000, 20_000, 50_000)]
    out += [(f"lark parens, depth {n}", "lark", "parens", n) for n in (20, 30, 200, 5000)]
    out += [(f"json schema, depth {n}", "json", "schema_depth", n) for n in (64, 500, 2000, 10_000)]
    out.append(("json schema, 2600 props (~256 KiB)", "json", "wide_schema", 2600))
    out.append(("lark, 2000 alternatives of 60 chars (~128 KiB)", "lark", "alternatives", 2000))
    out.append(("regex, 12,000-way alternation (~150 KiB)", "regex", "alternation", 12_000))
    return out


def _child(vocab: str, kind: str, builder: str, size: int, stack: int, conn) -> None:
    import sys
    import threading

    sys.setrecursionlimit(100_000)

    import llguidance
    import llguidance.hf

    if vocab == "default":
        from jaxserve.model.default_model import default_model_path
        from jaxserve.tokenizer import Tokenizer
        hf, n = Tokenizer.from_pretrained(default_model_path()).hf, 49152
    else:
        from tests.tiny_models import build_tokenizer
        hf = build_tokenizer()
        n = len(hf)
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=n)
    res = {}

    def work() -> None:
        value = BUILDERS[builder](size)
        t0 = time.perf_counter()
        M = llguidance.LLMatcher
        if kind == "json":
            g = M.grammar_from_json_schema(value, defaults={"whitespace_flexible": False})
        elif kind == "regex":
            g = M.grammar_from_regex(value)
        else:
            g = value
        err = M.validate_grammar(g, tok)
        if not err:
            m = M(tok, g, log_level=0)
            err = m.get_error() if m.is_error() else ""
        res.update(s=time.perf_counter() - t0, err=err.strip().splitlines()[0][:90] if err else "")

    threading.stack_size(stack)
    t = threading.Thread(target=work)
    t.start()
    t.join()
    conn.send(res)


def run_case(vocab: str, kind: str, builder: str, size: int, stack: int, timeout: float) -> dict:
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(vocab, kind, builder, size, stack, send))
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
        return {"outcome": f"still running after {timeout:g} s", "s": None}
    if p.exitcode != 0:
        return {"outcome": f"crashed (exit {p.exitcode})", "s": None}
    r = recv.recv()
    return {"outcome": f"error: {r['err']}" if r["err"] else "ok", "s": r["s"]}


def main(argv=None) -> None:
    from jaxserve.structured.compiler import COMPILE_STACK_BYTES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", choices=["default", "tiny"], default="default")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    stacks = {"8 MiB": 8 << 20, f"{COMPILE_STACK_BYTES >> 20} MiB (pool)": COMPILE_STACK_BYTES}
    rows, results = [], []
    for name, kind, builder, size in cases():
        row = [name]
        for label, stack in stacks.items():
            r = run_case(args.vocab, kind, builder, size, stack, args.timeout)
            results.append({"case": name, "stack": label, **r})
            row += [r["outcome"][:60], "-" if r["s"] is None else f"{r['s']:.3f}"]
            print(f"{name} [{label}]: {r['outcome']} {r['s']}", flush=True)
        rows.append(row)
    headers = ["case"] + [h for label in stacks for h in (label, "s")]
    print(table(rows, headers, title=f"llguidance compile outcome by thread stack (vocab: {args.vocab})"))
    report("grammar_bounds", argv, model={"vocab": args.vocab}, config={"stacks": stacks, "timeout": args.timeout},
           results={"cases": results}, out=args.out, jax_devices=False)


if __name__ == "__main__":
    main()
