"""Check a JSON body against an official SDK's own pydantic type: it must validate (no missing or
mistyped field) and carry no field the type does not declare (the SDKs keep extras silently)."""

from __future__ import annotations

import json
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


def sse_events(srv, path: str, body: dict, event_type: Any) -> list[dict]:
    """The raw typed SSE stream of `path`: each event's data, in order, after checking that its
    `type` equals the `event:` line before it and that it is exactly the SDK's `event_type`."""
    out = []
    with srv.http() as h, h.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                exact(event_type, data)
                out.append(data)
    return out


def aborted(srv) -> float:
    """Requests the server counted as aborted (/metrics, jaxserve's own counter)."""
    with srv.http() as h:
        lines = h.get("/metrics").text.splitlines()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith("jaxserve:request_success_total{")
               and 'finished_reason="abort"' in ln)
