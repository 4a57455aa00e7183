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

from jaxserve import limits
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
    def build(cls, functions: dict[str, tuple[dict | None, bool | None]], name: str | None = None,
              parallel: bool = True) -> ToolCallSpec:
        """functions: name -> (parameters schema, the function's `strict`). Objects of a schema
        are closed to their declared properties unless strict is False (OpenAI's strict calls):
        a model then cannot ramble on in an undeclared property until max_tokens."""
        if not functions:
            raise UserError("tool_choice needs at least one tool in 'tools'.", param="tools")
        if name is not None and name not in functions:
            raise UserError(
                f"tool_choice names the function {name[:60]!r}, which is not in 'tools' "
                f"({', '.join(map(repr, functions))}).", param="tool_choice")
        limits.check_schema_floor([fn[0] if isinstance(fn, tuple) else fn for fn in functions.values()],
                                  "tools")
        out = []
        for n, fn in functions.items():
            schema, strict = fn if isinstance(fn, tuple) else (fn, None)
            schema = schema or {"type": "object"}
            limits.check_json_value(schema, "tools", "A tool's parameters schema")
            if strict is not False:
                schema = closed_objects(schema)
            out.append((n, _canonical(schema)))
        limits.check_schema_size("".join(s for _, s in out), "tools")
        return cls(tuple(out), name, parallel)

    def schema(self) -> dict:
        """One schema for the calls. Each function's `$defs`/`definitions` move to the root
        (renamed per function) and its local `$ref`s follow them, so refs still resolve once the
        parameters sit under `arguments`."""
        defs: dict = {}
        one = []
        for i, (n, s) in enumerate(self.functions):
            if self.name not in (None, n):
                continue
            args = _hoist_defs(json.loads(s), f"f{i}_", defs)
            one.append({"type": "object", "properties": {"name": {"const": n}, "arguments": args},
                        "required": ["name", "arguments"], "additionalProperties": False})
        item = one[0] if len(one) == 1 else {"anyOf": one}
        out = {"type": "array", "items": item, "minItems": 1,
               **({} if self.parallel and self.name is None else {"maxItems": 1})}
        if defs:
            out["$defs"] = defs
        return out


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
                limits.check_schema_size(self.json, "structured_outputs.json")
                try:
                    self.json = limits.loads_bounded(self.json, "structured_outputs.json", "The JSON schema")
                except UserError:
                    raise
                except ValueError as e:
                    raise UserError(f"The JSON schema is not valid JSON: {e}.",
                                    param="structured_outputs.json") from None
            if not isinstance(self.json, (dict, bool)):
                raise UserError("The JSON schema must be a JSON object.",
                                param="structured_outputs.json")
            limits.check_schema_floor(self.json, "structured_outputs.json")
            limits.check_json_value(self.json, "structured_outputs.json")
            value: Any = _canonical(self.json)
            limits.check_schema_size(value, "structured_outputs.json")
        elif kind == "choice":
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise UserError("choice must be a non-empty list of non-empty strings.",
                                param="structured_outputs.choice")
            if len(self.choice) > limits.MAX_CHOICES or sum(map(len, self.choice)) > limits.MAX_GRAMMAR_BYTES:
                raise UserError(f"choice has more than {limits.MAX_CHOICES} entries or "
                                f"{limits.MAX_GRAMMAR_BYTES} characters: shorten it.",
                                param="structured_outputs.choice")
            self.choice = list(self.choice)
            value = tuple(self.choice)
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise UserError(f"{kind} must be a non-empty string.",
                                param=f"structured_outputs.{kind}")
            limits.check_grammar_text(value, f"structured_outputs.{kind}", kind)
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


_LITERAL_KEYS = ("const", "enum", "default", "examples")  # values, not schemas
_NAME_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")  # name -> schema


def _schema_nodes(value: Any):
    """Every object schema inside a JSON-schema value, walked iteratively (depth is bounded
    earlier); literal values are not entered, maps of names give their values. A caller may edit a
    node before the walk enters its children."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, dict):
            yield v
            for k, x in v.items():
                if k in _NAME_MAPS and isinstance(x, dict):
                    todo.extend(x.values())
                elif k not in _LITERAL_KEYS:
                    todo.append(x)


def closed_objects(schema: Any) -> Any:
    """A copy where every object schema with `properties` and no `additionalProperties` (nor
    patternProperties) gets `additionalProperties: false`."""
    root = json.loads(json.dumps(schema))
    for v in _schema_nodes(root):
        if ("properties" in v and isinstance(v["properties"], dict)
                and "additionalProperties" not in v and "patternProperties" not in v
                and "unevaluatedProperties" not in v):
            v["additionalProperties"] = False
    return root


def _hoist_defs(schema: Any, prefix: str, defs: dict) -> Any:
    """Move a schema's `$defs`/`definitions` into `defs` (names prefixed) and rewrite its local
    refs (`#/$defs/X`, `#/definitions/X`, `#`) to match."""
    if not isinstance(schema, dict):
        return schema
    schema = dict(schema)
    local = {}
    for key in ("$defs", "definitions"):
        for name, sub in (schema.pop(key, None) or {}).items():
            local[f"#/{key}/{name}"] = f"#/$defs/{prefix}{name}"
            defs[f"{prefix}{name}"] = sub
    root_name = f"{prefix}root"
    uses_root = False

    def fix(v):
        nonlocal uses_root
        for x in _schema_nodes(v):
            ref = x.get("$ref")
            if not isinstance(ref, str):
                continue
            if ref == "#":
                x["$ref"], uses_root = f"#/$defs/{root_name}", True
                continue
            for old, new in local.items():
                if ref == old or ref.startswith(old + "/"):
                    x["$ref"] = new + ref[len(old):]
                    break

    fix(schema)
    for name in [n for n in defs if n.startswith(prefix)]:
        fix(defs[name])
    if uses_root:
        defs[root_name] = schema
        return {"$ref": f"#/$defs/{root_name}"}
    return schema


def _canonical(schema: Any) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))
