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
