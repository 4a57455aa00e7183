"""Grammar compilation, bound to one tokenizer and the model's vocabulary, cached and off-thread.

Backend: llguidance. Measured on the default model's tokenizer (bench/structured.py, numbers in
bench/RESULTS.md) against xgrammar: xgrammar's masks are faster per token, but both are far below
a decode step, and llguidance (a) needs only numpy (xgrammar imports torch and pulls triton, and
the engine must not need torch at run time), (b) builds a schema's parser lazily, so even a
50-field schema costs milliseconds to compile, and (c) reports every grammar error as a value
(validate_grammar, is_error) rather than an exception from a worker thread, which keeps "invalid
schema -> 400 naming the field" simple.

`submit(spec)` returns a Future of a CompiledGrammar: the first request with a spec starts the
compilation in a small thread pool, later ones share the same Future. A compilation that outlasts
`timeout_s` resolves its Future with a UserError (the worker may still finish; its result is
dropped from the cache so the next request retries). A failed compilation stays cached: the same
bad schema fails fast.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import queue
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from jaxserve.errors import UserError
from jaxserve.structured.matcher import Matcher
from jaxserve.structured.spec import StructuredOutputs

if TYPE_CHECKING:
    import llguidance

JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: no runaway whitespace
MAX_CACHED = 512
SMALL_SPEC_CHARS = 2048  # specs up to this size compile in their own lane
# llguidance recurses on the C stack (a 5,000-rule chain overflows 8 MiB); its threads get this
# much (virtual memory: only the pages touched are backed), behind the bounds of limits.py.
COMPILE_STACK_BYTES = 256 << 20


def _llg():
    """llguidance, imported on the first grammar: an engine that never sees one (and a device
    image without llguidance) never loads it."""
    import llguidance
    import llguidance.gbnf_to_lark
    import llguidance.hf

    return llguidance


class StackPool:
    """A fixed pool of daemon threads with a large stack (ThreadPoolExecutor cannot set one).
    A job whose future was cancelled while queued is skipped."""

    _stack_lock = threading.Lock()

    def __init__(self, workers: int, name: str, stack_bytes: int = COMPILE_STACK_BYTES):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        with StackPool._stack_lock:
            old = threading.stack_size(stack_bytes)
            try:
                for i in range(workers):
                    threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()
            finally:
                threading.stack_size(old)

    def submit(self, fn, *args) -> cf.Future:
        fut: cf.Future = cf.Future()
        self._jobs.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            fut, fn, args = self._jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting request
                fut.set_exception(e)


def _spec_chars(spec: StructuredOutputs) -> int:
    value = spec.key[1]
    if isinstance(value, str):
        return len(value)
    if isinstance(value, tuple):
        return sum(len(c) for c in value)
    if spec.kind == "tool_call":
        return sum(len(s) for _, s in spec.tool_call.functions)
    return 0


class CompiledGrammar:
    """A validated grammar; `matcher()` gives each sequence its own state (a cheap copy)."""

    def __init__(self, template: llguidance.LLMatcher, vocab_size: int):
        self._template = template
        self.vocab_size = vocab_size

    def matcher(self, tokens: list[int] = ()) -> Matcher:
        """A fresh matcher, advanced over `tokens` (output so far, after a preemption)."""
        m = Matcher(self._template.deep_copy(), self.vocab_size)
        for t in tokens:
            if not m.accept(t):
                raise RuntimeError(f"token {t} does not fit the grammar it was sampled under")
        return m


class GrammarCompiler:
    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int], *,
                 max_workers: int = 2, timeout_s: float = 30.0):
        """`vocab_size` is the model's (logit rows); ids past the tokenizer's are never allowed."""
        self._hf = hf_tokenizer
        self._eos = sorted(set(eos_token_ids)) or [hf_tokenizer.eos_token_id]
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        # Small specs get a lane of their own, so slow big ones cannot starve them.
        self._pool = StackPool(max_workers, "grammar")
        self._small_pool = StackPool(1, "grammar-small")
        self._cache: OrderedDict[tuple, cf.Future] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built on first use (a few hundred ms for a 49k
        vocabulary), so an engine that never sees a grammar does not pay for it at start-up."""
        with self._tokenizer_lock:  # not the cache's lock: submit() never waits for this
            if self._tokenizer is None:
                self._tokenizer = _llg().hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self._eos)
            return self._tokenizer

    @classmethod
    def for_tokenizer(cls, tok, vocab_size: int, eos_token_ids=None, **kw) -> GrammarCompiler:
        """From a jaxserve Tokenizer; EOS ids default to the tokenizer's (pass the engine's)."""
        eos = tok.eos_token_ids if eos_token_ids is None else eos_token_ids
        return cls(tok.hf, vocab_size, list(eos), **kw)

    def submit(self, spec: StructuredOutputs) -> cf.Future:
        with self._lock:
            fut = self._cache.get(spec.key)
            if fut is not None:
                self._cache.move_to_end(spec.key)
                return fut
            fut = self._cache[spec.key] = cf.Future()
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
        pool = self._small_pool if _spec_chars(spec) <= SMALL_SPEC_CHARS else self._pool
        work = pool.submit(self._compile, spec)
        timer = threading.Timer(self.timeout_s, self._expire, (spec, fut, work))
        timer.daemon = True
        timer.start()

        def done(w: cf.Future) -> None:
            timer.cancel()
            if fut.done() or w.cancelled():  # cancelled: only by _expire, which answers fut
                return
            try:
                fut.set_result(w.result())
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the grammar
                fut.set_exception(e)

        work.add_done_callback(done)
        return fut

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Blocking; raises UserError for an invalid spec or a timeout."""
        return self.submit(spec).result()

    def _expire(self, spec: StructuredOutputs, fut: cf.Future, work: cf.Future | None = None) -> None:
        # The timeout answer first: cancelling `work` runs its done callback at once, which
        # must find `fut` answered (it once answered CancelledError, cached for the spec).
        try:
            fut.set_exception(UserError(
                f"The grammar of {spec.param} took longer than {self.timeout_s:g} s to compile: "
                "simplify it.", param=spec.param))
        except cf.InvalidStateError:
            return
        if work is not None:
            work.cancel()  # still queued: it never runs (a running native compile cannot be stopped)
        with self._lock:
            if self._cache.get(spec.key) is fut:
                del self._cache[spec.key]

    def _compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        grammar = self._grammar(spec)
        err = _llg().LLMatcher.validate_grammar(grammar, self.tokenizer)
        if err:
            raise UserError(f"Invalid {spec.param}: {_first_line(err)}", param=spec.param)
        m = _llg().LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise UserError(f"Invalid {spec.param}: {_first_line(m.get_error())}",
                            param=spec.param)
        return CompiledGrammar(m, self.vocab_size)

    @staticmethod
    def _grammar(spec: StructuredOutputs) -> str:
        """The spec as an llguidance grammar (Lark text or its JSON form)."""
        kind = spec.kind
        llg = _llg()
        from_schema = llg.LLMatcher.grammar_from_json_schema
        try:
            if kind == "json":
                return from_schema(spec.json, defaults=JSON_OPTIONS)
            if kind == "json_object":
                return from_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if kind == "tool_call":
                return from_schema(spec.tool_call.schema(), defaults=JSON_OPTIONS)
            if kind == "regex":
                return llg.LLMatcher.grammar_from_regex(spec.regex)
            if kind == "choice":
                return "start: " + " | ".join(json.dumps(c) for c in spec.choice)
            g = spec.grammar
            return llg.gbnf_to_lark.gbnf_to_lark(g) if "::=" in g else g
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - the library's parse errors are the client's input
            raise UserError(f"Invalid {spec.param}: {_first_line(str(e))}",
                            param=spec.param) from None


def _first_line(msg: str) -> str:
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    return " ".join(lines[:6])[:300]
