"""Request models of the OpenAI API (plus vLLM's extensions), parsed strictly from JSON.

Types are checked here (a string where a number belongs is a 400 naming the parameter); value
ranges are checked once, by SamplingParams, so the offline API and the server agree.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from jaxserve import limits
from jaxserve.errors import UserError
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.errors import APIError, bad_request, from_user_error, from_validation_error
from jaxserve.server.tools import StructuredFields, ToolFields, ToolMessageFields
from jaxserve.structured import StructuredOutputs


class _Model(BaseModel):
    # Unknown fields are ignored, as OpenAI and vLLM do, so newer clients keep working; the ones
    # that would change the output and are not implemented are refused (UNSUPPORTED).
    # NaN, Infinity and 1e400 literals are refused wherever a number is expected.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# Request fields that would change the output and are not implemented yet: a 400 naming them unless
# the value is one that changes nothing (None, or the listed harmless values). Only undeclared
# (extra) fields are looked at: the structured-output fields (tools.StructuredFields) are served on
# both endpoints, the tool fields (tools.ToolFields) on chat, so the tool entries here refuse them
# on /v1/completions only; chat answers `functions`/`function_call` in tools.plan().
UNSUPPORTED: dict[str, tuple] = {
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "best_of": (1,),
    "use_beam_search": (False,),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "logits_processors": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "prompt_embeds": (),
    "audio": (),
    "modalities": (["text"],),
    "documents": (),
    "mm_processor_kwargs": (),
    "min_characters": (),
}


class SamplingRequest(_Model, StructuredFields):
    """The fields completions and chat share."""

    # Extra fields are kept (not used) so that check() can refuse the unsupported ones.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprob_token_ids: list[int] | None = None  # vLLM's: these ids' logprobs in place of the top-N
    user: str | None = None  # accepted and ignored
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = Field(default=None, min_length=1)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # -1: max_model_len - 1
    truncation_side: Literal["left", "right"] = "left"  # which end truncation cuts
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM: logprobs name tokens "token_id:N"
    prompt_logprobs: int | None = None  # vLLM: top-N logprobs of each prompt token

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if (
            v is None
            or isinstance(v, str)
            or (isinstance(v, list) and all(isinstance(s, str) for s in v))
        ):
            return v
        raise ValueError("must be a string or a list of strings")

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k in v or {}:  # ASCII digits only ('²' passes str.isdigit, not int), and short
            if not (k.isascii() and k.isdigit()) or len(k) > limits.MAX_LOGIT_BIAS_KEY_DIGITS:
                raise ValueError(f"keys must be token ids (got {k[:20]!r})")
        return v

    def check(self) -> None:
        """Checks across fields, and the 400 for fields that are not implemented."""
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "'stream_options' is only allowed when 'stream' is true.", "stream_options"
            )
        for name, harmless in UNSUPPORTED.items():
            v = (self.model_extra or {}).get(name)
            if v is not None and v not in harmless:
                raise bad_request(
                    f"'{name}' is not supported by this server yet: remove it from the request.",
                    name,
                    code="unsupported_parameter",
                )


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        def ids(x) -> bool:
            return isinstance(x, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x
            )

        if v == []:
            raise ValueError("is empty: send at least one token")
        if isinstance(v, str) or ids(v):
            return v
        if (
            isinstance(v, list)
            and v
            and (all(isinstance(p, str) for p in v) or all(ids(p) for p in v))
        ):
            return v
        raise ValueError(
            "must be a string, a list of strings, a list of token ids or a list of token id lists"
        )


class ContentPart(_Model):
    type: str
    text: str | None = None


class ChatMessage(_Model, ToolMessageFields):
    role: str = Field(min_length=1)  # any role the model's chat template accepts (as vLLM)
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template(self, index: int) -> dict[str, Any]:
        """The message as the chat template sees it: text content, tool calls with their
        arguments parsed (templates index them); a 400 for what this server cannot read."""
        msg: dict[str, Any] = {"role": self.role, "content": self._text(index)}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            msg["tool_calls"] = [c.to_template(f"messages[{index}].tool_calls[{j}]")
                                 for j, c in enumerate(self.tool_calls)]
        return msg

    def _text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"Content part type {part.type[:30]!r} is not supported: this model reads "
                    "text only.",
                    f"messages[{index}].content[{j}]",
                    code="unsupported_parameter",
                )
            parts.append(part.text)
        return "".join(parts)

    @property
    def num_chars(self) -> int:
        if isinstance(self.content, list):
            return sum(len(p.text or "") for p in self.content)
        return len(self.content or "")


def _finite(v: Any, where: str) -> None:
    """NaN/Infinity inside a free-form JSON value (pydantic checks only typed numbers)."""
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"holds a non-finite number at {where}")
    if isinstance(v, dict):
        for k, x in v.items():
            _finite(x, f"{where}.{k}")
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _finite(x, f"{where}[{i}]")


class ChatCompletionRequest(SamplingRequest, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # vLLM: the last message's content leads the reply when its role is the reply's
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        _finite(v, "chat_template_kwargs")
        return v


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


def parse(model: type[_Model], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e.errors(include_input=False)) from None


def to_sampling_params(
    req: SamplingRequest,
    *,
    defaults: dict,
    max_tokens: int | None,
    logprobs: int | None,
    vocab_size: int,
    aliases: dict[str, str],
    structured_outputs: StructuredOutputs | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Build SamplingParams: explicit request values, then the model's generation config, then OpenAI's."""
    kw: dict[str, Any] = {"temperature": 1.0, **defaults}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    for name, ids in (("logit_bias", list(bias)), ("stop_token_ids", req.stop_token_ids or []),
                      ("logprob_token_ids", req.logprob_token_ids or [])):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"Token id {bad} in '{name}' is outside the vocabulary (0..{vocab_size - 1}).", name
            )
    try:
        return SamplingParams(
            n=req.n,
            max_tokens=max_tokens,
            stop=[] if req.stop is None else req.stop,
            seed=req.seed,
            logprobs=logprobs,
            logprob_token_ids=req.logprob_token_ids,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logit_bias=bias or None,
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            stop_token_ids=req.stop_token_ids or [],
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            structured_outputs=structured_outputs,
            **kw,
        )
    except UserError as e:
        raise from_user_error(e, aliases) from None


__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "TokenizeRequest",
    "parse",
    "to_sampling_params",
]
