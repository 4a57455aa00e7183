"""Start-up cost of the weights: GGUF vs HF safetensors vs Orbax (`jaxserve convert`), and TP placement.

For each source, "to device" is the time from nothing to the parameters resident on the mesh,
ready for the first compile: `load_model` (read, dequantize / convert to the Flax tree) plus
placement (numpy sources: shard-by-shard device_put; Orbax: restore with target shardings).
Each source runs in a fresh subprocess, so nothing is shared between runs except the OS page cache
(a first "cold-ish" run is reported separately from the best of the warm repeats).

    jaxserve bench parallel_load [--model default] [--repeats 3] [--tp 1] [--out load.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import jax
from jaxserve.model.loader import load_model
from jaxserve.worker.runner import ModelRunner, RunnerConfig
t_import = time.perf_counter() - t0
t0 = time.perf_counter()
lm = load_model(sys.argv[1])
t_load = time.perf_counter() - t0
t1 = time.perf_counter()
r = ModelRunner(lm.config, lm.params, RunnerConfig(block_size=16, num_blocks=4, max_model_len=64, max_num_seqs=1,
                max_num_batched_tokens=16, tensor_parallel_size=int(sys.argv[2])))
jax.block_until_ready(r.params)
t_place = time.perf_counter() - t1
print("RESULT " + json.dumps(dict(load=t_load, place=t_place, total=t_load + t_place, imports=t_import)))
"""


def _run(path: str, tp: int) -> dict:
    env = dict(os.environ)
    if tp > 1:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={tp}").strip()
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(tp)], capture_output=True, text=True, env=env)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"load of {path} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[7:])


def _hf_dir_from_gguf(gguf: Path, dst: Path) -> Path:
    """An HF-style safetensors directory with the same (dequantized, float32) weights."""
    import numpy as np
    from safetensors.numpy import save_file

    from jaxserve.model.gguf_loader import load_gguf
    from jaxserve.tokenizer import Tokenizer

    cfg, weights = load_gguf(gguf)
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
    tok = Tokenizer.from_gguf(gguf)
    tok.hf.save_pretrained(str(dst))
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(tok.eos_token_ids)}))
    return dst


def _du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve bench parallel_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="a .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size for placement (CPU: forced devices)")
    p.add_argument("--workdir", default=None, help="where the HF and Orbax copies go (default: a temp dir)")
    p.add_argument("--out", default=None, help="append a markdown table to this file")
    args = p.parse_args(argv)

    from jaxserve.model.loader import resolve_model_path
    from jaxserve.convert import convert_model

    gguf = resolve_model_path(None if args.model == "default" else args.model)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="jaxserve-load-"))
    hf = work / "hf"
    orbax = work / "orbax"
    t0 = time.perf_counter()
    if not (hf / "config.json").exists():
        _hf_dir_from_gguf(gguf, hf)
    t_hf = time.perf_counter() - t0
    conv = None
    if not orbax.exists():
        conv = convert_model(str(gguf), str(orbax))
    sources = [("GGUF (Q4_1, dequantized at load)", str(gguf)), ("HF safetensors (float32)", str(hf)),
               ("Orbax (`jaxserve convert`, float32)", str(orbax))]
    rows = []
    for label, path in sources:
        runs = [_run(path, args.tp) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["total"])
        rows.append((label, _du(Path(path)), runs[0], best))
        print(f"{label:40s} first {runs[0]['total']:.2f}s  best {best['total']:.2f}s "
              f"(load {best['load']:.2f}s + place {best['place']:.2f}s)", flush=True)
    lines = [
        f"### Load time, {gguf.name}, tensor_parallel_size={args.tp} ({time.strftime('%Y-%m-%d')})",
        "",
        "Time from nothing to the parameters resident on the device mesh (read + convert + place), in a fresh "
        f"process per run; best of {args.repeats} (first run in parentheses; the OS page cache is warm after it).",
        "",
        "| source | size on disk | load_model | place / restore | to device (best) | first run |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, size, first, best in rows:
        lines.append(f"| {label} | {size / 2**20:.0f} MiB | {best['load']:.2f} s | {best['place']:.2f} s | "
                     f"**{best['total']:.2f} s** | ({first['total']:.2f} s) |")
    if conv:
        lines += ["", f"One-off conversion GGUF -> Orbax: {conv['seconds']:.1f} s "
                  f"(read + dequantize {conv['read_seconds']:.1f} s). HF copy written in {t_hf:.1f} s."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
