"""The native kernel library's cache is verified before it is loaded (issue 31): a truncated
library used to kill every start with SIGBUS; now it is found damaged and rebuilt."""

from __future__ import annotations

import shutil

import pytest

from jaxserve.runtime import cpu_kernels, native_build


@pytest.fixture(scope="module")
def built():
    reason = cpu_kernels.available()
    if reason is not None:
        pytest.skip(f"no native CPU kernels here: {reason}")
    return native_build.build()


def test_truncated_library_is_never_loaded(built, tmp_path):
    so = tmp_path / built.name
    shutil.copy(built, so)
    assert native_build.verified(so)  # no digest yet: a child process loads it, then it is written
    assert native_build.digest_path(so).exists()
    data = so.read_bytes()
    so.write_bytes(data[: len(data) // 2])  # truncated (a full disk, a killed copy)
    assert not native_build.verified(so)  # the digest disagrees
    native_build.digest_path(so).unlink()
    assert not native_build.verified(so)  # without a digest, the child that loads it dies, not us
    assert native_build.verified(built)  # the real cache verifies


def test_builders_starting_together_build_once(tmp_path, monkeypatch):
    """Processes that start together (test workers, replicas, multi-host processes) wait for one
    build under the library's lock instead of each compiling the sources (~45 s of CPU each)."""
    import threading
    import time

    out = tmp_path / "kernels" / "jaxserve_cpu-test.so"
    builds = []

    def fake_compile(cxx, sources, header, so):
        builds.append(so)
        time.sleep(0.3)  # the others arrive while this build runs
        so.write_bytes(b"library")
        native_build.write_digest(so)

    monkeypatch.setattr(native_build, "library_path", lambda cxx, header: out)
    monkeypatch.setattr(native_build, "_compile", fake_compile)
    results = []
    threads = [threading.Thread(target=lambda: results.append(native_build.build())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [out] * 3 and builds == [out]
