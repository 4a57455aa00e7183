"""What a request constrains its output to: one of a JSON schema, any JSON object, a regex, a
choice of strings, a grammar, or a tool call. Pure Python (no grammar library), so SamplingParams
and the server can build and validate it; the compiler turns it into a grammar.

`key` is the cache key of the compiled grammar: two requests with the same schema (key order
ignored) share one compilation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from jaxserve.errors import UserError

KINDS = ("json", "regex", "choice", "grammar", "json_object", "tool_call")


@dataclass(frozen=True, slots=True)
class ToolCallSpec:
    """Calls to the request's tools: `name` forces one function (tool_choice named), else any
    (tool_choice "required"). Decoded as a JSON array of {"name", "arguments"} objects whose
    arguments match the function's parameter schema; one call unless `parallel`.
    """

    functions: tuple[tuple[str, str], ...]  # (name, canonical JSON of its parameters schema)
    name: str | None = None
    parallel: bool = True

    @classmethod
    def build(cls, functions: dict[str, dict], name: str | None = None,
              parallel: bool = True) -> ToolCallSpec:
        if not functions:
            raise UserError("tool_choice needs at least one tool in 'tools'.", param="tools")
        if name is not None and name not in functions:
            raise UserError(
                f"tool_choice names the function {name[:60]!r}, which is not in 'tools' "
                f"({', '.join(map(repr, functions))}).", param="tool_choice")
        return cls(tuple((n, _canonical(s or {"type": "object"})) for n, s in functions.items()),
                   name, parallel)

    def schema(self) -> dict:
        fns = [(n, json.loads(s)) for n, s in self.functions if self.name in (None, n)]
        one = [{"type": "object", "properties": {"name": {"const": n}, "arguments": s},
                "required": ["name", "arguments"], "additionalProperties": False}
               for n, s in fns]
        item = one[0] if len(one) == 1 else {"anyOf": one}
        return {"type": "array", "items": item, "minItems": 1,
                **({} if self.parallel and self.name is None else {"maxItems": 1})}


@dataclass(slots=True)
class StructuredOutputs:
    """Exactly one of the fields is set (vLLM's `structured_outputs` names)."""

    json: dict | str | None = None  # a JSON schema (dict or JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF/EBNF (`::=` rules)
    json_object: bool = False  # any JSON object
    tool_call: ToolCallSpec | None = None
    _key: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise UserError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object (got {', '.join(set_) or 'none'}).", param="structured_outputs")
        kind = set_[0]
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except ValueError as e:
                    raise UserError(f"The JSON schema is not valid JSON: {e}.",
                                    param="structured_outputs.json") from None
            if not isinstance(self.json, (dict, bool)):
                raise UserError("The JSON schema must be a JSON object.",
                                param="structured_outputs.json")
            value: Any = _canonical(self.json)
        elif kind == "choice":
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise UserError("choice must be a non-empty list of non-empty strings.",
                                param="structured_outputs.choice")
            self.choice = list(self.choice)
            value = tuple(self.choice)
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise UserError(f"{kind} must be a non-empty string.",
                                param=f"structured_outputs.{kind}")
        elif kind == "json_object":
            if self.json_object is not True:
                raise UserError("json_object must be true.", param="structured_outputs")
            value = True
        else:
            if not isinstance(self.tool_call, ToolCallSpec):
                raise UserError("tool_call must be a ToolCallSpec.", param="tool_choice")
            value = self.tool_call
        self._key = (kind, value)

    @property
    def kind(self) -> str:
        return self._key[0]

    @property
    def key(self) -> tuple:
        return self._key

    @property
    def param(self) -> str:
        """The request field an error in this spec names."""
        return "tool_choice" if self.kind == "tool_call" else f"structured_outputs.{self.kind}"


def _canonical(schema: Any) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))
