"""The real compilers on this host: `jaxserve lower --compile` and tools/compile_tier.py.

The compile-only tests need the extras (`jaxserve[compile-cuda]`, `jaxserve[compile-tpu]`); .ci/run
installs them in a second venv and runs this file there. Without them, the CLI's one-line answer
naming the extra is what is tested. The compiler runs in a subprocess: the deviceless environment
(JAX_PLATFORMS=cpu, the CUDA directory) must be set before jax starts, which pytest's jax has.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxserve import cli
from jaxserve.errors import UserError
from jaxserve.runtime import deviceless

ROOT = Path(__file__).resolve().parents[1]
# the compilers run with XLA's default optimization level (tests/conftest.py lowers it for the suite)
COMPILER_ENV = {**os.environ, "XLA_FLAGS": " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                                     if "xla_backend_optimization_level" not in f)}
PTXAS = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'rpa_general_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for rpa_general_mosaic_gpu_kernel
    8 bytes stack frame, 212 bytes spill stores, 216 bytes spill loads
ptxas info    : Used 255 registers, used 2 barriers, 1 bytes smem
ptxas info    : Compile time = 1431.546 ms
ptxas info    : Compiling entry function 'rpa_decode_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for rpa_decode_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 254 registers, used 2 barriers, 1 bytes smem
"""


def test_ptxas_report_is_parsed_per_kernel():
    general, decode = deviceless.parse_ptxas(PTXAS)
    assert (general.name, general.registers, general.spills, general.stack_bytes) == (
        "rpa_general_mosaic_gpu_kernel", 255, 428, 8)
    assert (decode.name, decode.registers, decode.spills) == ("rpa_decode_mosaic_gpu_kernel", 254, 0)


def test_targets_read_their_config_files():
    h200 = deviceless.target("cuda", "h200")
    assert h200.compute_capability == "9.0" and h200.smem_bytes == 232448 and h200.memory_bytes > 140e9
    assert deviceless.target("cuda", "b200").compute_capability == "10.0"
    assert deviceless.target("tpu", "v6e").config == "v6e:2x2"


@pytest.mark.skipif(not deviceless.missing("cuda"), reason="the compile-cuda extra is installed here")
def test_compile_without_the_extra_is_one_line_naming_it(capsys):
    argv = ["lower", "--compile", "--platform", "cuda", "--target", "h200", "--model",
            str(ROOT / "configs/models/llama-3.2-1b.json")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxserve: error: ") and "jaxserve[compile-cuda]" in err and err.count("\n") == 1, err


def test_unknown_target_names_the_choices():
    with pytest.raises(UserError, match="Unknown GPU target 'a100': choose one of h100, h200, b200"):
        deviceless.target("cuda", "a100")


BROKEN = """
import sys
sys.path.insert(0, {root!r})
from tools import compile_tier as ct
from jaxserve.runtime import deviceless
deviceless.prepare_env(("tpu",))
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from pallas_kernels import compat

def build(offset_multiple):
    def kernel(start_ref, x_hbm, o_ref, buf, sem):
        start = start_ref[0] * offset_multiple  # {{1: any row (misaligned), 16: whole bf16 tiles}}
        copy = pltpu.make_async_copy(x_hbm.at[pl.ds(pl.multiple_of(start, offset_multiple), 16)], buf, sem)
        copy.start()
        copy.wait()
        o_ref[...] = buf[...]

    call = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.bfloat16),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,), in_specs=[pl.BlockSpec(memory_space=compat.tpu_hbm())],
            out_specs=pl.BlockSpec((16, 128), lambda i, s: (0, 0)),
            scratch_shapes=[pltpu.VMEM((16, 128), jnp.bfloat16), pltpu.SemaphoreType.DMA]))
    dev = deviceless.target("tpu", "v5e").devices(1)
    rep = NamedSharding(Mesh(dev, ("x",)), PartitionSpec())
    return lambda: jax.jit(call).lower(jax.ShapeDtypeStruct((1,), jnp.int32, sharding=rep),
                                       jax.ShapeDtypeStruct((256, 128), jnp.bfloat16, sharding=rep))

t = deviceless.target("tpu", "v5e")
good = ct.Case("selftest/v5e/aligned", "tpu", "v5e", build(16), True)
bad = ct.Case("selftest/v5e/misaligned", "tpu", "v5e", build(1), True)
rows = ct.run_cases([good, bad], {{"v5e": t}})
print("ROWS", json.dumps([(r["id"], r["status"], r["why"]) for r in rows]))
"""


@pytest.mark.skipif(bool(deviceless.missing("tpu")), reason="needs jaxserve[compile-tpu] (libtpu)")
def test_tier_fails_a_misaligned_tpu_kernel(tmp_path):
    """The tier's verdict on two real kernels: a DMA of whole bf16 tiles compiles; the same DMA at
    a row offset Mosaic cannot prove tile-aligned is a FAIL naming the alignment, not a pass."""
    script = tmp_path / "broken.py"
    script.write_text("import json\n" + textwrap.dedent(BROKEN.format(root=str(ROOT))))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=COMPILER_ENV, capture_output=True, text=True,
                          timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ROWS ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {rid: (status, why) for rid, status, why in json.loads(line[5:])}
    assert rows["selftest/v5e/aligned"][0] == "PASS", rows
    status, why = rows["selftest/v5e/misaligned"]
    assert status == "FAIL" and "aligned" in why, rows


@pytest.mark.skipif(bool(deviceless.missing("cuda")), reason="needs jaxserve[compile-cuda]")
def test_lower_compile_reports_ptxas_and_temporaries(tmp_path):
    """A 1-layer Llama-3.2-1B step for an H200, the largest mixed and decode buckets."""
    out = tmp_path / "c.json"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "lower", "--compile", "--platform", "cuda", "--target", "h200",
         "--model", str(ROOT / "configs/models/llama-3.2-1b.json"), "--num-layers", "1", "--buckets", "largest",
         "--max-model-len", "4096", "--json", str(out)],
        cwd=ROOT, env=COMPILER_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "registers" in proc.stdout and "shared memory" in proc.stdout
    rows = json.loads(out.read_text())["buckets"]
    assert [r["decode"] for r in rows] == [False, True] and all(r["ok"] and r["temp_bytes"] > 0 for r in rows)
    kernels = {k["name"]: k for r in rows for k in r["kernels"]}
    assert set(kernels) == {"rpa_general_mosaic_gpu_kernel", "rpa_decode_mosaic_gpu_kernel"}
    assert all(k["spill_stores"] == 0 and 0 < k["smem_bytes"] <= 232448 for k in kernels.values())
    assert "temporaries: compiled" in proc.stdout


