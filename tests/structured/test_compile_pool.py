"""The grammar compile pool cannot be monopolised (issue 31): small specs have a lane of their
own, a compile still queued at its timeout is cancelled, and deep grammars are bounded before
llguidance sees them."""

from __future__ import annotations

import threading

import pytest

from jaxserve.errors import UserError
from jaxserve.structured import StructuredOutputs
from jaxserve.structured.compiler import GrammarCompiler, StackPool
from tests.tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(build_tokenizer(), 512, [2], max_workers=2, timeout_s=5.0)


def test_small_spec_is_not_starved_by_slow_ones(compiler, monkeypatch):
    gate = threading.Event()
    real = GrammarCompiler._compile

    def compile_(self, spec):
        if spec.kind == "regex":  # the slow ones: held until the small one is done
            assert gate.wait(60)
        return real(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", compile_)
    slow = [compiler.submit(StructuredOutputs(regex=f"a{{{i}}}" + "b" * 2100)) for i in range(4)]
    small = compiler.submit(StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    small.result(60)
    assert not any(f.done() for f in slow)
    gate.set()
    for f in slow:
        f.result(60)


def test_queued_job_cancelled_at_timeout_never_runs():
    pool = StackPool(1, "t")
    gate, ran = threading.Event(), []
    first = pool.submit(gate.wait, 60)
    second = pool.submit(ran.append, 1)
    assert second.cancel()
    gate.set()
    assert first.result(60) is True
    pool.submit(lambda: None).result(60)  # the queue moved past the cancelled job
    assert ran == []


def test_deep_grammar_is_400_not_a_crash(compiler):
    chain = "\n".join(["start: r0"] + [f'r{i}: r{i + 1} "a"' for i in range(5000)] + ['r5000: "b"'])
    with pytest.raises(UserError) as e:
        compiler.compile(StructuredOutputs(grammar=chain))
    assert e.value.param == "structured_outputs.grammar"
    # near the bound: compiles on the pool's large stack (2,000 chained rules)
    ok = "\n".join(["start: r0"] + [f'r{i}: r{i + 1} "a"' for i in range(1990)] + ['r1990: "b"'])
    assert compiler.compile(StructuredOutputs(grammar=ok)) is not None


def test_compile_queued_past_its_timeout_is_a_400_and_never_runs(monkeypatch):
    """Both big-spec workers held by slow compiles: a third big spec answers its timeout (a
    UserError naming the field) and its compile, still queued, is cancelled: when the workers
    free up they skip it, so a timed-out request costs the pool nothing."""
    compiler = GrammarCompiler(build_tokenizer(), 512, [2], max_workers=2, timeout_s=0.5)
    gate, compiled = threading.Event(), []
    real = GrammarCompiler._compile

    def compile_(self, spec):
        compiled.append(spec.regex[:8])
        if spec.regex.startswith("slow"):
            assert gate.wait(60)
        return real(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", compile_)
    big = "b" * 2100  # past SMALL_SPEC_CHARS: the big lane
    slow = [compiler.submit(StructuredOutputs(regex=f"slow{i}" + big)) for i in range(2)]
    queued = compiler.submit(StructuredOutputs(regex="queued" + big))
    with pytest.raises(UserError) as e:
        queued.result(30)
    assert e.value.param == "structured_outputs.regex" and "took longer" in e.value.message
    gate.set()
    for f in slow:  # each outlived its own timeout (a 400) or, on a busy host, finished first
        if f.exception(30) is not None:
            assert isinstance(f.exception(), UserError), f.exception()
    compiler.submit(StructuredOutputs(regex="after" + big)).result(30)  # the lane is free again
    assert sorted(compiled) == ["after" + big[:3], "slow0" + big[:3], "slow1" + big[:3]]
