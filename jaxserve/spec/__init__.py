"""Speculative decoding: proposers draft tokens on the host (n-gram lookup) or with a small model
of the same tokenizer; the target verifies every draft in one step (`RowSpec.extra` logits rows,
rejection sampling in runtime/sampler.py) and keeps the accepted prefix plus one token of its own.
"""

from jaxserve.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
