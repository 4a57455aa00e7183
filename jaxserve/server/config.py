"""ServerConfig: the HTTP-side knobs of `jaxserve serve` (engine knobs live in jaxserve.config)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from jaxserve.config import parse_bytes
from jaxserve.errors import UserError
from jaxserve.server.reasoning import REASONING_PARSERS
from jaxserve.server.tool_parsers import TOOL_PARSERS

DEFAULT_PUBLIC_PATHS = ("/health", "/metrics", "/version")


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
    tool_call_parser: str | None = None  # how tool_choice "auto" reads calls (tool_parsers.py)
    reasoning_parser: str | None = None  # splits <think> blocks into reasoning_content

    def __post_init__(self) -> None:
        for name, known in (("tool_call_parser", TOOL_PARSERS),
                            ("reasoning_parser", REASONING_PARSERS)):
            v = getattr(self, name)
            if v is not None and v not in known:
                raise UserError(f"Invalid {name}={v!r}: choose one of {', '.join(sorted(known))}.",
                                param=name)
        for name in ("max_queued_requests", "max_body_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Invalid {name}={v!r}: must be an integer >= 1.")
        for name in ("shutdown_timeout", "hang_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"Invalid {name}={getattr(self, name)!r}: must be >= 0 seconds.")
        if not 0 <= self.port < 65536:
            raise ValueError(f"Invalid port={self.port}: must be in 0..65535.")
        if self.api_key is not None and not self.api_key:
            raise ValueError(
                "Invalid api_key='': give a non-empty key, or none to serve without one."
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        public = tuple(p for p in (args.public_paths or "").split(",") if p)
        return cls(
            host=args.host,
            port=args.port,
            api_key=args.api_key or os.environ.get("JAXSERVE_API_KEY") or None,
            public_paths=public,
            served_model_names=tuple(args.served_model_name or ()),
            max_queued_requests=args.max_queued_requests,
            max_body_bytes=args.max_body_bytes,
            shutdown_timeout=args.shutdown_timeout,
            hang_timeout=args.hang_timeout,
            log_level=args.log_level,
            tool_call_parser=getattr(args, "tool_call_parser", None),
            reasoning_parser=getattr(args, "reasoning_parser", None),
        )


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    g.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (default: $JAXSERVE_API_KEY, else no key)",
    )
    g.add_argument(
        "--public-paths",
        default=",".join(DEFAULT_PUBLIC_PATHS),
        help="comma-separated paths open without the key (default /health,/metrics,/version; "
        "'' protects all)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients send (default: the model's name)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="answer 429 when more requests than this wait for a first step (default 1024)",
    )
    g.add_argument(
        "--max-body-bytes",
        type=parse_bytes,
        default=8 << 20,
        help="answer 413 for request bodies larger than this (default 8MiB)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish before aborting them (default 30)",
    )
    g.add_argument(
        "--hang-timeout",
        type=float,
        default=120.0,
        help="/health answers 503 if one engine step runs longer than this (default 120 s)",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn log level (default info)",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="the model's tool-call format, read for tool_choice 'auto' (default: none; "
        "'auto' is then a 400, 'required' and named functions still work)",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="put <think>...</think> in reasoning_content (qwen3: when the answer opens with "
        "<think>; deepseek_r1: the prompt opened it) (default: off)",
    )
