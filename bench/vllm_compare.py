"""`jaxserve bench vllm_compare`: vLLM's CPU build and `jaxserve serve` under one load, same session.

Each engine is started alone on a free 127.0.0.1 port, checked with one greedy probe (the texts
must agree), driven by `jaxserve bench serve`'s client (bench/serve.py: the same token-id prompts,
greedy, ignore_eos, streaming) level by level, and stopped. Engines alternate per round (round 1:
A B, round 2: B A) so that drift of a shared machine hits both. The 1-minute load average is
recorded around every level, since other work on the machine changes the figures.

Engines: `jaxserve` (the default model with the defaults: the format jaxserve/default_format.py picks
for this machine, its default bfloat16 KV), `jaxserve-f32` (`--quantization none`: float32 compute),
`jaxserve-gguf` (`--quantization gguf`: Q4_1 blocks kept), `jaxserve-bf16` and
`jaxserve-w8a8` (`--quantization bfloat16` / `w8a8`: PRECISION says what each computes in), `vllm` (vLLM's CPU build
from its own venv on an HF export of the same GGUF, tools/export_hf.py, `--dtype bfloat16`; its
OpenMP threads bound to every core, where its default would reserve one of them).

    jaxserve bench vllm_compare --engines jaxserve,vllm --rounds 2 --concurrency 1,8,32 \
        --num-requests 32 --out bench/out/vllm_compare.json

vLLM's CPU guide asks for tcmalloc and Intel's OpenMP in LD_PRELOAD; both are set by default where
found (`--vllm-ld-preload auto`). On this 2-core VM vLLM's output tok/s rose 2-4x with them, under
a somewhat lower load (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common, launch, serve

# jaxserve variants: the server flags that make each one (`jaxserve serve` + these)
JAXSERVE_FLAGS = {
    "jaxserve": "",
    "jaxserve-f32": "--quantization none",
    "jaxserve-gguf": "--quantization gguf",
    "jaxserve-bf16": "--quantization bfloat16",
    "jaxserve-w8a8": "--quantization w8a8",
    "jaxserve-w4a8": "--quantization w4a8",
}
ENGINES = (*JAXSERVE_FLAGS, "vllm")
# Quantized activations change the arithmetic, so their greedy text may part from the others' (it
# is reported, not compared). The gguf format reads the same float32 values as the default path.
LOSSY = {"jaxserve-w8a8", "jaxserve-w4a8"}
PRECISION = {
    "jaxserve": "the defaults: this machine's default format (jaxserve/default_format.py), bfloat16 KV",
    "jaxserve-f32": "float32 weights (Q4_1 dequantized) and compute (--quantization none), bfloat16 KV",
    "jaxserve-gguf": "Q4_1 weights kept (--quantization gguf), float32 compute, bfloat16 KV",
    "jaxserve-bf16": "bfloat16 weights and matmul inputs (--quantization bfloat16), float32 accumulation, bfloat16 KV",
    "jaxserve-w8a8": "int8 weights per channel, int8 activations per 32-block (--quantization w8a8), bfloat16 KV",
    "jaxserve-w4a8": "the file's Q4_1 blocks (Q8_0 embedding and head, float32 compute), int8 activations per "
                     "32-block (--quantization w4a8), bfloat16 KV",
    "vllm": "bfloat16 weights, compute and KV (--dtype bfloat16)",
}
PROBE = "The capital of France is"


@contextlib.contextmanager
def launched_vllm(args):
    """vLLM's OpenAI server from --vllm-python on a free port; yields (base URL, info); stops its
    whole process group (the API server and its engine-core children) afterwards."""
    port = launch.free_port()
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.export_dir),
           "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
           *shlex.split(args.vllm_args)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    preload = default_preload(args.vllm_python) if args.vllm_ld_preload == "auto" else args.vllm_ld_preload
    if preload and preload != "none":
        env["LD_PRELOAD"] = preload
    log_path = os.path.join(tempfile.gettempdir(), f"vllm-compare-{port}.log")
    log = open(log_path, "w")  # noqa: SIM115 - closed in finally
    print(f"launching: {shlex.join(cmd)}  (log: {log_path})", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        common.wait_healthy(proc, url, args.launch_timeout, lambda: Path(log_path).read_text()[-2000:])
        print(f"vllm healthy after {time.perf_counter() - t0:.1f} s", flush=True)
        yield url, {"command": shlex.join(cmd), "ready_s": time.perf_counter() - t0, "log": log_path}
    finally:
        common.stop_server(proc)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # engine-core children left behind, if any
        log.close()


def default_preload(vllm_python: str) -> str:
    """tcmalloc (system) and libiomp5 (vLLM's venv), those found: vLLM's CPU guide preloads both."""
    import ctypes.util

    libs = [ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")]
    iomp = Path(vllm_python).parent.parent / "lib" / "libiomp5.so"
    libs.append(str(iomp) if iomp.is_file() else None)
    return ":".join(x for x in libs if x)


def launched(engine: str, args):
    if engine == "vllm":
        return launched_vllm(args)
    ns = argparse.Namespace(model=args.model, server_args=f"{JAXSERVE_FLAGS[engine]} {args.jaxserve_args}",
                            server_log=None, launch_timeout=args.launch_timeout)
    return launch.launched_server(ns)


async def probe(url: str, max_tokens: int = 24) -> str:
    """Greedy text for PROBE (a sanity check that both engines run the same model)."""
    import httpx

    async with httpx.AsyncClient(timeout=300) as c:
        model = (await c.get(url + "/v1/models")).json()["data"][0]["id"]
        r = await c.post(url + "/v1/completions", json={
            "model": model, "prompt": PROBE, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        return r.json()["choices"][0]["text"]


def run_engine(engine: str, rnd: int, args, items) -> list[dict]:
    """One engine, one round: probe, then every concurrency level; one record per level."""
    records = []
    with launched(engine, args) as (url, info):
        text = asyncio.run(probe(url))
        print(f"{engine} probe: {text!r}", flush=True)
        for i, c in enumerate(args.concurrency.split(",")):
            sargs = serve.build_parser().parse_args([
                "--base-url", url, "--concurrency", c, "--num-requests", str(args.num_requests),
                "--dataset", args.dataset, "--prompt-len", args.prompt_len, "--output-len", args.output_len,
                "--seed", str(args.seed), "--warmup", "2" if i == 0 else "0"])
            load0 = os.getloadavg()[0]
            _, levels = asyncio.run(serve._bench(url, sargs, items, {}))
            _, s, _ = levels[0]
            records.append({"engine": engine, "round": rnd, "concurrency": int(c), "probe": text,
                            "server": info, "load1_before": load0, "load1_after": os.getloadavg()[0],
                            "summary": s})
    return records


def aggregate(records: list[dict]) -> list[dict]:
    """engine x concurrency: out tok/s of each round and their mean, TTFT and TPOT medians (mean over
    rounds), failures, the load-average range seen."""
    rows = []
    keys = sorted({(r["engine"], r["concurrency"]) for r in records},
                  key=lambda k: (k[1], ENGINES.index(k[0])))
    for engine, c in keys:
        rs = sorted((r for r in records if (r["engine"], r["concurrency"]) == (engine, c)),
                    key=lambda r: r["round"])
        s = [r["summary"] for r in rs]
        loads = [x for r in rs for x in (r["load1_before"], r["load1_after"])]
        rows.append({
            "engine": engine, "concurrency": c, "rounds": len(rs),
            "out_tok_s": [x["output_tok_s"] for x in s],
            "out_tok_s_mean": statistics.fmean(x["output_tok_s"] for x in s),
            "ttft_median_ms": statistics.fmean(x["ttft_ms"]["median"] for x in s),
            "tpot_median_ms": statistics.fmean(x["tpot_ms"]["median"] for x in s),
            "failed": sum(x["failed"] for x in s), "load1": [min(loads), max(loads)],
        })
    return rows


def print_table(rows: list[dict]) -> None:
    table = [(r["engine"], r["concurrency"], " / ".join(f"{x:.1f}" for x in r["out_tok_s"]),
              r["out_tok_s_mean"], r["ttft_median_ms"], r["tpot_median_ms"], r["failed"],
              f"{r['load1'][0]:.1f}-{r['load1'][1]:.1f}") for r in rows]
    print(common.table(table, ("engine", "streams", "out tok/s per round", "mean out tok/s",
                               "TTFT med ms", "TPOT med ms", "failed", "load avg 1m"), "vLLM vs jaxserve"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxserve bench vllm_compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--engines", default="jaxserve,vllm", help=f"comma-separated, of {', '.join(ENGINES)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--num-requests", type=int, default=32, help="requests per level")
    p.add_argument("--dataset", default="mixed")
    p.add_argument("--prompt-len", default="200,200")
    p.add_argument("--output-len", default="128,128")
    p.add_argument("--seed", type=int, default=0)
    add_launch_args(p)
    return p


def add_launch_args(p: argparse.ArgumentParser) -> None:
    """`launched`'s settings (vLLM's venv and server, the HF export, the launch timeout) and --out."""
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python", help="python of vLLM's venv")
    p.add_argument("--vllm-args", default="", help="extra vLLM server arguments, one string")
    p.add_argument("--jaxserve-args", default="", help="extra `jaxserve serve` arguments, one string")
    p.add_argument("--vllm-ld-preload", default="auto", help="LD_PRELOAD for vLLM; auto (default): tcmalloc "
                   "and the venv's libiomp5.so where found (vLLM's CPU guide); none: nothing")
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument("--export-dir", default=os.path.join(tempfile.gettempdir(), "jaxserve-export-hf"),
                   help="HF export of the default model for vLLM (written by tools/export_hf.py if absent)")
    p.add_argument("--model", default=None, help="an HF checkpoint directory both engines serve instead of the "
                   "default model (e.g. the tiny MoE `jaxserve bench moe_decode --save-models` writes)")
    p.add_argument("--launch-timeout", type=float, default=900)
    p.add_argument("--out", default=None, help="write JSON here")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    engines = args.engines.split(",")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise ValueError(f"Unknown engine(s) {unknown}: choose from {', '.join(ENGINES)}.")
    if "vllm" in engines:
        prepare_export(args)
    sargs = serve.build_parser().parse_args(["--dataset", args.dataset, "--prompt-len", args.prompt_len,
                                             "--output-len", args.output_len, "--seed", str(args.seed),
                                             "--num-requests", str(args.num_requests),
                                             *(["--model", args.model] if args.model else [])])
    items, ds_info = serve.load_dataset(sargs)
    records = []
    for rnd in range(args.rounds):
        for engine in (engines if rnd % 2 == 0 else engines[::-1]):
            records += run_engine(engine, rnd, args, items)
            rows, agree = write_report(argv, args, engines, ds_info, records)  # after each: a partial file
    print_table(rows)
    lossy = sorted(LOSSY & set(engines))
    print(f"greedy probe {PROBE!r} agrees across engines{' but ' + ', '.join(lossy) if lossy else ''}: {agree}")
    return 0 if agree and not any(r["failed"] for r in rows) else 1


def prepare_export(args) -> None:
    """What vLLM serves: --model where given (args.export_dir becomes it), else the default model's
    HF export (tools/export_hf.py writes it once into --export-dir)."""
    if args.model:
        args.export_dir = args.model
    elif not (Path(args.export_dir) / "config.json").is_file():
        subprocess.run([sys.executable, str(common.REPO / "tools" / "export_hf.py"), "--out", args.export_dir],
                       check=True, cwd=common.REPO, env={**os.environ, "PYTHONPATH": str(common.REPO)})


def models(args) -> dict:
    """What each engine served, for the report."""
    if args.model:
        return {"jaxserve": args.model, "vllm": args.model}
    return {"jaxserve": "default (SmolLM2-135M-Instruct Q4_1 GGUF)", "vllm": str(args.export_dir)}


def write_report(argv, args, engines, ds_info, records) -> tuple[list[dict], bool]:
    rows = aggregate(records)
    probes = {r["engine"]: r["probe"] for r in records}
    agree = len({text for e, text in probes.items() if e not in LOSSY}) <= 1
    common.report("vllm_compare", argv, model=models(args),
                  config={**vars(args), "dataset_info": ds_info, "precision": {e: PRECISION[e] for e in engines}},
                  results={"table": rows, "runs": records, "probes": probes, "probes_agree": agree},
                  out=args.out, jax_devices=False)
    return rows, agree


if __name__ == "__main__":
    raise SystemExit(main())
