"""Shared fixtures: tiny random-init HF models on disk, and engines over them."""

from __future__ import annotations

import gc
import json
import os
import pathlib

import pytest

# Keep the persistent XLA compilation cache inside the test session's own folder by default, so
# tests neither depend on nor pollute the user's cache.
os.environ.setdefault("JAXSERVE_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache"))
# Serialized step executables are keyed by the sources, not by what a test monkeypatches: off here
# (tests/test_startup.py turns them on for itself).
os.environ.setdefault("JAXSERVE_STEP_CACHE", "0")
# XLA's LLVM backend at -O0: the suite is mostly compiles of tiny steps and interpreted kernels (a
# step's compile costs ~40% less; what the tests check is computed the same: XLA:CPU does not
# reassociate floats at any level). The product compiles at XLA's default; the compile tier's
# subprocesses get their flags back (tests/test_compile_tier.py: ptxas figures depend on the level).
TEST_XLA_FLAG = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAG}".strip()

# Each module's measured seconds on one xdist worker (setup, calls, teardown), written by
# `python tools/suite_seconds.py <junit.xml>` from a run with `--junitxml`.
MODULE_SECONDS = pathlib.Path(__file__).with_name("module_seconds.json")


def pytest_configure(config):
    """xdist's loadgroup hands out groups in collection order (see below), not largest-count first."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# tryfirst: xdist's own hook turns the marks into node-id suffixes; after it, the marks group nothing
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`-n 2 --dist loadgroup`, the README's test command) a module's tests stay
    on one worker, so its module fixtures (a server, an engine) are built once (tests/parallel's
    modules too: each runs in its own 8-device child pytest). Modules are handed out longest first
    (by their measured seconds; a module not measured yet counts as a long one), so that the two
    workers finish together rather than one waiting on a long module collected last."""
    seconds = json.loads(MODULE_SECONDS.read_text()) if MODULE_SECONDS.exists() else {}
    unknown = max(seconds.values(), default=0.0)
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], unknown))
    for item in items:
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(autouse=True, scope="module")
def _release_executables(request):
    """Free what a test module dropped before the next one starts.

    Each compiled XLA:CPU step is ~130 JIT-loaded kernels, ~390 memory maps, and a Linux process
    may hold vm.max_map_count (65530) maps; past that, XLA's next compile segfaults. Engines a
    module let go of sit in reference cycles until a full collection happens to run, so over the
    whole suite the maps reached the limit (a clean-clone CI run crashed in a server fixture's
    precompile with 65201 maps). A full collection per module returns them; a module that
    still leaves the process near the limit fails here."""
    import jax

    from jaxserve.runtime import memory

    yield
    gc.collect()
    jax.clear_caches()
    maps = memory.memory_maps()
    if maps is None:
        return
    log = os.environ.get("JAXSERVE_TEST_MAPS_LOG")  # "maps module" per line, to find what holds them
    if log:
        with open(log, "a") as f:
            f.write(f"{maps[0]} {request.node.nodeid}\n")
    # Fail here, naming the module, rather than as a segfault somewhere later.
    assert maps[0] < 0.75 * maps[1], (f"after {request.node.nodeid} this process holds {maps[0]} of "
                                      f"{maps[1]} memory maps: something keeps compiled steps alive")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch="llama", **kw) -> path of a saved random-init HF model (cached per args)."""
    from tests.tiny_models import make_tiny_model

    made: dict = {}

    def get(arch: str = "llama", **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **kw)
        return str(made[key])

    return get


ENGINE_KW = dict(precompile=False, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64, num_blocks=96)


@pytest.fixture(scope="session")
def tiny_llm(tiny_model):
    """One LLM over the tiny llama, shared by tests that only read from it."""
    from jaxserve import LLM

    return LLM(tiny_model("llama"), **ENGINE_KW)
