"""SamplingParams: how to pick tokens and when to stop, validated when built (as in vLLM)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from jaxserve import limits
from jaxserve.errors import UserError
from jaxserve.structured.spec import StructuredOutputs

MAX_LOGPROBS = 20
MAX_N = 16
MAX_TEMPERATURE = 2.0  # OpenAI's and vLLM's upper bound
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # vLLM's range (a torch.long)


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token (0: only the sampled one)
    # vLLM's: the logprobs of these token ids in place of the top-N (logprobs = their count)
    logprob_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None  # the same for each prompt token (the first has none)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # constrain the output to a JSON schema / regex / choice / grammar (a StructuredOutputs, or
    # a dict of its fields, e.g. {"json": schema})
    structured_outputs: StructuredOutputs | dict[str, Any] | None = None
    # a pooling request (jaxserve.pooling.PoolingParams; build it with pooling.pooling_request):
    # its prompt's hidden states pooled into RequestOutput.pooled; it samples one greedy token
    pooling: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1 and not isinstance(self.seed, bool):  # vLLM: -1 means no seed
            self.seed = None
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputs(**self.structured_outputs)
            except TypeError as e:
                raise UserError(f"Invalid structured_outputs: {e}.",
                                param="structured_outputs") from None
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputs):
            raise UserError(
                f"Invalid structured_outputs={type(self.structured_outputs).__name__}: give a "
                "StructuredOutputs or a dict such as {'json': schema}.", param="structured_outputs")
        self._validate()

    def _validate(self) -> None:
        def bad(field_name: str, value, rule: str) -> UserError:
            return UserError(f"Invalid {field_name}={value!r}: {rule}.", param=field_name)

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", self.n, f"must be an integer between 1 and {MAX_N}")
        if not _is_num(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", self.temperature,
                      f"must be in [0, {MAX_TEMPERATURE}] (0 means greedy)")
        if self.n > 1 and self.temperature == 0:  # vLLM: n copies of one greedy answer are a mistake
            raise bad("n", self.n, "must be 1 when using greedy sampling (temperature=0); "
                      "raise temperature for different answers")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be -1 or 0 (disabled) or a positive integer")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", self.seed, f"must be an integer in [{SEED_MIN}, {SEED_MAX}] (64 bits)")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"must not exceed max_tokens={self.max_tokens}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", self.stop, "must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > limits.MAX_STOP_STRINGS or any(len(s) > limits.MAX_STOP_CHARS for s in self.stop):
            raise UserError(f"Invalid stop: at most {limits.MAX_STOP_STRINGS} strings of at most "
                            f"{limits.MAX_STOP_CHARS} characters each.", param="stop")
        if len(self.stop_token_ids) > limits.MAX_STOP_TOKEN_IDS:
            raise UserError(f"Invalid stop_token_ids: at most {limits.MAX_STOP_TOKEN_IDS} ids.",
                            param="stop_token_ids")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "must be a list of token ids >= 0")
        if self.pooling is not None and (self.n != 1 or self.max_tokens != 1 or self.prompt_logprobs is not None
                                         or self.structured_outputs is not None):
            raise UserError("A pooling request has n=1, max_tokens=1 and no prompt_logprobs or structured "
                            "outputs: build it with jaxserve.pooling.pooling_request.", param="pooling")
        if self.logprob_token_ids is not None:
            self._check_logprob_token_ids()
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", self.logprobs, f"must be an integer between 0 and {MAX_LOGPROBS}")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise bad("prompt_logprobs", self.prompt_logprobs, f"must be an integer between 0 and {MAX_LOGPROBS}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2 <= v <= 2:
                raise bad(name, v, "must be in [-2, 2]")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "must be > 0 (1 disables it)")
        if self.logit_bias:
            for k, v in self.logit_bias.items():
                if not _is_int(k) or k < 0:
                    raise bad("logit_bias", k, "keys must be token ids >= 0")
                if not _is_num(v) or not -100 <= v <= 100:
                    raise bad("logit_bias", v, "values must be in [-100, 100]")

    def _check_logprob_token_ids(self) -> None:
        ids = self.logprob_token_ids
        if not isinstance(ids, (list, tuple)) or not 1 <= len(ids) <= MAX_LOGPROBS:
            raise UserError(f"Invalid logprob_token_ids: must be a list of 1 to {MAX_LOGPROBS} token ids.",
                            param="logprob_token_ids")
        if not all(_is_int(t) and t >= 0 for t in ids):
            raise UserError("Invalid logprob_token_ids: must be a list of token ids >= 0.", param="logprob_token_ids")
        if self.logprobs is not None and self.logprobs != len(ids):
            raise UserError(f"Invalid logprobs: {self.logprobs} with {len(ids)} logprob_token_ids; the "
                            "logprobs listed are those ids', so leave it out or set it to their count.",
                            param="logprobs")
        self.logprob_token_ids = list(ids)
        self.logprobs = len(ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def uses_truncation(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


def _is_num(v) -> bool:
    """A finite real number (not a bool, NaN or infinity)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
