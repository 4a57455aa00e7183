"""`--speculative-config` (vLLM's shape): {"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_min": a, "prompt_lookup_max": b} or {"method": "draft", "model": PATH, ...}."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from jaxserve.core.errors import UserError

METHODS = ("ngram", "draft")
# Above this many running sequences a step verifies no drafts (vLLM: disable_by_batch_size). On a
# CPU each draft row costs about as much compute as a sequence's decode row, so speculation pays
# only while the step is bound by reading the weights: measured on the default model (2 cores,
# bench/spec_decode.py --sweep; bench/RESULTS.md), forced on at 8 running it gave +53% on
# repetitive and -3% on fresh prompts, at 16 +7% and -9%.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2  # ngram: shortest suffix to look up
    prompt_lookup_max: int = 4  # ngram: longest suffix to look up (tried first)
    model: str | None = None  # draft: the draft model (same tokenizer as the target)
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """From a dict, a JSON/YAML string (the CLI flag), or a SpeculativeConfig."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import yaml

            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                value = None
        if not isinstance(value, dict):
            raise UserError('--speculative-config must be a JSON object, e.g. '
                            '\'{"method": "ngram", "num_speculative_tokens": 4}\'.', param="speculative_config")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise UserError(f"Unknown speculative_config key {unknown[0]!r}: use {', '.join(sorted(names))}.",
                            param="speculative_config")
        cfg = cls(**value)
        cfg.check()
        return cfg

    def check(self) -> None:
        def bad(name: str, rule: str) -> UserError:
            return UserError(f"Invalid speculative_config {name}={getattr(self, name)!r}: {rule}.",
                             param="speculative_config")

        if self.method not in METHODS:
            raise bad("method", f"choose one of {', '.join(METHODS)}")
        for name, lo in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1), ("prompt_lookup_max", 1),
                         ("disable_by_batch_size", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise bad(name, f"must be an integer >= {lo}")
        if self.num_speculative_tokens > 16:
            raise bad("num_speculative_tokens", "must be at most 16")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise bad("prompt_lookup_min", f"must not exceed prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "draft" and not self.model:
            raise bad("model", 'the draft method needs "model": a directory or .gguf of a smaller model '
                      "with the target's tokenizer")
