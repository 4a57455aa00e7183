"""A tiny random-init model whose tokenizer carries a tool-capable chat template (the fixture in
tests/fixtures/tool_chat_template.jinja), and what the structured/tool server tests share."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TEMPLATE = Path(__file__).parent.parent / "fixtures" / "tool_chat_template.jinja"

# True once the engine applies grammars (the lead's wiring); the end-to-end tests run then.
try:
    from jaxserve.engine import LLMEngine

    ENGINE_SUPPORTS_STRUCTURED = hasattr(LLMEngine, "supports_structured_outputs")
except ImportError:  # pragma: no cover
    ENGINE_SUPPORTS_STRUCTURED = False
NEEDS_ENGINE = "the engine does not apply structured-output grammars yet"

# a longer context than the default test server: tool schemas are long in a 384-token vocabulary
AGENT_ENGINE = {"max_model_len": 2048, "num_blocks": 1024, "max_num_batched_tokens": 256}


def with_tool_template(model_dir: str, dst: Path) -> str:
    """A copy of `model_dir` whose chat template is the tool-capable fixture."""
    dst = Path(dst)
    if not (dst / "config.json").exists():
        shutil.copytree(model_dir, dst, dirs_exist_ok=True)
        cfg_path = dst / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.pop("chat_template", None)
        cfg_path.write_text(json.dumps(cfg))
        (dst / "chat_template.jinja").write_text(TEMPLATE.read_text())
    return str(dst)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"offset": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["offset"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
NOTE = {  # a long argument: its text streams in many pieces
    "type": "function",
    "function": {
        "name": "take_note",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 40, "maxLength": 60}},
            "required": ["text"],
            "additionalProperties": False,
        },
    },
}
