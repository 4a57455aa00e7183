"""The version-compat layer: the install pins, the memory-analysis reader, the accelerator hint."""

from __future__ import annotations

import logging
import pathlib
import tomllib

import jax
import jax.numpy as jnp
from packaging.requirements import Requirement

from jaxserve.runtime import compat

MISSING = lambda kind: (None, None)  # noqa: E731  (no plugin installed)
PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"


def _project():
    return tomllib.loads(PYPROJECT.read_text())["project"]


def test_jax_pin_admits_0_10_and_0_11_and_this_install():
    deps = {Requirement(d).name: Requirement(d) for d in _project()["dependencies"]}
    for name in ("jax", "jaxlib"):
        spec = deps[name].specifier
        assert all(v in spec for v in ("0.10.2", "0.11.0", "0.11.2")), spec
        assert "0.12.0" not in spec and "0.10.1" not in spec
    assert jax.__version__ in deps["jax"].specifier


def test_platform_extras_delegate_to_jax_extras():
    extras = _project()["optional-dependencies"]
    for extra in ("cuda12", "cuda13", "tpu"):
        (req,) = (Requirement(r) for r in extras[extra])
        assert req.name == "jax" and req.extras == {extra}
        assert "0.10.2" in req.specifier and "0.11.2" in req.specifier


def test_peak_temp_bytes_reads_the_compiled_analysis():
    f = jax.jit(lambda x: jnp.sort(x * 2.0) + jnp.cumsum(x))
    compiled = f.lower(jax.ShapeDtypeStruct((1 << 16,), jnp.float32)).compile()
    temp = compat.peak_temp_bytes(compiled)
    assert temp == compiled.memory_analysis().temp_size_in_bytes and temp >= 0

    class Fake:
        def __init__(self, analysis):
            self.analysis = analysis

        def memory_analysis(self):
            return self.analysis

    class Stats:
        def __init__(self, temp):
            self.temp_size_in_bytes = temp

    assert compat.peak_temp_bytes(Fake(None)) == 0
    assert compat.peak_temp_bytes(Fake([Stats(5), Stats(9)])) == 9


def test_memory_stats_on_cpu_is_none():
    assert compat.memory_stats(jax.devices()[0]) is None

    class Dev:
        def memory_stats(self):
            return {"bytes_limit": 10, "bytes_in_use": 3}

    assert compat.memory_stats(Dev()) == {"bytes_limit": 10, "bytes_in_use": 3}


def test_interpreter_params_resolve_on_this_jax():
    from pallas_kernels import compat as pallas_compat

    assert pallas_compat.tpu_interpret_params() is not None
    assert pallas_compat.gpu_interpret_params() is not None
    assert pallas_compat.tpu_hbm() is not None


def test_unused_gpu_logs_an_error_naming_the_extra(caplog):
    with caplog.at_level(logging.ERROR, logger="jaxserve.runtime.compat"):
        msg = compat.warn_if_accelerator_unused(lambda: {"nvidia": True, "tpu": False}, "cpu", MISSING)
    assert "not installed" in msg and "jaxserve[cuda13]" in msg and "jaxserve[cuda12]" in msg
    assert [r.getMessage() for r in caplog.records] == [msg]


def test_unused_tpu_names_the_tpu_extra():
    msg = compat.warn_if_accelerator_unused(lambda: {"nvidia": False, "tpu": True}, "cpu", MISSING)
    assert "jaxserve[tpu]" in msg


def test_installed_plugin_that_failed_names_its_error_not_install():
    """The pool-bug class: the plugin is there, its initialize() raised, jax carried on on CPU."""
    failed = lambda kind: ({"nvidia": "jax_plugins.xla_cuda13", "tpu": "libtpu"}[kind], "ValueError: boom")  # noqa: E731
    gpu = compat.accelerator_hint("cpu", {"nvidia": True}, failed)
    tpu = compat.accelerator_hint("cpu", {"tpu": True}, failed)
    for msg in (gpu, tpu):
        assert "failed to initialise: ValueError: boom" in msg and "pip install" not in msg
    assert "jax_plugins.xla_cuda13" in gpu


def test_plugin_error_logged_by_jax_is_recorded():
    """jax logs a plugin whose initialize() raised (logger.exception) and moves on; the hint
    reads that record back."""
    log = logging.getLogger("jax._src.xla_bridge")
    try:
        raise ValueError("XLA_CLIENT_MEM_FRACTION and XLA_PYTHON_CLIENT_MEM_FRACTION both set")
    except ValueError:
        log.exception("Jax plugin configuration error: Exception when calling %s.initialize()",
                      "jax_plugins.xla_cuda13")
    _, error = compat.plugin_state("nvidia")
    assert error == "ValueError: XLA_CLIENT_MEM_FRACTION and XLA_PYTHON_CLIENT_MEM_FRACTION both set"
    compat._plugin_errors.errors.clear()


def test_no_error_when_jax_uses_the_device_or_there_is_none(caplog):
    with caplog.at_level(logging.ERROR):
        assert compat.warn_if_accelerator_unused(lambda: {"nvidia": True}, "gpu") is None
        assert compat.warn_if_accelerator_unused(lambda: {"tpu": True}, "tpu") is None
        assert compat.warn_if_accelerator_unused(dict, "cpu") is None
    assert not caplog.records


def test_real_probe_on_this_host_returns_flags():
    found = compat.probe_accelerators()
    assert set(found) == {"nvidia", "tpu"} and all(isinstance(v, bool) for v in found.values())

