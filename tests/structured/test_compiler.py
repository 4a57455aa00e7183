"""The grammar compiler and matcher on two real tokenizers: the default model's (SmolLM2, via
GGUF) and a tiny trained BPE whose model vocabulary is larger than the tokenizer's."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from jaxserve.errors import UserError
from jaxserve.structured import StructuredOutputs, ToolCallSpec
from jaxserve.structured.compiler import GrammarCompiler
from jaxserve.structured.matcher import bitmask_width

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


class Tok:
    """One tokenizer under test: its HF tokenizer, the model vocab, the EOS ids."""

    def __init__(self, hf, vocab: int, eos: list[int]):
        self.hf, self.vocab, self.eos = hf, vocab, eos
        self.compiler = GrammarCompiler(hf, vocab, eos)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module", params=["tiny", "default"])
def tok(request) -> Tok:
    if request.param == "tiny":
        from tests.tiny_models import build_tokenizer

        hf = build_tokenizer()
        return Tok(hf, len(hf) + 100, [hf.eos_token_id])  # padded embedding rows
    from jaxserve.model.default_model import default_model_path
    from jaxserve.tokenizer import Tokenizer

    t = Tokenizer.from_pretrained(default_model_path(download=False))
    return Tok(t.hf, 49152, sorted(t.eos_token_ids))


def allowed(m, vocab: int) -> np.ndarray:
    row = np.zeros(bitmask_width(vocab), np.int32)
    m.fill_bitmask(row)
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def walk(tok: Tok, spec: StructuredOutputs, text: str, check_mask: bool = True):
    """Feed `text`'s tokens, checking each is in the mask first; return the matcher.

    (Inside an anyOf, llguidance's mask can be narrower than what it accepts: after an enum it
    may allow only `"`, not the tokenizer's `"}`; sound, just not every tokenization.)
    """
    m = tok.compiler.compile(spec).matcher()
    for t in tok.encode(text):
        assert not check_mask or allowed(m, tok.vocab)[t], (text, t)
        assert m.accept(t)
    return m


def sample(tok: Tok, spec: StructuredOutputs, seed: int, max_tokens: int = 200) -> tuple[str, bool]:
    """Random tokens drawn uniformly from the mask (a model that knows nothing) until EOS."""
    rng = np.random.default_rng(seed)
    m = tok.compiler.compile(spec).matcher()
    out: list[int] = []
    for _ in range(max_tokens):
        ok = np.flatnonzero(allowed(m, tok.vocab))
        assert ok.size and ok.max() < len(tok.hf), "mask allows ids past the tokenizer"
        # prefer EOS when allowed half the time, or strings never end
        eos_ok = [e for e in tok.eos if e in ok]
        t = eos_ok[0] if eos_ok and rng.random() < 0.5 else int(rng.choice(ok))
        assert m.accept(t)
        if t in tok.eos:
            assert m.is_terminated()
            return tok.hf.decode(out), True
        out.append(t)
    return tok.hf.decode(out), False


def test_json_schema_walk_and_eos_only_at_accept(tok):
    spec = StructuredOutputs(json=SCHEMA)
    text = json.dumps({"name": "Ann", "age": 31, "tags": ["a"]}, separators=(",", ":"))
    m = tok.compiler.compile(spec).matcher()
    for t in tok.encode(text):
        assert not any(allowed(m, tok.vocab)[tok.eos]), "EOS before the object is complete"
        assert m.accept(t)
    assert allowed(m, tok.vocab)[tok.eos].all() and allowed(m, tok.vocab).sum() == len(tok.eos)
    assert m.is_terminated()  # nothing but EOS can follow: the engine may finish now
    assert m.accept(tok.eos[0]) and m.is_terminated()
    m = walk(tok, StructuredOutputs(json={"type": "integer"}), "12")
    assert allowed(m, tok.vocab)[tok.eos].all() and not m.is_terminated()  # more digits fit


def test_random_sampling_under_the_mask_is_schema_valid(tok):
    spec = StructuredOutputs(json=SCHEMA)
    finished = 0
    for seed in range(8):
        text, done = sample(tok, spec, seed)
        if done:
            finished += 1
            jsonschema.validate(json.loads(text), SCHEMA)
    assert finished >= 4


def test_rejects_a_token_outside_the_grammar(tok):
    m = tok.compiler.compile(StructuredOutputs(json=SCHEMA)).matcher()
    bad = tok.encode("x")[0]
    assert not allowed(m, tok.vocab)[bad]
    assert not m.accept(bad)
    assert m.error


def test_regex_and_choice(tok):
    m = walk(tok, StructuredOutputs(regex=r"[0-9]{3}-[a-z]+"), "123-abc")
    assert m.is_accepting()
    spec = StructuredOutputs(choice=["yes", "no", 'say "hi"'])
    for c in spec.choice:
        assert walk(tok, spec, c).is_accepting()
    for seed in range(6):
        text, done = sample(tok, spec, seed)
        assert done and text in spec.choice


def test_grammar_lark_and_gbnf(tok):
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]+/'
    assert walk(tok, StructuredOutputs(grammar=lark), "(1,22,333)").is_accepting()
    gbnf = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+'
    assert walk(tok, StructuredOutputs(grammar=gbnf), "(4,5)").is_accepting()


def test_json_object_accepts_any_object(tok):
    spec = StructuredOutputs(json_object=True)
    assert walk(tok, spec, '{"a":[1,{"b":null}],"c":"d"}').is_accepting()
    m = tok.compiler.compile(spec).matcher()
    assert not allowed(m, tok.vocab)[tok.encode("[")[0]]


def test_tool_call_spec_arguments_match_the_function_schema(tok):
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                "unit": {"enum": ["c", "f"]}},
               "required": ["city", "unit"], "additionalProperties": False}
    fns = {"get_weather": weather, "noop": {"type": "object", "properties": {},
                                            "additionalProperties": False}}
    spec = StructuredOutputs(tool_call=ToolCallSpec.build(fns))
    calls = '[{"name":"get_weather","arguments":{"city":"Oslo","unit":"c"}},' \
            '{"name":"noop","arguments":{}}]'
    assert walk(tok, spec, calls, check_mask=False).is_accepting()
    named = StructuredOutputs(tool_call=ToolCallSpec.build(fns, "get_weather", parallel=True))
    for seed in range(6):
        text, done = sample(tok, named, seed, max_tokens=300)
        if done:
            out = json.loads(text)
            assert len(out) == 1 and out[0]["name"] == "get_weather"
            jsonschema.validate(out[0]["arguments"], weather)
    with pytest.raises(UserError) as e:
        ToolCallSpec.build(fns, "missing")
    assert e.value.param == "tool_choice"


def test_rollback_and_rebuild_from_tokens(tok):
    spec = StructuredOutputs(json=SCHEMA)
    text = '{"name":"Bo","age":7}'
    ids = tok.encode(text)
    full = walk(tok, spec, text)
    m = tok.compiler.compile(spec).matcher(ids[:-2])  # rebuilt after a preemption
    np.testing.assert_array_equal(allowed(m, tok.vocab), allowed(
        walk(tok, spec, tok.hf.decode(ids[:-2])), tok.vocab))
    full.rollback(2)
    np.testing.assert_array_equal(allowed(full, tok.vocab), allowed(m, tok.vocab))


def test_cache_shares_one_compilation_per_spec(tok):
    a = tok.compiler.submit(StructuredOutputs(json={"type": "object", "properties": {
        "x": {"type": "integer"}, "y": {"type": "string"}}}))
    b = tok.compiler.submit(StructuredOutputs(json=json.dumps({"properties": {
        "y": {"type": "string"}, "x": {"type": "integer"}}, "type": "object"})))
    assert a is b
    assert a.result(30) is b.result(30)


@pytest.mark.parametrize("spec, needle", [
    ({"json": {"type": "nope"}}, "nope"),
    ({"json": {"$ref": "#/definitions/missing"}}, "missing"),
    ({"regex": "a(b"}, "unclosed"),
    ({"grammar": "start: undefined_rule"}, "undefined_rule"),
])
def test_invalid_specs_are_user_errors_naming_the_field(tok, spec, needle):
    s = StructuredOutputs(**spec)
    with pytest.raises(UserError) as e:
        tok.compiler.compile(s)
    assert e.value.param == s.param == f"structured_outputs.{next(iter(spec))}"
    assert needle in e.value.message
    assert tok.compiler.submit(s).exception(5) is not None  # a failure is cached, not retried


def test_a_compilation_past_the_timeout_is_a_user_error():
    from tests.tiny_models import build_tokenizer

    hf = build_tokenizer()
    c = GrammarCompiler(hf, len(hf), [hf.eos_token_id], timeout_s=0.0)
    with pytest.raises(UserError, match="took longer than") as e:
        c.compile(StructuredOutputs(regex="(a|b)*c{5,}" + "d" * 50))
    assert e.value.param == "structured_outputs.regex"


@pytest.mark.parametrize("kw, param", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": [1]}, "structured_outputs.json"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", ""]}, "structured_outputs.choice"),
    ({"regex": ""}, "structured_outputs.regex"),
])
def test_spec_validation(kw, param):
    with pytest.raises(UserError) as e:
        StructuredOutputs(**kw)
    assert e.value.param == param


def test_bitmask_width_pads_to_words():
    assert [bitmask_width(v) for v in (1, 32, 33, 49152)] == [1, 1, 2, 1536]
    assert re.fullmatch(r"\d+", str(bitmask_width(384)))


def test_bitmask_filler_matches_per_row_fill(tok):
    from jaxserve.structured.matcher import BitmaskFiller

    g = tok.compiler.compile(StructuredOutputs(json=SCHEMA))
    a, b = g.matcher(), g.matcher(tok.encode('{"name":"X'))
    mask = np.zeros((4, bitmask_width(tok.vocab)), np.int32)
    assert BitmaskFiller(2).fill([a, None, b, None], mask)
    for row, m in ((0, a), (2, b)):
        want = np.zeros(bitmask_width(tok.vocab), np.int32)
        m.fill_bitmask(want)
        np.testing.assert_array_equal(mask[row], want)
    assert (mask[[1, 3]] == -1).all()
    assert not BitmaskFiller(1).fill([None, None, None, None], mask)
    assert (mask == -1).all()