@pytest.mark.skipif(bool(deviceless.missing("cuda") or deviceless.missing("tpu")),
                    reason="needs jaxserve[compile-cuda] and jaxserve[compile-tpu]")
def test_tier_compiles_the_sink_kernels(tmp_path):
    """Attention sinks (gpt-oss's shape and window) through ptxas for sm_90a and Mosaic TPU for
    v5e/v6e: the mixed-step kernels of bfloat16 and int8 KV, no spills on the GPU."""
    out = tmp_path / "tier.json"
    proc = subprocess.run([sys.executable, "tools/compile_tier.py", "--only", "*/kernel/*-sink-*/*/mixed",
                           "--json", str(out)], cwd=ROOT, env=COMPILER_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["id"]: r for r in json.loads(out.read_text())["cases"]}
    assert {i.split("/")[1] for i in rows} == {"h100", "v5e", "v6e"} and len(rows) == 6, sorted(rows)
    assert all(r["status"] == "PASS" for r in rows.values()), rows
    gpu = [k for i, r in rows.items() if i.startswith("cuda/") for k in r["kernels"]]
    assert {k["name"] for k in gpu} == {"rpa_general_mosaic_gpu_kernel"}
    assert all(k["spill_stores"] == 0 and k["spill_loads"] == 0 for k in gpu), gpu


STEP_IDS = """
import sys
sys.path.insert(0, {root!r})
from tools import compile_tier as ct
from jaxserve.runtime import deviceless
deviceless.prepare_env(("cuda", "tpu"))
for platform, name in (("cuda", ct.GPU_TARGET), ("tpu", ct.TPU_TARGETS[0])):
    for case in ct.step_cases(platform, deviceless.target(platform, name)):
        print("ID", case.id)
"""


@pytest.mark.skipif(bool(deviceless.missing("cuda") or deviceless.missing("tpu")),
                    reason="needs jaxserve[compile-cuda] and jaxserve[compile-tpu]")
def test_tier_steps_cover_moe_gemma3_and_gpt_oss(tmp_path):
    """The tier's engine-step cases (set up, not compiled): besides Llama, one bucket each of an MoE
    preset (and Qwen3-235B-A22B at expert parallelism 8), Gemma 3 and gpt-oss, at a tensor parallel
    size where the whole model's plan fits the target (prepare refuses one that does not)."""
    script = tmp_path / "ids.py"
    script.write_text(textwrap.dedent(STEP_IDS.format(root=str(ROOT))))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=COMPILER_ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ids = [x[3:] for x in proc.stdout.splitlines() if x.startswith("ID ")]
    assert {"cuda/h100/step/qwen3-30b-a3b/tp1/mixed-T512-S64", "cuda/h100/step/gemma-3-27b/tp1/decode-T64-S64",
            "cuda/h100/step/gpt-oss-120b/tp1/mixed-T512-S64", "tpu/v5e/step/qwen3-30b-a3b/tp8/mixed-T512-S64",
            "tpu/v5e/step/gemma-3-27b/tp8/decode-T64-S64",
            "tpu/v5e/step/gpt-oss-20b/tp1/mixed-T512-S64",
            "cuda/h100/step/qwen3-235b-a22b/ep-tp8/mixed-T512-S64"} <= set(ids), ids
    assert sum(i.startswith("cuda/h100/step/tp") for i in ids) == 4, ids  # Llama: mixed and decode at TP 1 and 8
    assert sum(i.startswith("tpu/v5e/step/tp") for i in ids) == 4 and not [i for i in ids if i.endswith("/plan")], ids


def test_tier_case_selection_keeps_what_ci_keeps():
    """.ci/run's filter: every TPU engine step skipped but the two it keeps; other cases untouched."""
    from tools.compile_tier import selected

    skip, keep = ["tpu/*/step/*"], ["tpu/*/step/tp8/decode-*", "tpu/*/step/qwen3-30b-a3b/*"]
    assert selected("tpu/v5e/step/tp8/decode-T64-S64", "*", skip, keep)
    assert selected("tpu/v5e/step/qwen3-30b-a3b/tp8/mixed-T512-S64", "*", skip, keep)
    assert not selected("tpu/v5e/step/tp4/mixed-T512-S64", "*", skip, keep)
    assert not selected("tpu/v5e/step/gemma-3-27b/tp8/decode-T64-S64", "*", skip, keep)
    assert selected("cuda/h100/step/tp1/mixed-T512-S64", "*", skip, keep)
    assert not selected("cuda/h100/step/tp1/mixed-T512-S64", "tpu/*", skip, keep)
