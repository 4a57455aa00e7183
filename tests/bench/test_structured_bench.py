"""bench/structured.py: its schema and instance agree, and the llguidance walk runs on a tiny
tokenizer (no timing asserts)."""

from __future__ import annotations

import json

import jsonschema

from bench.structured import big_schema, run_llguidance


def test_big_schema_instance_is_valid_and_walkable():
    from tests.tiny_models import build_tokenizer

    schema, inst = big_schema(15)
    assert len(schema["properties"]) == 15
    jsonschema.validate(inst, schema)
    hf = build_tokenizer()
    tokens = hf.encode(json.dumps(inst, separators=(",", ":")), add_special_tokens=False)
    r = run_llguidance(hf, len(hf), schema, tokens)  # asserts every token is accepted
    assert r["batch32_fill_us"]["max"] >= r["batch32_fill_us"]["p50"] > 0
