"""JSON schemas for the structured-output tests: nested objects, arrays, enums, required fields,
bounded numbers, string patterns. Strings and arrays are bounded so that a random-init model (which
closes a string only by chance) still finishes: the grammar, not the weights, makes them valid."""

from __future__ import annotations

S = {"type": "string", "maxLength": 8}


def obj(props: dict, required: list | None = None) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS = {
    "flat": obj({"name": S, "age": {"type": "integer"}}),
    "bounded_int": obj({"n": {"type": "integer", "minimum": 3, "maximum": 7}}),
    "bounded_number": obj({"x": {"type": "number", "minimum": -1.5, "maximum": 2.5}}),
    "exclusive": obj({"p": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    "enum": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "mixed_enum": obj({"v": {"enum": [1, "two", None, True]}}),
    "const": obj({"kind": {"const": "point"}, "x": {"type": "integer"}}),
    "boolean_null": obj({"ok": {"type": "boolean"}, "nothing": {"type": "null"}}),
    "pattern": obj({"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    "pattern_date": obj({"d": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    "string_len": obj({"code": {"type": "string", "minLength": 3, "maxLength": 5}}),
    "array_of_int": obj({"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                            "maximum": 99}, "maxItems": 4}}),
    "array_bounds": obj({"xs": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2,
                                "maxItems": 3}}),
    "array_of_objects": obj({"pts": {"type": "array", "maxItems": 3, "items": obj(
        {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer",
                                                                      "minimum": 0,
                                                                      "maximum": 9}})}}),
    "nested": obj({"user": obj({"name": S, "address": obj({"city": S, "zip": {
        "type": "string", "pattern": "^[0-9]{5}$"}})})}),
    "deep": obj({"a": obj({"b": obj({"c": obj({"d": {"type": "integer", "maximum": 5}})})})}),
    "optional": obj({"must": {"type": "integer", "maximum": 9}, "maybe": S}, required=["must"]),
    "anyof": obj({"v": {"anyOf": [{"type": "integer", "maximum": 9}, {"enum": ["x", "y"]}]}}),
    "nullable": obj({"v": {"type": ["integer", "null"], "maximum": 100}}),
    "tuple": obj({"pair": {"type": "array", "prefixItems": [{"type": "integer", "maximum": 9},
                                                             {"enum": ["u", "v"]}],
                            "items": False}}),
    "refs": {"$defs": {"pt": obj({"x": {"type": "integer", "maximum": 9}})},
             **obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}})},
    "top_array": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 3},
                  "minItems": 1, "maxItems": 5},
    "top_enum": {"enum": ["yes", "no", "maybe"]},
    "many_fields": obj({f"f{i}": {"type": "integer", "minimum": 0, "maximum": 9}
                        for i in range(12)}),
}
