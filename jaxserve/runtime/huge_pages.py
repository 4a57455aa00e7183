"""The CPU KV cache on 2 MiB pages (Linux transparent huge pages).

A decode step's attention reads a few KiB from each of its sequences' blocks, and after a while
of serving those blocks lie anywhere in a ~900 MiB cache: on 4 KiB pages nearly every block read
misses the TLB. On 2 MiB pages the whole cache needs ~450 TLB entries. bench/RESULTS.md has the
figures (decode steps and prefill steps, with and without).

Where the kernel's THP mode is `madvise` (the common default), memory is on 2 MiB pages only where
the process asked. XLA allocates the cache and fills it with zeros; we then ask for huge pages on
each array's 2 MiB-aligned inside (MADV_HUGEPAGE), give its zero-filled 4 KiB pages back
(MADV_DONTNEED: an anonymous private mapping reads zeros afterwards, so the cache's contents do
not change) and fault it in again at once (MADV_POPULATE_WRITE), now on huge pages, so that no
step pays for a first touch. Only for arrays that hold zeros still, i.e. right after allocation.
Anything the kernel refuses (an old kernel, THP `never`, no free huge pages) leaves the cache on
4 KiB pages, as before; so does `JAXSERVE_KV_HUGE_PAGES=0` (`jaxserve bench kv_pages` compares the two).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from pathlib import Path

import jax

log = logging.getLogger(__name__)

HUGE = 2 << 20
MADV_DONTNEED, MADV_HUGEPAGE, MADV_POPULATE_WRITE = 4, 14, 23
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ENV = "JAXSERVE_KV_HUGE_PAGES"  # "0": leave the KV cache on 4 KiB pages


def thp_mode() -> str | None:
    """The bracketed choice in THP_MODE (`always`, `madvise`, `never`), None where there is none."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def aligned_inside(ptr: int, nbytes: int) -> tuple[int, int]:
    """The 2 MiB-aligned range inside [ptr, ptr + nbytes): (start, length), length 0 if none."""
    start = -(-ptr // HUGE) * HUGE
    end = (ptr + nbytes) // HUGE * HUGE
    return start, max(0, end - start)


def _buffers(arrays) -> list[tuple[int, int]]:
    """(address, bytes) of every local buffer of jax arrays on the CPU."""
    out = []
    for a in arrays:
        for shard in a.addressable_shards:
            out.append((shard.data.unsafe_buffer_pointer(), shard.data.nbytes))
    return out


def back_zeroed_with_huge_pages(arrays) -> int:
    """Put zero-filled CPU jax arrays on 2 MiB pages (module docstring); returns the bytes moved.
    The arrays must hold zeros only and no step may be using them."""
    off = os.environ.get(ENV, "1") == "0"
    if off or not sys.platform.startswith("linux") or thp_mode() not in ("always", "madvise"):
        return 0
    arrays = list(arrays)
    shapes_only = any(not isinstance(a, jax.Array) for a in arrays)  # an abstract runner's (`jaxserve lower`)
    if not arrays or shapes_only or any(d.platform != "cpu" for a in arrays for d in a.devices()):
        return 0
    for a in arrays:
        a.block_until_ready()  # the zero fill has run: nothing writes them while we advise
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    moved = 0
    for ptr, nbytes in _buffers(arrays):
        start, length = aligned_inside(ptr, nbytes)
        if not length:
            continue
        if libc.madvise(start, length, MADV_HUGEPAGE) or libc.madvise(start, length, MADV_DONTNEED):
            log.info("KV cache stays on 4 KiB pages: madvise failed (errno %d)", ctypes.get_errno())
            return moved
        # faulted in now rather than by the first steps (an old kernel without POPULATE_WRITE:
        # by the first steps, still zeros, still huge where the kernel can)
        libc.madvise(start, length, MADV_POPULATE_WRITE)
        moved += length
    return moved
