"""Incremental, UTF-8-safe detokenization with stop strings, one instance per request.

    d = IncrementalDetokenizer(tok, prompt_ids, stop=["\\n\\n"])
    for t in sampled_ids:
        delta = d.add(t)          # new text, possibly ""
        if d.stopped: break       # a stop string matched; it is not in the text
    delta = d.flush()             # at finish: whatever was held back
    assert d.text == "".join(all deltas)

Text is produced vLLM-style: a window of token ids [prefix_offset:] is decoded and compared with the
decode of [prefix_offset:read_offset]; the difference is the new text. While the window decodes to
a trailing U+FFFD (a multi-byte character split across tokens) nothing is emitted. Decoding a
window rather than single tokens keeps tokenizers that strip or merge spaces (sentencepiece) right;
the last few prompt tokens seed the window for the same reason.

Stop strings are searched in the decoded text, so they match across token boundaries. Unless
`include_stop_str_in_output`, the last len(longest stop) - 1 characters are held back until they
cannot be the start of a stop string, so a stop string never leaks into the streamed output and
nothing after it is ever emitted. With several stop strings, the one that is complete first in the
text wins (ties: the one starting first), whatever the token boundaries.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

_PROMPT_CONTEXT = 6  # prompt tokens used to seed the decode window (vLLM uses 5)
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                 stop: Iterable[str] | None = (), include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop_strings: list[str] = [s for s in (stop or ()) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._holdback = 0 if include_stop_str_in_output or not self.stop_strings else max(
            len(s) for s in self.stop_strings) - 1
        self._ids: list[int] = list(prompt_ids)[-_PROMPT_CONTEXT:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.token_ids: list[int] = []  # output token ids added so far
        self._full = ""  # all complete decoded output text (may run past a stop string)
        self._emitted = 0  # chars of the final text already returned
        self._end: int | None = None  # length of the final text once stopped
        self.stopped = False
        self.stop_str: str | None = None
        self.finished = False

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    @property
    def text(self) -> str:
        """The output text emitted so far (== the joined deltas; the final text after flush)."""
        return self._full[:self._emitted]

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the new text that is safe to emit (maybe "")."""
        if self.stopped or self.finished:
            return ""
        self.token_ids.append(int(token_id))
        self._ids.append(int(token_id))
        new_text = self._decode(self._ids[self._prefix_offset:])
        if new_text.endswith(_REPLACEMENT) or len(new_text) <= len(self._prefix_text):
            return ""  # an incomplete UTF-8 sequence, or nothing new yet
        delta = new_text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        return self._append(delta, final=False)

    def flush(self) -> str:
        """At finish: emit everything still held back.

        Tokens held back here end in an incomplete UTF-8 character (cut by max_tokens or a stop
        token); its bytes would decode as U+FFFD, which is not text the model wrote, so it is
        dropped (vLLM's output does not end in it either).
        """
        if self.stopped or self.finished:
            return ""
        self.finished = True
        delta = ""
        if self._read_offset < len(self._ids):
            new_text = self._decode(self._ids[self._prefix_offset:])
            delta = new_text[len(self._prefix_text):]
            if delta.endswith(_REPLACEMENT):  # one incomplete character: cut, not written
                delta = delta[:-1]
            self._read_offset = len(self._ids)
        return self._append(delta, final=True)

    def _append(self, delta: str, final: bool) -> str:
        before = len(self._full)
        self._full += delta
        if self.stop_strings:
            start = max(0, before - max(len(s) for s in self.stop_strings) + 1)
            best = None
            for s in self.stop_strings:
                i = self._full.find(s, start)
                if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
                    best = (i, s)
            if best is not None:  # the stop string that completed first (then the longest)
                i, s = best
                self.stopped = True
                self.stop_str = s
                self._end = i + len(s) if self.include_stop_str_in_output else i
                self._full = self._full[:self._end]
                return self._emit(self._end)
        if final:
            return self._emit(len(self._full))
        return self._emit(len(self._full) - self._holdback)

    def _emit(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self._full[self._emitted:upto]
        self._emitted = upto
        return out
