"""Where jaxserve keeps its files: the cache directory (the default model, built native kernels, the
XLA compilation cache). Imports nothing from jaxserve, so every layer may use it."""

from __future__ import annotations

import os
import pathlib


def cache_dir() -> pathlib.Path:
    """`$JAXSERVE_CACHE_DIR`, else `~/.cache/jaxserve`."""
    env = os.environ.get("JAXSERVE_CACHE_DIR")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "jaxserve"
