"""OpenAI response shapes: choices, logprobs (legacy and chat), usage, SSE chunks.

One ResponseBuilder per API call turns the engine's RequestOutputs into either one JSON body or a
stream of chunks: one chunk per step per choice that changed, `finish_reason` exactly once per
choice, an optional usage chunk, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

from jaxserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from jaxserve.server import protocol as P
from jaxserve.server.async_engine import EngineDeadError, RequestFailedError, RequestStream
from jaxserve.server.errors import APIError, error_body, internal_error
from jaxserve.server.output_parser import Delta, OutputParser, Parsed, delta_json, message_json
from jaxserve.server.output_parser import finish_reason as agent_finish_reason
from jaxserve.server.streaming import DONE, sse
from jaxserve.tokenizer import _byte_alphabet

log = logging.getLogger("jaxserve.server")

MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass
class Prompt:
    ids: list[int]
    text: str | None = None


@dataclass
class Kind:
    """What differs between completions and chat."""

    object: str  # "text_completion" | "chat.completion"
    chunk_object: str
    id_prefix: str
    params: P.SamplingRequest
    prompts: list[Prompt]
    echo: bool = False
    echo_only: bool = False  # completions with echo and max_tokens 0: the prompt alone comes back
    chat_echo: str = ""  # chat with echo: the last message's content, leading each choice's content
    aliases: dict[str, str] = field(default_factory=dict)
    output: OutputParser | None = None  # chat: reasoning / tool calls out of the text


class TokenTexts:
    """Per-token display text and raw bytes, cached (logprobs name every sampled token)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        t = self._text.get(token_id)
        if t is None:
            t = self._text[token_id] = self.tok.decode([token_id], skip_special_tokens=False)
        return t

    def bytes(self, token_id: int) -> list[int]:
        """The token's raw bytes (a byte-level token may hold part of a UTF-8 character)."""
        b = self._bytes.get(token_id)
        if b is None:
            b = self._bytes[token_id] = list(
                _raw_bytes(self.tok, token_id) or self.text(token_id).encode()
            )
        return b


def _raw_bytes(tok, token_id: int) -> bytes | None:
    piece = tok.convert_ids_to_tokens([token_id])[0]
    if piece is None or token_id in tok.all_special_ids:
        return None
    m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
    if m:  # sentencepiece byte fallback
        return bytes([int(m[1], 16)])
    inv = _inverse_byte_alphabet()
    if all(ch in inv for ch in piece):  # GPT-2 byte-level BPE
        return bytes(inv[ch] for ch in piece)
    return piece.replace("\u2581", " ").encode()


@functools.lru_cache(maxsize=1)
def _inverse_byte_alphabet() -> dict[str, int]:
    return {ch: b for b, ch in _byte_alphabet().items()}


