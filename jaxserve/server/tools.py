"""The agent side of a request: structured-output fields, tools and tool_choice, tool messages.

Request fields (mixed into protocol.py's models):
- `response_format` (OpenAI: text, json_object, json_schema), vLLM's `structured_outputs` and the
  older `guided_json/regex/choice/grammar`: at most one source, turned into one StructuredOutputs.
- `tools`, `tool_choice` (none, auto, required, a named function), `parallel_tool_calls`:
  "auto" parses calls out of free text with the server's `--tool-call-parser`; "required" and a
  named function decode under a grammar (a JSON array of calls whose arguments match each
  function's schema, structured.spec.ToolCallSpec), so the output always parses.
- assistant `tool_calls` and `tool` messages (protocol.ChatMessage.to_template), handed to the
  chat template with `tools=` (chat_template.ChatTemplate.render).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve import limits
from jaxserve.errors import UserError
from jaxserve.server.errors import bad_request
from jaxserve.server.output_parser import OutputParser
from jaxserve.server.reasoning import REASONING_PARSERS
from jaxserve.server.tool_parsers import TOOL_PARSERS, JsonArrayToolParser
from jaxserve.structured import StructuredOutputs, ToolCallSpec


class _Strict(BaseModel):
    # Fields that change the output: an unknown one is a 400, never silently dropped.
    model_config = ConfigDict(strict=True, extra="forbid")


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """Mixed into _SamplingRequest (completions and chat)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ToolFields(BaseModel):
    """Mixed into ChatCompletionRequest."""

    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None  # checked in plan(): one clear message
    parallel_tool_calls: bool = True
    functions: Any = None  # OpenAI's deprecated form: a 400 pointing to `tools`
    function_call: Any = None


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str


class AssistantToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def to_template(self, param: str) -> dict[str, Any]:
        """The call as chat templates read it: arguments parsed (they index or iterate them)."""
        text = self.function.arguments
        if not text.strip():  # vLLM accepts an empty string: a call without arguments
            text = "{}"
        try:
            args = limits.loads_bounded(text, f"{param}.function.arguments", "The tool call arguments")
        except UserError as e:
            raise bad_request(e.message, e.param) from None
        except ValueError:
            raise bad_request("Tool call arguments must be a JSON object (as text).",
                              f"{param}.function.arguments") from None
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": args}}


class ToolMessageFields(BaseModel):
    """Mixed into ChatMessage."""

    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None


def structured_spec(req, tool_call: ToolCallSpec | None = None
                    ) -> tuple[StructuredOutputs | None, str | None]:
    """The request's one output constraint and the field it came from (None, None without one);
    a 400 naming the field when it is bad."""
    sources = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            sources.append(("response_format", {"json_object": True}))
        elif rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format of type 'json_schema' needs "
                              "'json_schema.schema'.", "response_format.json_schema")
        else:
            sources.append(("response_format.json_schema.schema",
                            {"json": rf.json_schema.schema_}))
    so = req.structured_outputs
    if so is not None:
        fields = {k.rstrip("_"): v for k, v in so.model_dump(exclude_none=True).items()}
        fields = {k: v for k, v in fields.items() if v is not False}
        sources.append(("structured_outputs", fields))
    for name in ("json", "regex", "choice", "grammar"):
        v = getattr(req, f"guided_{name}")
        if v is not None:
            sources.append((f"guided_{name}", {name: v}))
    if tool_call is not None:
        sources.append(("tool_choice", {"tool_call": tool_call}))
    if not sources:
        return None, None
    if len(sources) > 1:
        names = ", ".join(s for s, _ in sources)
        raise bad_request(f"Give one output constraint, not several ({names}).", sources[1][0])
    param, fields = sources[0]
    try:
        spec = StructuredOutputs(**fields)
    except UserError as e:
        raise bad_request(e.message, e.param if param == "structured_outputs" else param) from None
    return spec, spec.param if param == "structured_outputs" else param


