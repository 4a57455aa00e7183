"""Check a JSON body against an official SDK's own pydantic type: it must validate (no missing or
mistyped field) and carry no field the type does not declare (the SDKs keep extras silently)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, TypeAdapter


def extras(obj: Any, where: str = "") -> list[str]:
    """Paths of the fields no declared type holds, anywhere inside `obj`."""
    out: list[str] = []
    if isinstance(obj, BaseModel):
        out += [f"{where}.{k}" for k in (obj.model_extra or {})]
        for name in type(obj).model_fields:
            out += extras(getattr(obj, name), f"{where}.{name}")
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            out += extras(x, f"{where}[{i}]")
    elif isinstance(obj, dict):
        for k, x in obj.items():
            out += extras(x, f"{where}.{k}")
    return out


def exact(type_: Any, data: dict) -> Any:
    """`data` as `type_` (a model or a union), which must hold every field it has."""
    value = TypeAdapter(type_).validate_python(data)
    assert value is not None
    bad = extras(value)
    assert not bad, f"fields {type_} does not declare: {bad}"
    return value