class ResponseBuilder:
    """Shapes one API call's outputs as OpenAI choices, streamed or whole."""

    def __init__(self, tokens: TokenTexts, kind: Kind, n: int, api_id: str, model: str):
        self.tokens, self.kind, self.n, self.id, self.model = tokens, kind, n, api_id, model
        self.created = int(time.time())
        self.chat = kind.object == "chat.completion"
        self._sent_prompt_ids: set[int] = set()  # streamed choices that carried prompt_token_ids
        # vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:N" (a token that
        # is not valid UTF-8 alone stays recoverable)
        self.as_ids = bool(getattr(kind.params, "return_tokens_as_token_ids", False))
        self.tt = (lambda t: f"token_id:{t}") if self.as_ids else tokens.text

    def _bytes(self, token_id: int) -> list[int]:
        return list(self.tt(token_id).encode()) if self.as_ids else self.tokens.bytes(token_id)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _echo(self, prompt_idx: int) -> str:
        p = self.kind.prompts[prompt_idx]
        if p.text is None:
            p.text = self.tokens.tok.decode(
                p.ids, skip_special_tokens=self.kind.params.skip_special_tokens
            )
        return p.text

    # ---- logprobs in both API shapes -------------------------------------------------------------
    def _logprobs(self, lps: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
        if lps is None:
            return None
        tt = self.tt
        if self.chat:

            def entry(tid: int, lp: float) -> dict:
                return {
                    "token": tt(tid),
                    "logprob": max(lp, MIN_LOGPROB),
                    "bytes": self._bytes(tid),
                }

            return {
                "content": [
                    {
                        **entry(lp.token_id, lp.logprob),
                        "top_logprobs": [entry(i, v) for i, v in lp.top],
                    }
                    for lp in lps
                ]
            }
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            t = tt(lp.token_id)
            out["tokens"].append(t)
            out["token_logprobs"].append(max(lp.logprob, MIN_LOGPROB))
            # The sampled token first, then the top ones, best first (as vLLM: logprobs=0 gives
            # just the sampled token); tokens with the same text keep the first value.
            top: dict[str, float] = {t: max(lp.logprob, MIN_LOGPROB)}
            for i, v in lp.top:
                top.setdefault(tt(i), max(v, MIN_LOGPROB))
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(t)
        return out

    def _echoed_logprobs(self, out: RequestOutput, o: CompletionOutput,
                         generated: list[TokenLogprob]) -> dict | None:
        """Completions' logprobs with echo: the prompt's tokens first (the first without a
        logprob), then the generated ones (none when only the prompt is echoed)."""
        if out.prompt_logprobs is None:
            return self._logprobs(generated) if o.logprobs is not None else None
        tt = self.tt
        offset = 0
        head = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp in zip(out.prompt_token_ids, out.prompt_logprobs):
            t = tt(tid)
            head["tokens"].append(t)
            head["text_offset"].append(offset)
            offset += len(t)
            if lp is None:
                head["token_logprobs"].append(None)
                head["top_logprobs"].append(None)
                continue
            head["token_logprobs"].append(max(lp.logprob, MIN_LOGPROB))
            top = {t: max(lp.logprob, MIN_LOGPROB)}
            for i, v in lp.top:
                top.setdefault(tt(i), max(v, MIN_LOGPROB))
            head["top_logprobs"].append(top)
        if self.kind.echo_only or o.logprobs is None:
            return head
        tail = self._logprobs(generated, offset)
        return {k: head[k] + tail[k] for k in head}

    def _vllm_prompt_logprobs(self, out: RequestOutput) -> list | None:
        """vLLM's `prompt_logprobs`: per prompt token None or {token id: logprob, rank, text},
        the prompt's own token and the top-N (rank known within the top-N)."""
        if out.prompt_logprobs is None:
            return None
        tt = self.tokens.text
        rows: list = []
        for lp in out.prompt_logprobs:
            if lp is None:
                rows.append(None)
                continue
            ranks = {tid: r for r, (tid, _) in enumerate(lp.top, 1)}
            entry = {str(lp.token_id): {"logprob": max(lp.logprob, MIN_LOGPROB),
                                        "rank": ranks.get(lp.token_id), "decoded_token": tt(lp.token_id)}}
            for tid, v in lp.top:
                entry.setdefault(str(tid), {"logprob": max(v, MIN_LOGPROB), "rank": ranks[tid],
                                            "decoded_token": tt(tid)})
            rows.append(entry)
        return rows

    def _choice(
        self, index: int, text: str, logprobs: dict | None, o: CompletionOutput, *, delta: bool,
        parsed: Parsed | Delta | None = None, made_calls: bool = False,
    ) -> dict:
        c: dict[str, Any] = {"index": index}
        if not self.chat:
            c["text"] = text
        elif parsed is not None:  # split by the output parser
            c["delta" if delta else "message"] = (
                delta_json(parsed) if delta else message_json(parsed)
            )
        elif delta:
            c["delta"] = {"content": text} if text else {}
        else:
            c["message"] = {"role": "assistant", "content": text}
        c["logprobs"] = logprobs
        c["finish_reason"] = agent_finish_reason(o.finish_reason, made_calls)
        c["stop_reason"] = o.stop_reason
        if self.kind.params.return_token_ids:
            c["token_ids"] = list(o.delta_token_ids if delta else o.token_ids)
            if not self.chat and (not delta or index not in self._sent_prompt_ids):
                self._sent_prompt_ids.add(index)
                c["prompt_token_ids"] = self.kind.prompts[index // self.n].ids
        return c

    def _usage(self, outs: dict[int, RequestOutput]) -> dict:
        prompt = sum(len(p.ids) for p in self.kind.prompts)
        completion = 0 if self.kind.echo_only else sum(len(o.token_ids) for r in outs.values() for o in r.outputs)
        cached = sum(r.num_cached_tokens for r in outs.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # ---- whole -----------------------------------------------------------------------------------
    async def collect(self, stream: RequestStream) -> dict[int, RequestOutput] | None:
        finals: dict[int, RequestOutput] = {}
        async for idx, out in stream:
            if out.finished:
                finals[idx] = out
        return finals if len(finals) == len(self.kind.prompts) else None

    def body(self, finals: dict[int, RequestOutput]) -> dict:
        choices = []
        for idx in sorted(finals):
            out = finals[idx]
            for o in out.outputs:
                if self.kind.echo_only:
                    o = self._echo_only(o)
                text = (self._echo(idx) + o.text) if self.kind.echo else o.text
                parsed = self.kind.output.extract(text) if self.kind.output else None
                if self.kind.echo and not self.chat:
                    lps = self._echoed_logprobs(out, o, o.logprobs)
                else:
                    lps = self._logprobs(o.logprobs)
                choice = self._choice(
                    idx * self.n + o.index, text, lps, o, delta=False,
                    parsed=parsed, made_calls=bool(parsed and parsed.calls),
                )
                if self.kind.chat_echo:
                    msg = choice["message"]
                    msg["content"] = self.kind.chat_echo + (msg.get("content") or "")
                if not self.chat and self.kind.params.prompt_logprobs is not None:
                    # once per prompt (its first choice), not n times: n=16 over a long prompt
                    # was 45 MB of repeats
                    choice["prompt_logprobs"] = self._vllm_prompt_logprobs(out) if o.index == 0 else None
                choices.append(choice)
        body = {**self._head(self.kind.object), "choices": choices, "usage": self._usage(finals)}
        if self.chat and self.kind.params.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(finals[min(finals)])
        if self.chat and self.kind.params.return_token_ids:
            body["prompt_token_ids"] = self.kind.prompts[0].ids
        return body

    @staticmethod
    def _echo_only(o: CompletionOutput) -> CompletionOutput:
        """The choice as the prompt alone: the one token the engine sampled is dropped."""
        return CompletionOutput(o.index, finish_reason="length" if o.finished else None,
                                logprobs=o.logprobs)

    # ---- streamed --------------------------------------------------------------------------------
    async def events(self, stream: RequestStream):
        """One chunk per step per choice that changed; finish_reason exactly once per choice.

        A stream the server aborts (shutdown timeout) ends its unfinished choices with
        finish_reason "abort"; an engine failure or a bug ends it with an error event. Every
        stream ends with [DONE].
        """
        opts = self.kind.params.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and opts.continuous_usage_stats
        head = self._head(self.kind.chunk_object)
        latest: dict[int, RequestOutput] = {}
        done: set[int] = set()
        started: set[int] = set()
        offsets: dict[int, int] = {}
        num_choices = len(self.kind.prompts) * self.n
        incs = {}  # per choice: the output parser's stream state
        try:
            if self.chat:
                for i in range(num_choices):
                    first = {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    chunk = {**head, "choices": [first]}
                    if i == 0 and self.kind.params.return_token_ids:
                        chunk["prompt_token_ids"] = self.kind.prompts[0].ids
                    if continuous:
                        chunk["usage"] = self._usage(latest)
                    yield sse(chunk)
                    if self.kind.chat_echo:  # vLLM: the echoed content is the next delta
                        echo = {"index": i, "delta": {"content": self.kind.chat_echo},
                                "logprobs": None, "finish_reason": None}
                        chunk = {**head, "choices": [echo]}
                        if continuous:
                            chunk["usage"] = self._usage(latest)
                        yield sse(chunk)
            async for idx, out in stream:
                latest[idx] = out
                for o in out.outputs:
                    if self.kind.echo_only:
                        o = self._echo_only(o)
                    index = idx * self.n + o.index
                    # a chunk per step that brought tokens, with empty text where the detokenizer
                    # (an incomplete UTF-8 sequence) or a possible stop string holds its text back,
                    # as vLLM streams: the client sees every token's arrival
                    if index in done or not (o.delta_text or o.finished or o.delta_token_ids
                                             or (o.delta_logprobs and o.logprobs is not None)):
                        continue
                    text = o.delta_text
                    first = index not in started
                    if self.kind.echo and first:
                        text = self._echo(idx) + text
                    started.add(index)
                    # the chunk that carries the prompt's logprobs (prompt tokens x top-N) is
                    # built and encoded on a worker thread, off the event loop
                    heavy = first and out.prompt_logprobs is not None
                    if self.kind.echo and heavy:
                        lps = await asyncio.to_thread(self._echoed_logprobs, out, o, o.delta_logprobs)
                    elif o.logprobs is not None:
                        lps = self._logprobs(o.delta_logprobs, offsets.get(index, 0))
                    else:
                        lps = None
                    if lps is not None and not self.chat:
                        offsets[index] = offsets.get(index, 0) + sum(map(len, lps["tokens"]))
                    if o.finished:
                        done.add(index)
                    parsed = None
                    if self.kind.output is not None:
                        inc = incs.setdefault(index, self.kind.output.stream())
                        parsed = inc.feed(text, final=o.finished)
                        if not (parsed.content or parsed.reasoning or parsed.calls or o.finished
                                or lps or (o.delta_token_ids and self.kind.params.return_token_ids)):
                            continue  # held back: it may still become a call or a tag
                    choice = self._choice(index, text, lps, o, delta=True, parsed=parsed,
                                          made_calls=bool(index in incs and incs[index].sent.calls))
                    chunk = {**head, "choices": [choice]}
                    if first and self.kind.params.prompt_logprobs is not None and o.index == 0:
                        where = chunk if self.chat else choice
                        where["prompt_logprobs"] = await asyncio.to_thread(self._vllm_prompt_logprobs, out)
                    if continuous:
                        chunk["usage"] = self._usage(latest)
                    yield (await asyncio.to_thread(sse, chunk, True)) if heavy else sse(chunk)
            if stream.aborted:  # by the server (a client that left reads nothing more)
                for index in sorted(set(range(num_choices)) - done):
                    # what the output parser still held back, then finish_reason "abort"
                    parsed = incs[index].feed("", final=True) if index in incs else None
                    choice = self._choice(
                        index, "", None, CompletionOutput(index, finish_reason="abort"),
                        delta=True, parsed=parsed,
                    )
                    yield sse({**head, "choices": [choice]})
            if include_usage:
                yield sse({**head, "choices": [], "usage": self._usage(latest)})
        except EngineDeadError as e:
            yield sse(error_body(APIError(503, str(e), code="engine_unavailable")))
        except RequestFailedError as e:  # this request alone failed; the server serves on
            yield sse(error_body(APIError(500, str(e), code="request_failed")))
        except Exception:  # a bug: this stream ends with an error event, the server serves on
            log.exception("Unhandled error while streaming")
            yield sse(error_body(internal_error()))
        finally:
            stream.abort()  # no-op once finished; frees the blocks of a stream cut short
        yield DONE
