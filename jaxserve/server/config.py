"""ServerConfig: the HTTP-side knobs of `jaxserve serve` (engine knobs live in jaxserve.config)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from jaxserve.config import parse_bytes
from jaxserve.errors import UserError
from jaxserve.server.reasoning import REASONING_PARSERS
from jaxserve.server.replicas import add_replica_args
from jaxserve.server.tool_parsers import TOOL_PARSERS

DEFAULT_PUBLIC_PATHS = ("/health", "/ping", "/metrics", "/version", "/load")
ADMIN_PATHS = ("/reset_prefix_cache", "/start_profile", "/stop_profile")  # always need the key when one is set


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    public_paths: tuple[str, ...] = DEFAULT_PUBLIC_PATHS  # reachable without the API key
    served_model_names: tuple[str, ...] = ()  # default: the model's name
    max_queued_requests: int = 1024
    max_body_bytes: int = 8 << 20
    shutdown_timeout: float = 30.0
    hang_timeout: float = 120.0  # /health turns 503 when one engine step runs longer than this
    log_level: str = "info"
    max_seqs_per_request: int = 256  # prompts x n of one request
    trust_request_chat_template: bool = False  # let requests send their own Jinja template
    render_timeout: float = 5.0  # seconds one chat template render or tokenization may take
    allowed_origins: tuple[str, ...] = ()  # CORS; () sends no CORS headers
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    enable_request_id_headers: bool = False  # echo X-Request-Id, or make one
    tool_call_parser: str | None = None  # how tool_choice "auto" reads calls (tool_parsers.py)
    reasoning_parser: str | None = None  # splits <think> blocks into reasoning_content
    responses_store_size: int = 1024  # /v1/responses kept for previous_response_id and GET
    responses_store_ttl: float = 3600.0  # seconds a stored response is kept
    kv_events_config: str | None = None  # vLLM's JSON: publish KV events over ZMQ (kv_events.py)
    profiler_dir: str | None = None  # POST /start_profile, /stop_profile write jax traces here (off: None)

    def __post_init__(self) -> None:
        for name, known in (
            ("tool_call_parser", TOOL_PARSERS),
            ("reasoning_parser", REASONING_PARSERS),
        ):
            v = getattr(self, name)
            if v is not None and v not in known:
                raise UserError(
                    f"Invalid {name}={v!r}: choose one of {', '.join(sorted(known))}.", param=name
                )
        for name in ("max_queued_requests", "max_body_bytes", "max_seqs_per_request"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise UserError(f"Invalid {name}={v!r}: must be an integer >= 1.", param=name)
        for name in ("shutdown_timeout", "hang_timeout"):
            if getattr(self, name) < 0:
                raise UserError(
                    f"Invalid {name}={getattr(self, name)!r}: must be >= 0 seconds.", param=name
                )
        if not isinstance(self.responses_store_size, int) or self.responses_store_size < 0:
            raise UserError(
                f"Invalid responses_store_size={self.responses_store_size!r}: must be an integer "
                ">= 0 (0 stores none).",
                param="responses_store_size",
            )
        if not self.responses_store_ttl > 0:
            raise UserError(
                f"Invalid responses_store_ttl={self.responses_store_ttl!r}: must be > 0 seconds.",
                param="responses_store_ttl",
            )
        if not self.render_timeout > 0:
            raise UserError(
                f"Invalid render_timeout={self.render_timeout!r}: must be > 0 seconds.",
                param="render_timeout",
            )
        if not 0 <= self.port < 65536:
            raise UserError(f"Invalid port={self.port}: must be in 0..65535.", param="port")
        if self.api_key is not None and not self.api_key:
            raise UserError(
                "Invalid api_key='': give a non-empty key, or none to serve without one.",
                param="api_key",
            )
        if self.profiler_dir is not None:  # checked now, not when the first trace is written
            try:
                os.makedirs(self.profiler_dir, exist_ok=True)
                writable = os.access(self.profiler_dir, os.W_OK | os.X_OK)
            except OSError as e:
                writable, why = False, e.strerror
            else:
                why = "not writable by this server"
            if not writable:
                raise UserError(f"Invalid profiler_dir={self.profiler_dir!r}: {why}; give a directory this "
                                "server can write.", param="profiler_dir")
        admin = sorted(set(self.public_paths) & set(ADMIN_PATHS))
        if admin:
            raise UserError(
                f"Invalid public_paths: {', '.join(admin)} is an admin route and always needs "
                "the API key; remove it from --public-paths.",
                param="public_paths",
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        """The config `add_serve_args`' options parsed into `args` say (each field from its option)."""
        values = {}
        for name, _flag, _kw in OPTIONS:
            v = getattr(args, name)
            values[name] = tuple(v or ()) if isinstance(getattr(cls, name), tuple) else v
        values["public_paths"] = tuple(p for p in (args.public_paths or "").split(",") if p)
        values["api_key"] = args.api_key or os.environ.get("JAXSERVE_API_KEY") or None
        return cls(**values)


