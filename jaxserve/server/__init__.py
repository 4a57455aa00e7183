"""The OpenAI-compatible HTTP server (`jaxserve serve`).

    app.py           Starlette app, routes, error handlers, `serve()` (uvicorn, SIGTERM drain)
    middleware.py    API key, X-Request-Id, the in-flight count behind /load
    serving.py       /v1/completions, /v1/chat/completions, /invocations: parse, admit, generate
    chat_template.py messages -> prompt ids (request templates only when trusted)
    responses.py     choices, logprobs, usage and SSE chunks in the OpenAI shapes
    async_engine.py  the LLMEngine on its own thread, behind an asyncio interface
    streaming.py     SSE responses and client-disconnect watching
    offload.py       templates and long prompts tokenized off the event loop, with a time bound
    protocol.py      request models (pydantic, strict) -> SamplingParams
    errors.py        OpenAI-shaped errors
    metrics.py       Prometheus metrics (jaxserve: namespace)
    config.py        ServerConfig and the `serve` flags
"""
