"""Thinking out of model text (`--reasoning-parser`): `<think>...</think>` -> reasoning_content.

- qwen3: thinking only when the answer opens with `<think>` (Qwen3 can be told not to think).
- deepseek_r1: the chat template opens `<think>` in the prompt, so the answer starts inside the
  thinking; everything before `</think>` is reasoning (an opening tag, if written, is dropped),
  and an answer that never closes it is all reasoning.
- gpt_oss: harmony (server/harmony.py): the `analysis` channel's messages, and calls to built-in
  tools the request did not declare (`to=browser.search`, `to=python`, either channel), are
  reasoning; the `final` and plain `commentary` messages' bodies are content; a message to a
  function or a declared built-in tool stays as written (markup included) for the gpt_oss tool
  parser to read.

Like the tool parsers, `extract(text, final)` keeps back a half-written tag while streaming, so the
reported reasoning and content only grow.
"""

from __future__ import annotations

from jaxserve.server import harmony
from jaxserve.server.tool_parsers import Parsed, held_prefix

START, END = "<think>", "</think>"


class ReasoningParser:
    name = "qwen3"
    starts_inside = False  # True: the prompt opened the thinking block
    skip_special_tokens = True  # False where the markers are special tokens

    def extract(self, text: str, final: bool) -> Parsed:
        head = text.lstrip()
        if not final and len(head) < len(START) and START.startswith(head):
            return Parsed()  # may still open with <think>
        if head.startswith(START):
            body = head[len(START):]
        elif self.starts_inside:
            body = text
        else:
            return Parsed(content=text)
        j = body.find(END)
        if j >= 0:
            return Parsed(reasoning=body[:j], content=body[j + len(END):].lstrip("\n"))
        return Parsed(reasoning=body if final else body[: len(body) - held_prefix(body, END)])


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_inside = True


class GptOssReasoningParser(ReasoningParser):
    name = "gpt_oss"
    skip_special_tokens = False
    declared: frozenset[str] = frozenset()  # the request's function names (tools.plan): built-in tools it declared

    def extract(self, text: str, final: bool) -> Parsed:
        messages = harmony.parse(text, final)
        calls = [m.tool(self.declared) is not None for m in messages]
        thinking = [not call and (m.channel == "analysis" or m.builtin) for m, call in zip(messages, calls)]
        return Parsed(content="".join(m.raw if call else m.body
                                      for m, call, think in zip(messages, calls, thinking) if not think),
                      reasoning="\n".join(m.body for m, think in zip(messages, thinking) if think))


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "gpt_oss": GptOssReasoningParser,
}
