"""An SSE event is one `data:` line whatever text the model wrote: characters that splitlines-based
clients (httpx's aiter_lines) take as line ends are escaped, and the JSON still decodes to them."""

import json

from jaxserve.server.streaming import sse


def test_model_text_never_splits_an_event():
    text = "a\u2028b\u2029c\x85d\x0be\x1cf\r\ng é 😀"
    event = sse({"choices": [{"text": text}]}).decode()
    assert event.endswith("\n\n") and event.startswith("data: ")
    line = event[: -2]
    assert line.splitlines() == [line]
    assert json.loads(line[6:])["choices"][0]["text"] == text
    assert "é 😀" in line  # other characters stay as UTF-8, not escaped
