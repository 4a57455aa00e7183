"""Admission bounds (jaxserve/limits.py): each refuses with a UserError naming the field, without
recursing on the hostile value."""

import json

import pytest

from jaxserve import limits
from jaxserve.errors import UserError
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured import StructuredOutputs, ToolCallSpec
from jaxserve.structured.spec import closed_objects


def deep_array(n: int) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize("text", [deep_array(5000), '{"a":' * 5000 + "1" + "}" * 5000, deep_array(65)])
def test_deep_json_schema_text_is_refused(text):
    with pytest.raises(UserError) as e:
        StructuredOutputs(json=text)
    assert e.value.param == "structured_outputs.json" and "nested deeper" in e.value.message


def test_deep_schema_value_is_refused_without_recursion():
    v: dict = {"type": "string"}
    for _ in range(20000):  # json.dumps of this would raise RecursionError
        v = {"type": "array", "items": v}
    with pytest.raises(UserError) as e:
        StructuredOutputs(json=v)
    assert e.value.param == "structured_outputs.json"
    assert limits.value_depth({"a": [1, {"b": 2}]}) == 3


def test_grammar_bounds():
    chain = "\n".join(["start: r0"] + [f'r{i}: r{i + 1} "a"' for i in range(5000)] + ['r5000: "b"'])
    with pytest.raises(UserError) as e:
        StructuredOutputs(grammar=chain)
    assert e.value.param == "structured_outputs.grammar" and "rules" in e.value.message
    with pytest.raises(UserError, match="nests brackets"):
        StructuredOutputs(grammar="start: " + "(" * 500 + '"a"' + ")" * 500)
    with pytest.raises(UserError) as e:
        StructuredOutputs(regex="(" * 300 + "a" + ")" * 300)
    assert e.value.param == "structured_outputs.regex"
    with pytest.raises(UserError, match="characters"):
        StructuredOutputs(grammar='start: "' + "a" * (limits.MAX_GRAMMAR_BYTES + 1) + '"')
    with pytest.raises(UserError) as e:
        StructuredOutputs(choice=["x"] * (limits.MAX_CHOICES + 1))
    assert e.value.param == "structured_outputs.choice"
    StructuredOutputs(grammar='start: "a" | b\nb: "b"')  # ordinary grammars pass


def test_schema_size_bound():
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20000)}}
    with pytest.raises(UserError, match="bytes"):
        StructuredOutputs(json=big)


@pytest.mark.parametrize("key", ["²", "1" * 5000, "-1", "1.5", "", "٣"])
def test_logit_bias_keys(key):
    with pytest.raises(UserError) as e:
        limits.parse_token_id_key(key)
    assert e.value.param == "logit_bias"
    assert limits.parse_token_id_key("123") == 123


def test_stop_lists_bounded():
    with pytest.raises(UserError) as e:
        SamplingParams(stop=["x"] * (limits.MAX_STOP_STRINGS + 1))
    assert e.value.param == "stop"
    with pytest.raises(UserError) as e:
        SamplingParams(stop=["x" * (limits.MAX_STOP_CHARS + 1)])
    assert e.value.param == "stop"
    with pytest.raises(UserError) as e:
        SamplingParams(stop_token_ids=list(range(limits.MAX_STOP_TOKEN_IDS + 1)))
    assert e.value.param == "stop_token_ids"


def test_worst_row_adjustments():
    kw = dict(prompt_len=100, max_tokens=50, vocab_size=49152)
    assert limits.worst_row_adjustments(bias_and_bans=16385, penalties=False, repetition=False, **kw) == 16385
    assert limits.worst_row_adjustments(bias_and_bans=16000, penalties=True, repetition=False, **kw) == 16050
    assert limits.worst_row_adjustments(bias_and_bans=16000, penalties=True, repetition=True, **kw) == 16150
    assert limits.worst_row_adjustments(bias_and_bans=10, penalties=True, repetition=True, prompt_len=10**6,
                                        max_tokens=1, vocab_size=384) == 384
    with pytest.raises(UserError) as e:
        limits.check_row_width(16385, 16384, penalties=False)
    assert e.value.param == "logit_bias"
    limits.check_row_width(16384, 16384, penalties=True)


def test_tool_schemas_closed_and_defs_kept_at_root():
    params = {"type": "object", "$defs": {"Unit": {"enum": ["c", "f"]},
                                          "Place": {"type": "object", "properties": {"city": {"type": "string"}}}},
              "properties": {"where": {"$ref": "#/$defs/Place"}, "unit": {"$ref": "#/$defs/Unit"},
                             "next": {"$ref": "#"}}}
    open_fn = {"type": "object", "properties": {"a": {"type": "string"}}}
    spec = ToolCallSpec.build({"weather": (params, None), "loose": (open_fn, False)}, "weather")
    schema = spec.schema()
    text = json.dumps(schema)
    assert '"#/$defs/f0_Place"' in text and '"#/$defs/f0_root"' in text and "#/$defs/Place" not in text
    defs = schema["$defs"]
    assert defs["f0_Place"]["additionalProperties"] is False  # closed: strict unless strict false
    assert defs["f0_root"]["additionalProperties"] is False
    loose = json.loads(dict(spec.functions)["loose"])
    assert "additionalProperties" not in loose
    assert closed_objects({"properties": {"x": {}}, "additionalProperties": True})["additionalProperties"] is True
    with pytest.raises(UserError) as e:
        ToolCallSpec.build({"f": (_deep_object(100), None)})
    assert e.value.param == "tools"


def _deep_object(n: int) -> dict:
    v: dict = {"type": "string"}
    for _ in range(n):
        v = {"type": "object", "properties": {"x": v}}
    return v


@pytest.mark.parametrize("value", [{"a": [1, "x", None, {"b": "é\n"}], "c": True}, [], "s", 1.5,
                                   {"type": "object", "properties": {"p": {"type": "string"}}}])
def test_json_size_floor_is_a_lower_bound(value):
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
    assert limits.json_size_floor(value, 10**9) <= len(canonical)


def test_huge_schema_refused_before_it_is_serialized(monkeypatch):
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 40}
                                            for i in range(60_000)}}
    monkeypatch.setattr(json, "dumps", lambda *a, **k: pytest.fail("serialized"))
    with pytest.raises(UserError) as e:
        StructuredOutputs(json=big)
    assert e.value.param == "structured_outputs.json" and str(limits.MAX_SCHEMA_BYTES) in e.value.message
    with pytest.raises(UserError) as e:
        ToolCallSpec.build({"f": (big, None)})
    assert e.value.param == "tools"
