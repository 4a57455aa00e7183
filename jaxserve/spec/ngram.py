"""Prompt-lookup drafting (model-free): find the latest earlier occurrence of the sequence's last
n tokens (n from prompt_lookup_max down to prompt_lookup_min) and propose the k tokens that
followed it. Agent and coding traffic repeats its prompt (edits, quotes, reformatting), which
this drafts for free."""

from __future__ import annotations

import numpy as np


def propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k drafted tokens after `tokens` (i32[L]), or [] when no suffix recurs."""
    length = tokens.size
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n:]
        # windows starting at 0 .. length-n-1 (not the suffix itself)
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest match: the nearest context
            return tokens[start:start + k].tolist()
    return []
