"""The Starlette app and `jaxserve serve`: routes, API key, errors, start-up and graceful shutdown.

build_app(engine, cfg) -> Starlette     (the engine thread starts and stops with the app's lifespan)
serve(args) -> int                      (the CLI: build the engine, precompile, run uvicorn, drain on SIGTERM)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import signal
import time

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import jaxserve
from jaxserve.args import engine_config
from jaxserve.errors import UserError
from jaxserve.server import protocol as P
from jaxserve.server.heap import FreezeAfterWarmUp, freeze_heap
from jaxserve.server.anthropic_messages import AnthropicMessages
from jaxserve.server.async_engine import AsyncEngine, EngineDeadError
from jaxserve.server.config import ServerConfig, add_serve_args
from jaxserve.server.http_protocol import HeaderTimeoutProtocol
from jaxserve.startup_trace import mark
from jaxserve.worker.profiler import Profiler
from jaxserve.server.errors import (
    APIError,
    bad_request,
    error_response,
    http_error,
    internal_error,
)
from jaxserve.server.kv_events import attach_kv_events
from jaxserve.server.metrics import CONTENT_TYPE, ServerMetrics, cache_config_info
from jaxserve.server.middleware import RERANK_PATHS, SCORE_PATHS, APIKey, InFlight, LoadCounter, RequestId
from jaxserve.server.openai_responses import OpenAIResponses
from jaxserve.server.pooling_api import PoolingAPI
from jaxserve.server.responses_input import ResponseStore
from jaxserve.server.request_checks import parse, served_names
from jaxserve.server.serving import OpenAIServing

log = logging.getLogger("jaxserve.server")

__all__ = ["ServerConfig", "add_serve_args", "build_app", "serve"]


def guarded(endpoint):
    """A bug in a handler: logged with its traceback, a 500 for that request only.

    Caught here, not by Starlette's catch-all handler: that one re-raises after answering, and
    uvicorn then drops the keep-alive connection, under the client's next request.
    """

    @functools.wraps(endpoint)
    async def run(request: Request) -> Response:
        try:
            return await endpoint(request)
        except (UserError, HTTPException, EngineDeadError, ClientDisconnect):
            raise  # answered by the app's exception handlers
        except Exception:
            log.exception("Unhandled error on %s", request.url.path)
            return error_response(internal_error(), request.url.path)

    return run


def build_app(engine, cfg: ServerConfig | None = None, *, tokenizer=None) -> Starlette:
    """An app serving `engine` (an LLMEngine nobody else touches from now on)."""
    from jaxserve.tokenizer import Tokenizer

    cfg = cfg or ServerConfig()
    names = served_names(engine.loaded.name, cfg)
    metrics = ServerMetrics(lambda: aengine.stats, names[0],
                            cache_config_info(engine.config, engine.scheduler.config.num_blocks))
    aengine = AsyncEngine(
        engine, on_output=metrics.observe, on_abort=metrics.aborted, hang_timeout=cfg.hang_timeout
    )
    serving = OpenAIServing(
        engine, aengine, cfg, tokenizer or Tokenizer.from_pretrained(engine.loaded.path)
    )
    anthropic = AnthropicMessages(serving)
    responses = OpenAIResponses(
        serving, ResponseStore(cfg.responses_store_size, cfg.responses_store_ttl)
    )
    pooling = PoolingAPI(serving, engine)
    started = int(time.time())

    def model_card(name: str) -> dict:
        # Only served names: the model's location on this machine is nobody else's business.
        return {
            "id": name,
            "object": "model",
            "created": started,
            "owned_by": "jaxserve",
            "root": names[0],
            "parent": None,
            "max_model_len": serving.max_model_len,
        }

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card(n) for n in names]})

    async def model(request: Request) -> Response:
        return JSONResponse(model_card(serving.check_model(request.path_params["name"])))

    async def health(request: Request) -> Response:
        reason = aengine.health() or ("The server is shutting down." if serving.draining else None)
        if reason is not None:
            return error_response(APIError(503, reason, code="unhealthy"))
        return JSONResponse({"status": "ok"})

    async def load(request: Request) -> Response:
        """vLLM's GET /load: generate requests in flight (streams until their last chunk)."""
        return JSONResponse({"server_load": in_flight.count})

    async def version(request: Request) -> Response:
        return JSONResponse({"version": jaxserve.__version__})

    async def prometheus(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def tokenize(request: Request) -> Response:
        req = await parse(P.TokenizeRequest, await serving.read_body(request))
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("Send exactly one of 'prompt' and 'messages'.", "prompt")
        if req.messages is not None:
            ids = await serving.chat_template.render(
                req.messages, req.add_generation_prompt, req.chat_template_kwargs,
                chat_template=req.chat_template,
            )
        else:
            ids = await serving.encode(
                req.prompt, "prompt", add_special_tokens=req.add_special_tokens
            )
        return JSONResponse(
            {"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len}
        )

    async def detokenize(request: Request) -> Response:
        req = await parse(P.DetokenizeRequest, await serving.read_body(request))
        serving.check_model(req.model)
        serving.check_token_ids(req.tokens, "tokens")
        return JSONResponse({"prompt": serving.tok.decode(req.tokens)})

    async def reset_prefix_cache(request: Request) -> Response:
        """vLLM's POST /reset_prefix_cache: forget cached prefixes no running request holds."""
        freed = await aengine.call(lambda engine: engine.reset_prefix_cache())
        return JSONResponse({"freed_blocks": freed})

    profiler = Profiler(cfg.profiler_dir) if cfg.profiler_dir else None

    async def profile(request: Request) -> Response:
        """vLLM's POST /start_profile and /stop_profile: a jax trace of the steps in between."""
        if profiler is None:
            raise UserError("Profiling is off: start the server with --profiler-dir DIR.", param="profiler_dir")
        start = request.url.path == "/start_profile"
        await aengine.call(lambda engine: profiler.start() if start else profiler.stop())
        return JSONResponse({"status": "started" if start else "stopped"})

    async def on_user_error(request: Request, exc: UserError) -> Response:
        return error_response(exc, request.url.path)

    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(
            http_error(exc.status_code, exc.detail, request.method, request.url.path),
            request.url.path,
        )

    async def on_engine_dead(request: Request, exc: EngineDeadError) -> Response:
        return error_response(APIError(503, str(exc), code="engine_unavailable"), request.url.path)

    async def on_disconnect(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=499)

    async def on_error(request: Request, exc: Exception) -> Response:
        log.exception("Unhandled error on %s", request.url.path)  # outside a route: middleware
        return error_response(internal_error(), request.url.path)

    kv_events = attach_kv_events(engine, cfg.kv_events_config)  # before the engine thread starts

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        aengine.start()
        try:
            yield
        finally:
            await aengine.shutdown()
            if profiler is not None:
                profiler.close()
            if kv_events is not None:
                kv_events.shutdown()

    routes = [
        Route("/v1/completions", guarded(serving.completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(serving.chat), methods=["POST"]),
        Route("/invocations", guarded(serving.invocations), methods=["POST"]),
        Route("/v1/responses", guarded(responses.create), methods=["POST"]),
        Route("/v1/responses/{response_id}", guarded(responses.get), methods=["GET"]),
        Route("/v1/responses/{response_id}", guarded(responses.delete), methods=["DELETE"]),
        Route("/v1/messages", guarded(anthropic.create), methods=["POST"]),
        Route("/v1/messages/count_tokens", guarded(anthropic.count_tokens), methods=["POST"]),
        Route("/v1/embeddings", guarded(pooling.embeddings), methods=["POST"]),
        *(Route(path, guarded(pooling.rerank), methods=["POST"]) for path in RERANK_PATHS),
        *(Route(path, guarded(pooling.score), methods=["POST"]) for path in SCORE_PATHS),
        Route("/load", guarded(load), methods=["GET"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/models/{name:path}", guarded(model), methods=["GET"]),
        Route("/tokenize", guarded(tokenize), methods=["POST"]),
        Route("/detokenize", guarded(detokenize), methods=["POST"]),
        Route("/health", guarded(health), methods=["GET"]),
        Route("/ping", guarded(health), methods=["GET", "POST"]),  # SageMaker's health check, beside /invocations
        Route("/metrics", guarded(prometheus), methods=["GET"]),
        Route("/version", guarded(version), methods=["GET"]),
        Route("/reset_prefix_cache", guarded(reset_prefix_cache), methods=["POST"]),
        Route("/start_profile", guarded(profile), methods=["POST"]),
        Route("/stop_profile", guarded(profile), methods=["POST"]),
    ]
    middleware = []  # outermost first: CORS answers preflights before the key is checked
    if cfg.allowed_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(cfg.allowed_origins),
                allow_methods=list(cfg.allowed_methods),
                allow_headers=list(cfg.allowed_headers),
                allow_credentials=cfg.allow_credentials,
            )
        )
    if cfg.enable_request_id_headers:
        middleware.append(Middleware(RequestId))
    if cfg.api_key:
        middleware.append(Middleware(APIKey, key=cfg.api_key, public_paths=cfg.public_paths))
    in_flight = InFlight()
    middleware.append(Middleware(LoadCounter, in_flight=in_flight))  # innermost: admitted calls only
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=middleware,
        exception_handlers={
            UserError: on_user_error,
            HTTPException: on_http_error,
            EngineDeadError: on_engine_dead,
            ClientDisconnect: on_disconnect,
            Exception: on_error,
        },
    )
    app.state.engine = aengine
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.config = cfg
    return app


async def drain(app: Starlette, timeout: float) -> None:
    """Refuse new work (503), let in-flight requests finish for up to `timeout` s, then abort the rest."""
    serving, aengine = app.state.serving, app.state.engine
    serving.draining = True
    deadline = time.monotonic() + timeout
    while aengine.num_active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if aengine.num_active:
        log.warning("Shutdown timeout: aborting %d unfinished requests", aengine.num_active)
        aengine.abort_all()


# Idle keep-alive connections stay open this long. uvicorn's default (5 s) equals httpx's pool
# expiry (the openai client's), so a client could reuse a pooled connection just as the server
# closed it ("Server disconnected without sending a response"); outliving the client's expiry
# leaves closing idle connections to the client.
KEEP_ALIVE_S = 65
WATCHDOG_S = 1.0  # how often the server checks the engine's health
FATAL_GRACE_S = 2.0  # after the engine died: /health says 503 this long, then the process exits
FATAL_EXIT_CODE = 70  # EX_SOFTWARE: the engine failed; restart the server


class _Server(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains before exiting; a second one exits at once."""

    def __init__(self, config: uvicorn.Config, app: Starlette, url: str, capacity: int):
        super().__init__(config)
        self.app, self.url, self.capacity = app, url, capacity
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self.exit_code = 0

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        mark("listening")
        self._watchdog = asyncio.ensure_future(self._watch_engine())
        if self.started:
            log.info(
                "Ready: %s serving %s on %s (KV cache %d tokens)",
                "jaxserve",
                self.app.state.serving.model_names[0],
                self.url,
                self.capacity,
            )

    async def _watch_engine(self) -> None:
        """A fault that leaves the engine's state unknown (the loop died, a step hangs past
        --hang-timeout) turns /health to 503; a moment later the process exits with
        FATAL_EXIT_CODE so a supervisor restarts it. A request's own bad data never gets here:
        the engine aborts that request alone (output_processor.OutputProcessor.fail)."""
        aengine = self.app.state.engine
        while not self.should_exit:
            await asyncio.sleep(WATCHDOG_S)
            reason = aengine.health()
            if reason is None or self._draining:
                continue
            log.critical("%s: the engine's state is unknown; exiting with code %d in %.0f s so a "
                         "supervisor restarts the server", reason, FATAL_EXIT_CODE, FATAL_GRACE_S)
            self.app.state.serving.draining = True
            await asyncio.sleep(FATAL_GRACE_S)  # /health answers 503 meanwhile, streams get their error
            self.exit_code = FATAL_EXIT_CODE
            self.should_exit = True
            return

    def handle_exit(self, sig: int, frame) -> None:
        if self._loop is None:
            return super().handle_exit(sig, frame)
        if self._draining:  # a second signal: abort everything and exit now
            log.warning("%s again: aborting all requests and exiting now", signal.Signals(sig).name)
            self._loop.call_soon_threadsafe(self.app.state.engine.abort_all)
            self.should_exit = self.force_exit = True
            return
        self._draining = True
        self.app.state.serving.draining = True  # signal handlers run on the loop's (main) thread
        timeout = self.app.state.config.shutdown_timeout
        log.info(
            "%s: draining (up to %.0f s), new requests get 503", signal.Signals(sig).name, timeout
        )

        async def drain_then_exit() -> None:
            await drain(self.app, timeout)
            self.should_exit = True

        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(drain_then_exit()))


def serve(args: argparse.Namespace) -> int:
    from jaxserve.engine import LLMEngine
    from jaxserve.worker.warm_up import warm_up

    cfg = ServerConfig.from_args(args)
    engine = LLMEngine(engine_config(args))
    warm = None
    if args.precompile:
        from jaxserve.progress import compile_progress

        warm = warm_up(engine, compile_progress())  # the other buckets may still compile while serving
    app = build_app(engine, cfg)
    mark("app")
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    url = f"http://{host}:{cfg.port}"
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        lifespan="on",
        timeout_graceful_shutdown=max(cfg.shutdown_timeout, 1.0),
        timeout_keep_alive=KEEP_ALIVE_S,
        http=HeaderTimeoutProtocol,
        access_log=False,
    )
    server = _Server(config, app, url, engine.kv_capacity_tokens)
    freeze_heap()
    app.state.engine.on_idle = FreezeAfterWarmUp(warm)
    try:
        server.run()
    finally:
        if warm is not None:
            warm.stop()
    return server.exit_code
