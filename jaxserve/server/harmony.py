"""OpenAI's harmony format (gpt-oss), read out of a model's answer: the messages it wrote.

The prompt ends with `<|start|>assistant`; the model then writes one or more messages
  <|channel|>analysis<|message|>thinking...<|end|>
  <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>
  <|start|>assistant<|channel|>final<|message|>the answer<|return|>
each a header (channel, optional recipient `to=...`, which may also sit right after the role,
optional content type) up to `<|message|>`, then a body up to `<|end|>`, `<|call|>`, `<|return|>`
(or the next `<|start|>`; the stop tokens `<|return|>` / `<|call|>` are usually cut from the text).
The markers are special tokens: the parsers need them in the text (skip_special_tokens false).

`parse(text, final)` streams: while `final` is false a message counts from its complete header, its
body holds back a half-written marker at the end, and text before a header that is not complete
is held back, so what it returns only grows as text is added. Text outside any message (a model
answering without the format) is a message of channel None.

Built-in tools (gpt-oss's `browser.search` / `browser.open` / `browser.find` and `python`, usually
addressed from the analysis channel): a call to one the request declared as a function of that
name is a tool call like a function's (`Message.tool`); an undeclared one is the model's own work,
not its answer: reasoning (server/reasoning.py), never content. vLLM's chat completions put
analysis-channel messages in reasoning and drop commentary-channel ones with a recipient from the
content; here both channels' undeclared built-in calls go to reasoning, so nothing is lost.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE) + ENDS
_HEADER = re.compile(re.escape(START) + "|" + re.escape(CHANNEL))
_BODY_END = re.compile("|".join(re.escape(m) for m in ENDS + (START,)))
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


@dataclass(frozen=True, slots=True)
class Message:
    channel: str | None  # analysis | commentary | final | None (text outside the format)
    recipient: str | None  # e.g. "functions.get_weather"
    body: str  # as far as written
    raw: str  # the message's own text, header included, as far as written
    done: bool  # its end marker is written (or the text is final)

    @property
    def function(self) -> str | None:
        """The function a `to=functions.NAME` message calls."""
        if self.recipient and self.recipient.startswith("functions."):
            return self.recipient[len("functions."):]
        return None

    def tool(self, declared: frozenset[str] = frozenset()) -> str | None:
        """The tool this message calls, as a tool call names it: a function's NAME, or a built-in
        tool's recipient (`browser.search`, `browser.open`, `python`, ...) when the request declared
        a function of exactly that name; None for any other message (an undeclared built-in
        tool's call included: `builtin`)."""
        return self.function or (self.recipient if self.recipient in declared else None)

    @property
    def builtin(self) -> bool:
        """A message to a recipient that is not a function: one of gpt-oss's built-in tools."""
        return self.recipient is not None and self.function is None


def _held(text: str) -> int:
    """Length of the longest end of `text` that could begin a marker (kept back while streaming)."""
    i = text.rfind("<|", max(0, len(text) - max(map(len, MARKERS)) + 1))
    if i < 0:
        return 1 if text.endswith("<") else 0
    return len(text) - i if any(m.startswith(text[i:]) for m in MARKERS) else int(text.endswith("<"))


def parse(text: str, final: bool) -> list[Message]:
    out: list[Message] = []
    pos = 0
    lead = None  # the answer opens with the recipient (after the prompt's `<|start|>assistant`)
    head = text.lstrip()
    if head.startswith("to=") or (not final and head and "to=".startswith(head)):
        h = _HEADER.search(text)
        if h is None:
            return [Message(None, None, text, text, True)] if final else []
        lead, pos = _RECIPIENT.search(text[:h.start()]), h.start()
    while pos < len(text):
        h = _HEADER.search(text, pos)
        if h is None or h.start() > pos:  # plain text up to the next header (or the end)
            stop = len(text) if h is None else h.start()
            plain = text[pos:stop]
            if h is None and not final:
                plain = plain[: len(plain) - _held(plain)]
            if plain:
                out.append(Message(None, None, plain, plain, h is not None or final))
            if h is None:
                return out
            pos = h.start()
        m = text.find(MESSAGE, pos)
        if m < 0:  # the header is not complete
            if final:
                out.append(Message(None, None, text[pos:], text[pos:], True))
            return out
        first = lead is not None and not out
        header = text[0 if first else pos:m]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if first:
            pos = 0  # the message's raw text starts with the recipient
        b = m + len(MESSAGE)
        end = _BODY_END.search(text, b)
        if end is None:
            body = text[b:] if final else text[b: len(text) - _held(text[b:])]
            out.append(Message(channel and channel[1], recipient and recipient[1], body, text[pos:b] + body, final))
            return out
        stop = end.end() if end.group() != START else end.start()
        out.append(Message(channel and channel[1], recipient and recipient[1], text[b:end.start()],
                           text[pos:stop], True))
        pos = stop
    return out
