"""The CPU KV cache moved onto 2 MiB pages (runtime/huge_pages.py): its contents stay zeros, steps
still write and read it, and the kernel was asked for huge pages on exactly its aligned inside."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime import huge_pages
from jaxserve.runtime.huge_pages import HUGE, aligned_inside


def test_aligned_inside():
    assert aligned_inside(HUGE, 3 * HUGE) == (HUGE, 3 * HUGE)
    assert aligned_inside(HUGE + 1, 3 * HUGE) == (2 * HUGE, 2 * HUGE)
    assert aligned_inside(HUGE - 4096, HUGE + 8192) == (HUGE, HUGE)
    assert aligned_inside(4096, HUGE) == (HUGE, 0)  # no whole 2 MiB page inside


def test_shapes_only_are_left_alone():
    """An abstract runner's cache (`jaxserve lower`) is shapes, not buffers."""
    assert huge_pages.back_zeroed_with_huge_pages([jax.ShapeDtypeStruct((HUGE,), jnp.float32)]) == 0


def _vm_flags(addr: int) -> list[str]:
    """VmFlags of the mapping holding addr (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(huge_pages.thp_mode() not in ("always", "madvise"), reason="no transparent huge pages")
def test_zeroed_arrays_move_and_keep_their_contents():
    arrays = [jax.jit(lambda: jnp.zeros((5 * HUGE // 4,), jnp.float32))() for _ in range(2)]
    expected = sum(aligned_inside(a.unsafe_buffer_pointer(), a.nbytes)[1] for a in arrays)
    assert expected >= 2 * 3 * HUGE
    assert huge_pages.back_zeroed_with_huge_pages(arrays) == expected
    for a in arrays:
        start, _ = aligned_inside(a.unsafe_buffer_pointer(), a.nbytes)
        assert "hg" in _vm_flags(start)  # MADV_HUGEPAGE took
        assert not np.asarray(a).any()  # DONTNEED gave back zeros
    # an in-place update (donated, as the steps' KV) still lands in the same memory
    write = jax.jit(lambda x: x.at[HUGE // 4 + 7].set(3.0), donate_argnums=0)
    ptr = arrays[0].unsafe_buffer_pointer()
    out = write(arrays[0])
    assert out.unsafe_buffer_pointer() == ptr
    host = np.asarray(out)
    assert host[HUGE // 4 + 7] == 3.0 and np.count_nonzero(host) == 1


@pytest.mark.skipif(huge_pages.thp_mode() not in ("always", "madvise"), reason="no transparent huge pages")
def test_engine_kv_cache_on_huge_pages(tiny_model, tiny_llm):
    """A CPU engine whose KV arrays span 2 MiB pages gets them advised, and generates as an engine
    whose small arrays (none whole 2 MiB) stay on 4 KiB pages."""
    from jaxserve import LLM, SamplingParams
    from tests.conftest import ENGINE_KW

    llm = LLM(tiny_model("llama"), **{**ENGINE_KW, "num_blocks": 4096})  # 8 MiB a K or V array
    layers = llm.engine.runner.kv.layers
    for a in jax.tree.leaves(layers):
        start, length = aligned_inside(a.unsafe_buffer_pointer(), a.nbytes)
        assert length >= 3 * HUGE and "hg" in _vm_flags(start)
    prompts = [[5, 9, 17, 33, 60, 2, 8] * k for k in (1, 3, 9)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
