"""VMEM and SMEM budgets of the TPU kernels, per chip.

Mosaic rejects a kernel whose scratch and pipelined blocks exceed its scoped VMEM limit (16 MiB on
v5e by default, 32 MiB on v6e), and SMEM (1 MiB per core) holds every scalar-prefetched array
whole. The kernels therefore size themselves from these estimates, with no device query at trace
time: ``vmem_limit`` is what each ``pallas_call`` asks for (estimate plus headroom for Mosaic's own
temporaries), checked against ``MIN_VMEM_BYTES``, the smallest physical VMEM of the chips served,
so one compiled shape fits all of them; block tables are prefetched into SMEM only up to
``TABLE_SMEM_BYTES`` per call, and longer ones split the sequences over several calls
(``tpu.ragged_paged_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class Chip:
    """Per TensorCore: the scoped VMEM limit Mosaic applies without ``vmem_limit_bytes``, the
    physical VMEM and SMEM (libtpu's ``pltpu.get_tpu_info_for_chip``)."""

    vmem_scoped: int
    vmem: int
    smem: int


CHIPS = {
    "v5e": Chip(16 * MiB, 128 * MiB, 1 * MiB),
    "v6e": Chip(32 * MiB, 128 * MiB, 1 * MiB),
    "v5p": Chip(16 * MiB, 64 * MiB, 1 * MiB),
    "v7x": Chip(32 * MiB, 64 * MiB, 1 * MiB),
}
MIN_VMEM_BYTES = min(c.vmem for c in CHIPS.values())
SMEM_BYTES = min(c.smem for c in CHIPS.values())
# Block tables per call; the rest of SMEM is the other scalars and Mosaic's own.
TABLE_SMEM_BYTES = 512 * 1024
LANES = 128


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def smem_array_bytes(num_words: int) -> int:
    """One i32 array in SMEM, padded to 128 words as Mosaic allocates it."""
    return round_up(max(num_words, 1), LANES) * 4


def vmem_tile_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of an array in VMEM: the minor two dims padded to (sublane packing, 128) tiles."""
    *major, rows, lanes = (1,) * max(0, 2 - len(shape)) + tuple(shape)
    packing = 8 * 4 // itemsize
    n = round_up(rows, packing) * round_up(lanes, LANES) * itemsize
    for d in major:
        n *= d
    return n


def vmem_limit(estimate: int) -> int:
    """``vmem_limit_bytes`` for a kernel whose buffers take ``estimate`` bytes: a quarter more
    plus 4 MiB for Mosaic's internal scratch (spilled vregs, matmul staging), in whole MiB; an
    estimate past the smallest chip's VMEM is an error (the block sizes must shrink)."""
    if estimate > MIN_VMEM_BYTES:
        raise ValueError(f"the kernel's VMEM estimate {estimate / MiB:.1f} MiB exceeds the "
                         f"{MIN_VMEM_BYTES // MiB} MiB of VMEM of the smallest supported TPU")
    return min(round_up(estimate + estimate // 4 + 4 * MiB, MiB), MIN_VMEM_BYTES)


def check(estimate: int, chip: str) -> str | None:
    """None when ``estimate`` fits ``chip``'s physical VMEM, else why not."""
    c = CHIPS[chip]
    if estimate > c.vmem:
        return f"VMEM estimate {estimate / MiB:.1f} MiB > {chip}'s {c.vmem // MiB} MiB"
    return None