async def check_grammar(compiler, spec: StructuredOutputs | None, param: str | None) -> None:
    """Wait (off the engine thread) for the spec's grammar, so a bad schema, regex or grammar is
    a 400 naming the field before the request is admitted; the engine then finds it cached."""
    if spec is None:
        return
    if compiler is None:
        raise bad_request("This server's engine does not support structured outputs.", param)
    try:
        await asyncio.wrap_future(compiler.submit(spec))
    except UserError as e:
        msg = e.message.replace(f"Invalid {e.param}:", f"Invalid {param}:", 1)
        raise bad_request(msg, param) from None


@dataclass
class ToolPlan:
    template_tools: list[dict] | None  # passed to the chat template
    tool_call: ToolCallSpec | None  # a grammar for required / named
    output: OutputParser | None  # how to read the answer (None: plain content)
    skip_special_tokens: bool | None = None  # False where the parser needs special tokens

    def output_for(self, spec: StructuredOutputs | None) -> OutputParser | None:
        """A JSON grammar decodes the answer from its first token: it is all content, never a
        thinking block (a regex or grammar may write one, and is still split)."""
        out = self.output
        if out is not None and spec is not None and spec.kind in ("json", "json_object"):
            out = OutputParser(None, out.tools, out.max_calls) if out.tools else None
        return out


def plan(req, tool_parser: str | None, reasoning_parser: str | None) -> ToolPlan:
    """Resolve tools + tool_choice against the server's parsers; 400s name the field."""
    for old, new in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(req, old) is not None:
            raise bad_request(f"'{old}' is deprecated and not supported: use '{new}'.", old)
    tools = req.tools or []
    choice = req.tool_choice
    reasoning = REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None
    # a parser whose markers are special tokens needs them in the text (gpt_oss: harmony)
    keep = False if reasoning and not reasoning.skip_special_tokens else None
    if not tools:
        if choice not in (None, "none"):  # vLLM's rule and wording
            raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return ToolPlan(None, None, OutputParser(reasoning) if reasoning else None, keep)
    if len(tools) > limits.MAX_TOOLS:
        raise bad_request(f"'tools' has {len(tools)} entries, more than the limit of {limits.MAX_TOOLS}.",
                          "tools")
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    functions = {t.function.name: (t.function.parameters, t.function.strict) for t in tools}
    if len(functions) != len(tools):
        raise bad_request("Each tool needs a distinct function name.", "tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        try:
            choice = NamedToolChoice.model_validate(choice)
        except ValueError:
            choice = None
    if not isinstance(choice, NamedToolChoice) and choice not in ("none", "auto", "required"):
        raise bad_request("Invalid 'tool_choice': give 'none', 'auto', 'required' or "
                          '{"type": "function", "function": {"name": ...}}.', "tool_choice")
    if choice == "none":
        return ToolPlan(template_tools, None, OutputParser(reasoning) if reasoning else None, keep)
    if choice == "auto":
        if tool_parser is None:
            raise bad_request(
                "tool_choice 'auto' needs the server started with --tool-call-parser "
                "(this model's chat template does not show one tool-call format) "
                f"({', '.join(sorted(TOOL_PARSERS))}); or use 'required' or a named function.",
                "tool_choice")
        parser = TOOL_PARSERS[tool_parser]()
        for p in (reasoning, parser):  # gpt_oss: built-in tools (browser.search, python) declared by name
            if hasattr(p, "declared"):
                p.declared = frozenset(functions)
        # parallel_tool_calls false: a model that writes several calls gets its first one (vLLM)
        one = None if req.parallel_tool_calls else 1
        return ToolPlan(template_tools, None, OutputParser(reasoning, parser, one),
                        keep if parser.skip_special_tokens else False)
    name = None if choice == "required" else choice.function.name
    try:
        spec = ToolCallSpec.build(functions, name, req.parallel_tool_calls)
    except UserError as e:
        raise bad_request(e.message, e.param) from None
    # forced calls are decoded from the first token: no thinking block to split off
    return ToolPlan(template_tools, spec, OutputParser(None, JsonArrayToolParser()))
