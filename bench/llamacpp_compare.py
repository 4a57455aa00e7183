"""`jaxserve bench llamacpp_compare`: single-stream decode next to llama.cpp on the same GGUF file.

Both engines run in-process on one stream: llama.cpp through `llama-cpp-python` (imported here
if this interpreter has it, else in a worker process started with --llamacpp-python, e.g. a venv
of its own; reported as not installed where neither works), jaxserve through `LLM.generate` with
the file's blocks kept packed (`gguf`: Q4_1 layers, a Q8_0 embedding for the default model) and
dequantized to float32 (`none`). Same prompt, greedy, --tokens tokens a round, the engines timed
in alternating rounds so a busy machine slows them alike. llama.cpp's rate is the time of the
tokens after its first (prompt evaluation excluded); jaxserve's, bench/quant_decode.py's.

    jaxserve bench llamacpp_compare [--model F.gguf] [--tokens 128] [--rounds 5] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = "The capital of France is"
DEFAULT_VENV_PYTHON = "/tmp/llamacpp-venv/bin/python"  # where the bench notes build it (RESULTS.md)


# ---- the llama.cpp half (no jaxserve import: it may run in another interpreter) -----------------
class LlamaCpp:
    """One llama.cpp model; `rate()` decodes --tokens greedy tokens after the first, in tok/s."""

    def __init__(self, path: str, tokens: int, threads: int, extra_bufts: bool = True):
        import llama_cpp
        import llama_cpp.llama_cpp as api  # what llama_cpp.Llama builds its model params with

        if not extra_bufts:  # llama.cpp's repacked / AMX weight buffers off (llama_model_params.use_extra_bufts)
            defaults = api.llama_model_default_params

            def params():
                p = defaults()
                p.use_extra_bufts = False
                return p

            api.llama_model_default_params = params
        self.tokens = tokens
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=threads, n_batch=64, verbose=False)
        self.prompt = self.llm.tokenize(PROMPT.encode())
        self.version = __import__("llama_cpp").__version__

    def rate(self) -> float:
        gen = self.llm.generate(self.prompt, top_k=1, temp=0.0, reset=True)
        next(gen)  # prompt evaluated, first token sampled
        t0 = time.perf_counter()
        for _ in range(self.tokens):
            next(gen)  # generate() runs on past end-of-sequence: exactly this many steps
        elapsed = time.perf_counter() - t0
        gen.close()
        return self.tokens / max(elapsed, 1e-9)


def worker(argv) -> int:
    """Line protocol over stdin/stdout: prints {"version"} once loaded, then one {"rate"} per line
    read, until stdin closes."""
    path, tokens, threads, extra = argv[0], int(argv[1]), int(argv[2]), argv[3] == "1"
    engine = LlamaCpp(path, tokens, threads, extra)
    print(json.dumps({"version": engine.version}), flush=True)
    for _ in sys.stdin:
        print(json.dumps({"rate": engine.rate()}), flush=True)
    return 0


class RemoteLlamaCpp:
    """`LlamaCpp` in a worker process of another interpreter (its own venv)."""

    def __init__(self, python: str, path: str, tokens: int, threads: int, extra_bufts: bool = True):
        self.proc = subprocess.Popen([python, __file__, "--worker", path, str(tokens), str(threads),
                                      "1" if extra_bufts else "0"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.version = self._read()["version"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp worker exited ({self.proc.wait()})")
        return json.loads(line)

    def rate(self) -> float:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return self._read()["rate"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def open_llamacpp(python: str | None, path: str, tokens: int, threads: int, extra_bufts: bool = True):
    """(engine or None, why not): here if llama_cpp imports, else through `python`."""
    try:
        return LlamaCpp(path, tokens, threads, extra_bufts), None
    except ImportError:
        pass
    if not python or not os.path.exists(python):
        return None, "llama-cpp-python not installed (pass --llamacpp-python PATH to a python that has it)"
    try:
        return RemoteLlamaCpp(python, path, tokens, threads, extra_bufts), None
    except (OSError, RuntimeError, KeyError, json.JSONDecodeError) as e:
        return None, f"llama-cpp-python not usable through {python}: {e}"


# ---- the comparison -------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench llamacpp_compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help=".gguf file (default: the embedded default model's file)")
    p.add_argument("--formats", default="gguf,none", help="jaxserve's formats: gguf (kept packed), none (float32), "
                   "or any --quantization (default gguf,none)")
    p.add_argument("--tokens", type=int, default=128, help="decode steps timed per round (default 128)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="llama.cpp threads (default: all cores; on a busy machine "
                   "also try 1: its threads spin-wait for each other at every op)")
    p.add_argument("--llamacpp-python", default=os.environ.get("JAXSERVE_LLAMACPP_PYTHON", DEFAULT_VENV_PYTHON),
                   help="a python with llama-cpp-python, where this one has not ('' for none; default "
                   f"$JAXSERVE_LLAMACPP_PYTHON or {DEFAULT_VENV_PYTHON})")
    p.add_argument("--no-extra-bufts", action="store_true", help="llama.cpp without its repacked / AMX weight "
                   "buffers (llama-cpp-python 0.3.36's AMX matmul segfaults at 2 threads on an AMX Xeon)")
    p.add_argument("--out", default=None, help="write JSON here")
    args = p.parse_args(argv)

    from bench import common
    from bench.quant_decode import decode_rate
    from jaxserve import LLM
    from jaxserve.model.loader import resolve_model_path

    path = str(resolve_model_path(args.model))
    llama, why = open_llamacpp(args.llamacpp_python, path, args.tokens, args.threads, not args.no_extra_bufts)
    engines = {} if llama is None else {f"llama.cpp {llama.version}": llama.rate}
    for f in args.formats.split(","):
        llm = LLM(path, quantization=f, precompile=False, use_tqdm=False,
                  max_num_seqs=1, max_num_batched_tokens=64, num_blocks=64)
        decode_rate(llm, PROMPT, args.tokens)  # warm-up: compiles every bucket one stream meets
        engines[f"jaxserve {'float32' if f == 'none' else f}"] = (lambda llm=llm: decode_rate(llm, PROMPT, args.tokens))
    if llama is not None:
        llama.rate()  # warm-up
    load = os.getloadavg()[0]
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, rate in engines.items():
            rates[name].append(rate())
    if isinstance(llama, RemoteLlamaCpp):
        llama.close()
    rows = [(name, statistics.median(r), max(r), ", ".join(f"{x:.0f}" for x in r)) for name, r in rates.items()]
    if llama is None:
        rows.insert(0, ("llama.cpp", "-", "-", why))
    title = (f"Single-stream decode on {os.path.basename(path)}, {args.tokens} tokens a round, "
             f"load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
    print(common.table(rows, ("engine", "median tok/s", "best tok/s", "rounds"), title))
    common.report("llamacpp_compare", argv, model={"path": path}, config=vars(args),
                  results={"rates": rates, "llamacpp": why or "ok", "load_average_before": load,
                           "load_average_after": os.getloadavg()[0]}, out=args.out)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        raise SystemExit(worker(sys.argv[2:]))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
