"""Shared fixtures: tiny random-init HF models on disk, and engines over them."""

from __future__ import annotations

import os

import pytest

# Keep the persistent XLA compilation cache inside the test session's own folder by default, so
# tests neither depend on nor pollute the user's cache.
os.environ.setdefault("JAXSERVE_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache"))

# No persistent XLA cache reads in the test process itself: a clean-clone run segfaulted inside
# jax's cache read (compilation_cache.get_executable_and_time) in the server tests, reading an
# executable the same run had written. Subprocesses (CLI servers, the multi-device child) keep it.
import jax  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)


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
