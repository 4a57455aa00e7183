"""Structured outputs through a real server and the openai client: response_format, vLLM's
structured_outputs, the guided_* fields. Validation runs now; the output checks need the engine
to apply grammars (skipped until it does), on a random-init model (the grammar alone must make the
output valid) and on the default model (slow)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from tests.server.agent_models import ENGINE_SUPPORTS_STRUCTURED, NEEDS_ENGINE
from tests.server.conftest import ServerThread
from tests.server.schemas import SCHEMAS

needs_engine = pytest.mark.skipif(not ENGINE_SUPPORTS_STRUCTURED, reason=NEEDS_ENGINE)
MSG = [{"role": "user", "content": "Describe a person as JSON."}]


def rf(schema: dict, name: str = "out") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# ---- validation (runs now) -----------------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"response_format": rf({"type": "nope"})}, "response_format.json_schema.schema"),
    ({"response_format": rf({"$ref": "#/$defs/missing"})}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {},
                                                                 "extra": 1}}},
     "response_format.json_schema.extra"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_regex": "[unclosed"}, "guided_regex"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "wrong"}}}}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=server.model, messages=MSG, max_tokens=2,
                                                extra_body=body)
    assert e.value.body["param"] == param, e.value.body


def test_bad_constraints_on_completions_too(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=server.model, prompt="x", max_tokens=2,
                                           extra_body={"guided_regex": "(("})
    assert e.value.body["param"] == "guided_regex"


@needs_engine
def test_grammar_errors_say_what_is_wrong(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model=server.model, messages=MSG, max_tokens=2,
            extra_body={"structured_outputs": {"grammar": "start: nothing_here"}})
    assert "nothing_here" in e.value.body["message"]


def test_text_format_is_unconstrained(server):
    r = server.client().chat.completions.create(model=server.model, messages=MSG, max_tokens=3,
                                                response_format={"type": "text"})
    assert r.choices[0].finish_reason in ("stop", "length")


# ---- output (needs the engine's wiring) ---------------------------------------------------------
def _valid(text: str, schema: dict):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@needs_engine
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_output_validates_random_model(server, name):
    schema = SCHEMAS[name]
    r = server.client().chat.completions.create(
        model=server.model, messages=MSG, max_tokens=150, temperature=1.0, seed=7,
        response_format=rf(schema, name))
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    _valid(c.message.content, schema)


@needs_engine
def test_structured_outputs_and_guided_on_completions(server):
    schema = SCHEMAS["nested"]
    for extra in ({"structured_outputs": {"json": schema}}, {"guided_json": schema},
                  {"guided_json": json.dumps(schema)}):
        r = server.client().completions.create(model=server.model, prompt="JSON:", max_tokens=150,
                                               n=2, seed=3, extra_body=extra)
        for c in r.choices:
            assert c.finish_reason == "stop"
            _valid(c.text, schema)


@needs_engine
def test_json_object(server):
    r = server.client().chat.completions.create(
        model=server.model, messages=MSG, max_tokens=150, temperature=0.8, seed=1,
        response_format={"type": "json_object"})
    c = r.choices[0]
    if c.finish_reason == "stop":  # a free object may be long: if it ends, it is an object
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.message.content.startswith("{")


@needs_engine
def test_regex_choice_and_grammars(server):
    client = server.client()
    regex = r"[A-Z][a-z]{2,5} [0-9]{2}"
    for extra in ({"structured_outputs": {"regex": regex}}, {"guided_regex": regex}):
        r = client.chat.completions.create(model=server.model, messages=MSG, max_tokens=20, n=3,
                                           seed=2, extra_body=extra)
        for c in r.choices:
            assert re.fullmatch(regex, c.message.content), c.message.content
    choices = ["alpha", "beta", "gamma delta"]
    r = client.chat.completions.create(model=server.model, messages=MSG, max_tokens=20, n=4,
                                       extra_body={"guided_choice": choices})
    assert all(c.message.content in choices for c in r.choices)
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
    gbnf = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9] [0-9]?'
    for g in (lark, gbnf):
        r = client.completions.create(model=server.model, prompt="Tuple:", max_tokens=40,
                                      extra_body={"structured_outputs": {"grammar": g}})
        out = r.choices[0].text
        assert r.choices[0].finish_reason == "stop" and re.fullmatch(r"\(\d+(,\d+)*\)", out), out


@needs_engine
def test_seeded_and_streamed_constrained_output(server):
    schema = SCHEMAS["array_of_objects"]
    kw = {"model": server.model, "messages": MSG, "max_tokens": 150, "seed": 11,
          "temperature": 1.0, "response_format": rf(schema)}
    a = server.client().chat.completions.create(**kw).choices[0].message.content
    b = server.client().chat.completions.create(**kw).choices[0].message.content
    assert a == b
    _valid(a, schema)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       server.client().chat.completions.create(stream=True, **kw) if ch.choices)
    assert streamed == a
    unconstrained = server.client().chat.completions.create(**{**kw, "response_format": None})
    assert unconstrained.choices[0].message.content != a  # the grammar changed the answer


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    tags: list[str] = pydantic.Field(max_length=2)


@needs_engine
def test_parse_with_pydantic_random_model(server):
    r = server.client().chat.completions.parse(model=server.model, messages=MSG, max_tokens=150,
                                               response_format=Person, seed=5)
    p = r.choices[0].message.parsed
    assert isinstance(p, Person) and 0 <= p.age <= 120


# ---- the default model (slow) -------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_server():
    from jaxserve.model.default_model import default_model_path

    # compiled on demand: these requests meet a few buckets of the default model's many
    s = ServerThread(default_model_path(download=False), {"max_model_len": 1024, "num_blocks": 512},
                     precompile=False)
    yield s
    s.stop()


@needs_engine
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_output_validates_default_model(default_server, name):
    s = default_server
    r = s.client().chat.completions.create(model=s.model, messages=MSG, max_tokens=200,
                                           temperature=0, response_format=rf(SCHEMAS[name], name))
    assert r.choices[0].finish_reason == "stop"
    _valid(r.choices[0].message.content, SCHEMAS[name])


@needs_engine
@pytest.mark.slow
def test_parse_with_pydantic_default_model(default_server):
    s = default_server
    r = s.client().chat.completions.parse(
        model=s.model, max_tokens=200, temperature=0, response_format=Person,
        messages=[{"role": "user", "content": "Give me a person named Ann, aged 30, as JSON."}])
    p = r.choices[0].message.parsed
    assert isinstance(p, Person)
