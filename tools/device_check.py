"""Accelerator check for jaxserve: one python3 script, no network, fits a 9-minute device lease.

The parent process never imports jax. Each phase (and inside numerics/decode/ptxas each kernel
family) runs in its own child, ``python3 tools/device_check.py --worker --phase X --unit U``,
with a timeout: a segfault, an XLA abort, an OOM kill or a hang loses that one row
(``{"ok": false, "why": "exit -11" | "timeout after N s", "stderr_tail": ...}``), never the run.
Children append their JSON lines to the same file as they measure, so a run killed by its outer
timeout keeps what it measured. Phases, in order (see tools/device_check.md):

  llm       LLM() with default settings in a fresh process, before anything else touches jax:
            which backend jax ended on, and why the plugin failed where it fell back to CPU
  env       jax, devices, memory stats, compute capability, the kernel gate's verdict
  copy      device copy bandwidth (bytes read + written), the ceiling for decode
  numerics  the Pallas kernels against the jnp reference at the served models' head shapes
  step8b    a Llama-3.1-8B-shaped engine decode step (random weights made on the device) against
            its (weight + KV bytes) / copy-bandwidth roofline
  decode    decode attention GB/s over batch x context: general kernel, split-KV kernel, xla
  ptxas     each Mosaic GPU kernel's registers / spills / shared memory from the device's compile
  prefill   prefill attention TFLOP/s (causal FLOPs counted once)
  generate  LLM.generate end to end on a random-init model (8B-wide, 2 layers), tok/s

Usage:
  python3 tools/device_check.py --out $OUT/device_check.jsonl [--phases decode,prefill]
  python3 tools/device_check.py --cpu-smoke   # the same code on CPU, interpreters, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Seconds per child (each unit of a split phase gets the whole figure); --scale multiplies them.
DEADLINES = {"llm": 60, "env": 20, "copy": 20, "numerics": 35, "step8b": 90, "decode": 40,
             "ptxas": 40, "prefill": 35, "generate": 60}
GRACE_S = 25  # on top of a child's deadline: python + jax start-up, then the kill
BUDGET_S = 520  # the whole run; tools/device_check.sh kills at 540
# Split into one child per kernel family; the others are one child each.
UNITS = {"numerics": ["general", "split_kv"], "decode": ["general", "split_kv", "xla"],
         "ptxas": ["general", "split_kv"]}
# Not on the device image: the children refuse to import them, here too (tools/device_check.md);
# the llm child imports freely and fails its row if the engine loaded any of them.
NOT_ON_IMAGE = ("starlette", "uvicorn", "gguf", "llguidance")


def block_imports(names=NOT_ON_IMAGE) -> None:
    """Make ``import X`` raise ImportError and ``find_spec`` say "not installed" for each name,
    as on the device image (a None entry in sys.modules does both)."""
    for name in names:
        if name not in sys.modules:
            sys.modules[name] = None


def append_row(path: str, phase: str, **row) -> dict:
    row = {"phase": phase, "t": round(time.time(), 2), **row}
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    brief = {k: v for k, v in row.items() if k not in ("phase", "t", "traceback", "stderr_tail")}
    print(f"[{phase}] {json.dumps(brief, default=str)[:300]}", flush=True)
    return row


def read_rows(path: str, offset: int = 0) -> list[dict]:
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a child killed mid-write
            continue
    return rows


def make_model_dir(path: str, *, layers: int, hidden: int, heads: int, kv_heads: int,
                   intermediate: int, max_pos: int, vocab: int = 384) -> str:
    """A random-init HF Llama (config.json, float16 safetensors, a real BPE tokenizer) written
    with transformers, tokenizers and numpy: no torch (the device image has none) and no jax."""
    import numpy as np
    import transformers
    from safetensors.numpy import save_file

    sys.path.insert(0, ROOT)
    from tests.tiny_models import build_tokenizer

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tok = build_tokenizer(vocab)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, torch_dtype="float16")
    cfg.save_pretrained(path)
    tok.save_pretrained(path)
    rng = np.random.default_rng(0)
    d, hd = hidden, hidden // heads
    # 4M random values, each matrix tiled from a random offset: an 8B-wide layer in a second,
    # not a minute of host RNG
    pool = (rng.standard_normal(1 << 22, np.float32) * 0.05).astype(np.float16)

    def w(*shape):
        return np.resize(np.roll(pool, int(rng.integers(pool.size))), shape)

    t = {"model.embed_tokens.weight": w(len(tok), d), "lm_head.weight": w(len(tok), d),
         "model.norm.weight": np.ones(d, np.float16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": w(heads * hd, d),
                  p + "self_attn.k_proj.weight": w(kv_heads * hd, d),
                  p + "self_attn.v_proj.weight": w(kv_heads * hd, d),
                  p + "self_attn.o_proj.weight": w(d, heads * hd),
                  p + "mlp.gate_proj.weight": w(intermediate, d),
                  p + "mlp.up_proj.weight": w(intermediate, d),
                  p + "mlp.down_proj.weight": w(d, intermediate),
                  p + "input_layernorm.weight": np.ones(d, np.float16),
                  p + "post_attention_layernorm.weight": np.ones(d, np.float16)})
    save_file(t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def run_child(opts, phase: str, unit: str | None, timeout: float, model_dir: str) -> dict | None:
    """One child; returns the failure row it cost, or None when it exited 0."""
    cmd = [sys.executable, os.path.join(HERE, "device_check.py"), "--worker", "--phase", phase,
           "--out", opts.out, "--model-dir", model_dir, "--deadline-s", str(timeout - GRACE_S * opts.scale)]
    cmd += ["--unit", unit] if unit else []
    cmd += ["--cpu-smoke"] if opts.cpu_smoke else []
    cmd += ["--step-layers", str(opts.step_layers)]
    target = phase if unit is None else f"{phase}:{unit}"
    if target in opts.inject_crash or phase in opts.inject_crash:
        cmd.append("--crash")
    if target in opts.inject_hang or phase in opts.inject_hang:
        cmd.append("--hang")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    if phase == "llm":  # the engine's defaults: none of the allocator settings the wrapper exports
        for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"):
            env.pop(k, None)
    if phase == "ptxas":
        env["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    t0 = time.time()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=None, stderr=err, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            why = None if rc == 0 else f"exit {rc}" + (f" ({signal.Signals(-rc).name})" if rc < 0 else "")
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc, why = None, f"timeout after {timeout:.0f} s"
        err.seek(0)
        tail = err.read().decode(errors="replace")[-2500:]
    seconds = round(time.time() - t0, 1)
    if why is None:
        append_row(opts.out, phase, unit=unit, phase_seconds=seconds)
        return None
    return append_row(opts.out, phase, unit=unit, ok=False, why=why, phase_seconds=seconds,
                      stderr_tail=tail)


def plan(opts, rows: list[dict]) -> list[tuple[str, str | None]]:
    platform = next((r.get("backend") for r in rows if r["phase"] == "llm" and "backend" in r), None)
    out = []
    for phase in opts.phases:
        if phase not in UNITS:
            out.append((phase, None))
            continue
        for unit in UNITS[phase]:
            if unit == "split_kv" and platform == "tpu":  # the TPU kernel has no split-KV variant
                continue
            out.append((phase, unit))
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "device_check.jsonl"))
    ap.add_argument("--phases", default=",".join(DEADLINES))
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every deadline")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run's seconds")
    ap.add_argument("--timeouts", default="",
                    help="PHASE[:UNIT]=S,...: a child's timeout, overriding its deadline")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run every phase on CPU: kernels in their interpreters, tiny shapes")
    ap.add_argument("--step-layers", type=int, default=2, help="layers of the 8B-shaped step (32: all)")
    ap.add_argument("--inject-crash", default="", help="PHASE[:UNIT],...: that child segfaults (tests)")
    ap.add_argument("--inject-hang", default="", help="PHASE[:UNIT],...: that child hangs (tests)")
    # a child's own arguments
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--unit", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--deadline-s", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--crash", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hang", action="store_true", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    opts.phases = [p for p in opts.phases.split(",") if p]
    unknown = [p for p in opts.phases if p not in DEADLINES]
    if unknown:
        ap.error(f"--phases: unknown {unknown}; choose from {','.join(DEADLINES)}")
    opts.inject_crash = set(filter(None, opts.inject_crash.split(",")))
    opts.inject_hang = set(filter(None, opts.inject_hang.split(",")))
    opts.timeouts = {k: float(v) for k, v in (kv.split("=") for kv in filter(None, opts.timeouts.split(",")))}
    return opts


def main(argv=None) -> int:
    opts = parse(argv)
    if opts.worker:
        if opts.phase != "llm":  # the llm child records instead whether the engine imported them
            block_imports()
        sys.path.insert(0, ROOT)
        from tools.device_check_worker import run_worker

        return run_worker(opts)
    start = time.time()
    open(opts.out, "a").close()
    offset = os.path.getsize(opts.out)
    model_dir = make_model_dir(tempfile.mkdtemp(prefix="dc-model-"), layers=2, hidden=64, heads=4,
                               kv_heads=2, intermediate=128, max_pos=2048)
    failures = 0
    steps = plan(opts, [])
    i = 0
    while i < len(steps):
        phase, unit = steps[i]
        left = opts.budget_s - (time.time() - start)
        timeout = opts.timeouts.get(f"{phase}:{unit}",
                                    opts.timeouts.get(phase, (DEADLINES[phase] + GRACE_S) * opts.scale))
        if left < min(timeout, 15):
            append_row(opts.out, phase, unit=unit, skipped="run budget spent")
        else:
            failures += run_child(opts, phase, unit, min(timeout, left), model_dir) is not None
        if phase == "llm":  # the units of later phases depend on the platform it saw
            steps = steps[:i + 1] + plan(opts, read_rows(opts.out, offset))[i + 1:]
        i += 1
    rows = read_rows(opts.out, offset)
    bad = [r for r in rows if r.get("ok") is False or r.get("error")]
    print(f"\n{len(rows)} rows in {opts.out}; {len(bad)} failed ({failures} children lost), "
          f"{time.time() - start:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