# Each ServerConfig field's command-line option: (field, flag, argparse keywords). The default is
# the field's (a tuple default becomes a list of values) unless the keywords give one.
OPTIONS = (
    ("host", "--host", dict(help="address to bind (default %(default)s: this machine only)")),
    ("port", "--port", dict(type=int, help="port (default %(default)s)")),
    ("api_key", "--api-key",
     dict(help="require 'Authorization: Bearer KEY' (default: $JAXSERVE_API_KEY, else no key)")),
    ("public_paths", "--public-paths",
     dict(default=",".join(DEFAULT_PUBLIC_PATHS),
          help="comma-separated paths open without the key (default /health,/ping,/metrics,/version,/load; "
          "'' protects all; admin routes such as /reset_prefix_cache always need it)")),
    ("served_model_names", "--served-model-name",
     dict(nargs="+", default=None, metavar="NAME", help="model name(s) clients send (default: the model's name)")),
    ("max_queued_requests", "--max-queued-requests",
     dict(type=int, help="answer 429 when more requests than this wait for a first step (default %(default)s)")),
    ("max_body_bytes", "--max-body-bytes",
     dict(type=parse_bytes, help="answer 413 for request bodies larger than this (default 8MiB)")),
    ("shutdown_timeout", "--shutdown-timeout",
     dict(type=float,
          help="on SIGTERM, seconds to let in-flight requests finish before aborting them (default %(default)s)")),
    ("hang_timeout", "--hang-timeout",
     dict(type=float, help="/health answers 503 if one engine step runs longer than this (default %(default)s s)")),
    ("log_level", "--log-level",
     dict(choices=("critical", "error", "warning", "info", "debug"), help="uvicorn log level (default info)")),
    ("max_seqs_per_request", "--max-seqs-per-request",
     dict(type=int,
          help="answer 400 when one request asks for more sequences (prompts x n) (default %(default)s)")),
    ("trust_request_chat_template", "--trust-request-chat-template",
     dict(action="store_true", help="let requests send their own chat template ('chat_template'); off by "
          "default: a template is a program that runs on the server")),
    ("render_timeout", "--render-timeout",
     dict(type=float, help="answer 400 when rendering a chat template or tokenizing a prompt takes longer "
          "(default %(default)s s)")),
    ("allowed_origins", "--allowed-origins",
     dict(nargs="*", default=None, help="CORS: origins browsers may call from, e.g. '*' or "
          "https://example.com (default: none, no CORS headers)")),
    ("allowed_methods", "--allowed-methods", dict(nargs="*", help="CORS: allowed methods (default *)")),
    ("allowed_headers", "--allowed-headers", dict(nargs="*", help="CORS: allowed headers (default *)")),
    ("allow_credentials", "--allow-credentials",
     dict(action="store_true", help="CORS: allow credentials (default off)")),
    ("enable_request_id_headers", "--enable-request-id-headers",
     dict(action="store_true", help="answer with an X-Request-Id header: the client's, or a new one")),
    ("tool_call_parser", "--tool-call-parser",
     dict(choices=sorted(TOOL_PARSERS), help="the model's tool-call format, read for tool_choice 'auto' "
          "(default: none; 'auto' is then a 400, 'required' and named functions still work)")),
    ("reasoning_parser", "--reasoning-parser",
     dict(choices=sorted(REASONING_PARSERS), help="put <think>...</think> in reasoning_content (qwen3: "
          "when the answer opens with <think>; deepseek_r1: the prompt opened it) (default: off)")),
    ("responses_store_size", "--responses-store-size",
     dict(type=int, help="/v1/responses answers kept in memory for previous_response_id and GET "
          "/v1/responses/{id}; the oldest go first (default %(default)s; 0 keeps none)")),
    ("responses_store_ttl", "--responses-store-ttl",
     dict(type=float, help="seconds a stored /v1/responses answer is kept (default %(default)s)")),
    ("kv_events_config", "--kv-events-config",
     dict(help="vLLM's KV-event publisher as JSON, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": "
          "\"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": "
          "\"kv-events\"}' (BlockStored/BlockRemoved/AllBlocksCleared for prefix-aware routers; "
          "needs jaxserve[kv-events])")),
    ("profiler_dir", "--profiler-dir",
     dict(metavar="DIR", help="turn on POST /start_profile and /stop_profile (admin routes): a jax profiler "
          "trace of the steps between them, written under DIR/plugins/profile/ for TensorBoard or XProf, "
          "and as trace.json.gz for Perfetto (default: off)")),
)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    for name, flag, kw in OPTIONS:
        default = getattr(ServerConfig, name)
        if "action" not in kw:
            kw = {"default": list(default) if isinstance(default, tuple) else default, **kw}
        g.add_argument(flag, dest=name, **kw)
    add_replica_args(p.add_argument_group("replicas (data parallel)"))
