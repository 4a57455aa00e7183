"""Request models of the OpenAI API (plus vLLM's extensions), parsed strictly from JSON.

Types are checked here (a string where a number belongs is a 400 naming the parameter); value
ranges are checked once, by SamplingParams, so the offline API and the server agree.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from jaxserve.sampling_params import SamplingParams
from jaxserve.server.errors import APIError, bad_request, from_validation_error, from_value_error
from jaxserve.server.tools import StructuredFields, ToolFields, ToolMessageFields
from jaxserve.structured import StructuredOutputs


class _Model(BaseModel):
    # Unknown fields are ignored, as OpenAI and vLLM do, so newer clients keep working.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Model):
    include_usage: bool = False


class _SamplingRequest(_Model, StructuredFields):
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
        for k in v or {}:
            if not k.isdigit():
                raise ValueError(f"keys must be token ids (got {k[:20]!r})")
        return v

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "'stream_options' is only allowed when 'stream' is true.", "stream_options"
            )


class CompletionRequest(_SamplingRequest):
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


class ChatMessage(_Model, ToolMessageFields):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"Content part type {str(part.get('type'))[:30]!r} is not supported: this model reads text only.",
                    f"messages[{index}].content[{j}]",
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingRequest, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


def parse(model: type[_Model], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e.errors(include_input=False)) from None


def to_sampling_params(
    req: _SamplingRequest,
    *,
    defaults: dict,
    max_tokens: int | None,
    logprobs: int | None,
    vocab_size: int,
    aliases: dict[str, str],
    structured_outputs: StructuredOutputs | None = None,
) -> SamplingParams:
    """Build SamplingParams: explicit request values, then the model's generation config, then OpenAI's."""
    kw: dict[str, Any] = {"temperature": 1.0, **defaults}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    for name, ids in (("logit_bias", list(bias)), ("stop_token_ids", req.stop_token_ids or [])):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"Token id {bad} in '{name}' is outside the vocabulary (0..{vocab_size - 1}).", name
            )
    try:
        return SamplingParams(
            n=req.n,
            max_tokens=max_tokens,
            stop=req.stop or [],
            seed=req.seed,
            logprobs=logprobs,
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
    except ValueError as e:
        raise from_value_error(e, aliases) from None


__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "TokenizeRequest",
    "parse",
    "to_sampling_params",
]
