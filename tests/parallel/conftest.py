"""Tensor-parallel tests need 8 (forced) CPU devices, which must be set before JAX starts its backend.

How the device count is arranged, robustly:

* `pytest tests/parallel` (only these tests collected): this process is switched to 8 CPU devices
  (`jax_num_cpu_devices`, plus XLA_FLAGS=--xla_force_host_platform_device_count=8 for any child
  process) before the backend starts, and the tests run in-process.
* Any run that also collects other folders (e.g. plain `pytest`): the other tests must keep the
  single-device JAX they were written for, and JAX cannot change its device count once started.
  So this process is left alone, and each module's parallel tests are delegated to one child pytest
  process (per module, so that xdist's two workers can run two of them at once) with the flag set;
  each test here then reports its own child result (pass / fail with the child's traceback / skip),
  so the summary still lists every parallel test by name.
* Same delegation if something already started JAX's backend with fewer devices.

Tests in this folder therefore keep their fixtures cheap (paths only); real work happens in bodies.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

N_DEVICES = 8
FLAG = f"--xla_force_host_platform_device_count={N_DEVICES}"
HERE = Path(__file__).parent
ROOT = HERE.parent.parent
CHILD_ENV = "JAXSERVE_PARALLEL_CHILD"


def xla_env(n: int = N_DEVICES) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    # An XLA compilation cache of its own: executables compiled with n host devices must never be
    # read back by the one-device test process (a clean-clone run segfaulted deserializing one in
    # the server tests that follow these). The native kernels (JAXSERVE_CACHE_DIR/kernels) are
    # shared: they do not depend on the device count, and each build costs ~45 s of CPU.
    base = env.get("JAXSERVE_CACHE_DIR") or str(ROOT / ".cache")
    env["JAXSERVE_COMPILATION_CACHE"] = os.path.join(base, f"host-devices-{n}", "xla")
    return env


def _ours(item) -> bool:
    return Path(str(item.fspath)).resolve().is_relative_to(HERE.resolve())


def _try_in_process() -> bool:
    """Give this process 8 CPU devices if JAX's backend has not started yet."""
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_num_cpu_devices", N_DEVICES)
        os.environ.update({"XLA_FLAGS": xla_env()["XLA_FLAGS"]})
    return jax.default_backend() != "cpu" or jax.device_count() >= N_DEVICES


def pytest_collection_modifyitems(session, config, items):
    mine = [it for it in items if _ours(it)]
    if not mine:
        return
    only_mine = len(mine) == len(items)
    if os.environ.get(CHILD_ENV) or (only_mine and _try_in_process()):
        return
    delegates: dict[str, _Delegate] = {}
    for it in mine:
        module = str(it.fspath)
        it.runtest = delegates.setdefault(module, _Delegate(session, module)).runner_for(it)


class _Delegate:
    def __init__(self, session, module: str):
        self.session = session  # its items, read at the first run, are the ones left after -k / -m
        self.module = module
        self.results: dict | None = None
        self.error = ""

    def _run(self):
        xml = Path(tempfile.mkdtemp(prefix="jaxserve-parallel-")) / "junit.xml"
        env = xla_env()
        env[CHILD_ENV] = "1"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
               # without xdist's "@group" suffix (--dist loadgroup), which no collector knows
               *[it.nodeid.split("@", 1)[0] for it in self.session.items if str(it.fspath) == self.module]]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        self.results = {}
        self.error = proc.stdout[-4000:] + proc.stderr[-4000:]
        if not xml.exists():
            return
        for case in ET.parse(xml).getroot().iter("testcase"):
            key = (case.get("classname", ""), case.get("name", ""))
            outcome, text = "passed", ""
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome, text = "failed", (child.get("message", "") + "\n" + (child.text or ""))
                    break
                if child.tag == "skipped":
                    outcome, text = "skipped", child.get("message", "")
            self.results[key] = (outcome, text)

    def runner_for(self, item):
        def runtest():
            if self.results is None:
                self._run()
            mod = Path(str(item.fspath)).resolve().relative_to(ROOT.resolve()).with_suffix("")
            key = (".".join(mod.parts) + (f".{item.cls.__name__}" if item.cls else ""), item.name)
            outcome, text = self.results.get(key, ("failed", "no result from the child pytest:\n" + self.error))
            if outcome == "failed":
                pytest.fail(f"[in the {N_DEVICES}-device child process]\n{text}", pytrace=False)
            if outcome == "skipped":
                pytest.skip(text)

        return runtest
