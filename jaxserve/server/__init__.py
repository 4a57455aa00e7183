"""The OpenAI-compatible HTTP server (`jaxserve serve`).

    app.py           Starlette app, routes, API key, `serve()` (uvicorn, SIGTERM drain)
    serving.py       /v1/completions, /v1/chat/completions, /invocations: parse, admit, generate
    responses.py     choices, logprobs, usage and SSE chunks in the OpenAI shapes
    async_engine.py  the LLMEngine on its own thread, behind an asyncio interface
    streaming.py     SSE responses and client-disconnect watching
    offload.py       templates and long prompts tokenized off the event loop, with a time bound
    protocol.py      request models (pydantic, strict) -> SamplingParams
    errors.py        OpenAI-shaped errors
    metrics.py       Prometheus metrics (jaxserve: namespace)
    config.py        ServerConfig and the `serve` flags
"""
