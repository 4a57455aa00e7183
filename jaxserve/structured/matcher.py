"""One sequence's position in its grammar: the engine fills its bitmask row before each step and
feeds it each sampled token after.

The mask is packed: bit j of word i allows token 32*i + j, in an int32 row of ceil(V/32) words
(V = the model's vocabulary, which may exceed the tokenizer's; ids past the tokenizer are never
allowed). EOS is allowed exactly where the grammar accepts, so the mask alone decides when a
constrained sequence may stop.
"""

from __future__ import annotations

import numpy as np


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class Matcher:
    def __init__(self, ll, vocab_size: int):
        self._ll = ll  # an llguidance.LLMatcher owned by this sequence
        self.width = bitmask_width(vocab_size)

    def accept(self, token: int) -> bool:
        """Advance over a sampled token; False if the grammar does not allow it (the matcher
        then stays in an error state)."""
        return self._ll.consume_token(int(token))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of tokens, in order, the grammar accepts from here (nothing is consumed)."""
        return self._ll.validate_tokens(tokens) if tokens else 0

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` (i32[ceil(V/32)], C-contiguous)."""
        if row.dtype != np.int32 or row.shape != (self.width,) or not row.flags.c_contiguous:
            raise ValueError(f"bitmask row must be a contiguous int32[{self.width}], "
                             f"got {row.dtype}{list(row.shape)}")
        self._ll.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def is_terminated(self) -> bool:
        """Nothing but EOS can follow (or EOS was taken): finish the sequence now."""
        return self._ll.is_stopped()

    def is_accepting(self) -> bool:
        return self._ll.is_accepting()

    def rollback(self, num_tokens: int) -> None:
        if not self._ll.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens")

    @property
    def error(self) -> str | None:
        return self._ll.get_error() if self._ll.is_error() else None


class BitmaskFiller:
    """Fills one step's i32[S, W] mask: all ones for unconstrained rows, each matcher's row
    otherwise, the constrained rows in parallel (llguidance's Rust threads, no GIL)."""

    def __init__(self, num_threads: int | None = None):
        self._num_threads = num_threads
        self._executor = None  # llguidance's, made with the first constrained row


    def fill(self, matchers: list[Matcher | None], bitmask: np.ndarray) -> bool:
        """Row i from matchers[i] (None: unconstrained). Returns whether any row is constrained,
        so a batch without grammars can skip the mask."""
        if bitmask.dtype != np.int32 or not bitmask.flags.c_contiguous or bitmask.ndim != 2:
            raise ValueError("bitmask must be a contiguous int32[S, W]")
        bitmask.fill(-1)
        rows = [(m._ll, i) for i, m in enumerate(matchers) if m is not None]
        if rows:
            s, w = bitmask.shape
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor(self._num_threads)
            self._executor.unsafe_compute_mask_ptr(rows, bitmask.ctypes.data, w * 4, s)
        return bool(rows)
