"""The single requests that stalled /health (issue 31), for `jaxserve bench health_load --stall-cases`.

Each case is (name, path, body as bytes). They are sent one at a time while the prober in its own
process GETs /health; health_load reports each case's status, wall time and the slowest /health
answer during it (issue 31's bound: 100 ms, on an idle machine).
"""

from __future__ import annotations

import json


def _chain_grammar(n: int) -> str:
    return "\n".join(["start: r0"] + [f'r{i}: r{i + 1} "a"' for i in range(n)] + [f'r{n}: "b"'])


def cases(max_model_len: int) -> list[tuple[str, str, bytes]]:
    long_ids = [100 + (i % 1000) for i in range(max(max_model_len - 8, 1))]
    deep = '{"a":' * 5000 + "1" + "}" * 5000
    big_schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 40}
                                                   for i in range(60_000)}}

    def j(body) -> bytes:
        return json.dumps(body).encode()

    return [
        ("prompt_logprobs, long prompt", "/v1/completions",
         j({"prompt": long_ids, "max_tokens": 1, "prompt_logprobs": 20})),
        ("prompt_logprobs, n=16", "/v1/completions",
         j({"prompt": long_ids, "max_tokens": 1, "n": 16, "temperature": 1, "prompt_logprobs": 20})),
        ("60,001-message chat", "/v1/chat/completions",
         j({"messages": [{"role": "user", "content": "hi"}] * 60_001, "max_tokens": 1})),
        ("100k content parts", "/v1/chat/completions",
         j({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 100_000}],
            "max_tokens": 1})),
        ("4 MB schema", "/v1/completions",
         j({"prompt": "x", "max_tokens": 1, "guided_json": big_schema})),
        ("truncate_prompt_tokens, 4 MB prompt", "/v1/completions",
         j({"prompt": "hello world " * 350_000, "max_tokens": 1, "truncate_prompt_tokens": 16})),
        ("deep /invocations body", "/invocations",
         b'{"prompt": "x", "extra": ' + b"[" * 1_000_000 + b"]" * 1_000_000 + b"}"),
        ("5000-rule Lark grammar", "/v1/completions",
         j({"prompt": "x", "max_tokens": 1, "guided_grammar": _chain_grammar(5000)})),
        ("5000-deep guided_json string", "/v1/completions",
         j({"prompt": "x", "max_tokens": 1, "guided_json": deep})),
        ("5000-deep tool-call arguments", "/v1/chat/completions",
         j({"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}]},
                         {"role": "tool", "tool_call_id": "c", "content": "ok"}], "max_tokens": 1})),
    ]
