"""The `jaxserve` command: generate, serve, bench, convert, lower.

Every error a user can cause (a `UserError`) ends in one line on stderr (`jaxserve: error: ...`) and
exit code 2; any other exception is a bug and shows its traceback. The engine flags are generated
from `EngineConfig`'s fields.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from jaxserve.args import add_engine_args, apply_config_file, bytes_arg, engine_config
from jaxserve.config import EngineConfig
from jaxserve.errors import UserError
from jaxserve.startup_trace import mark


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that points at --help."""

    def error(self, message: str):
        self.exit(2, f"jaxserve: error: {message} (see `{self.prog} --help`)\n")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    g.add_argument("--temperature", "-t", type=float, default=None,
                   help="0 = greedy (default: the model's generation config, else 0)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None, help="sampling seed: same seed, same output")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace, defaults: dict):
    from jaxserve.sampling_params import SamplingParams

    kw = {"temperature": 0.0, **defaults}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    return SamplingParams(max_tokens=args.max_tokens, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, **kw)


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxserve.tokenizer import import_in_background

    import_in_background()
    from jaxserve.engine import LLMEngine

    prompts = args.prompt or ([sys.stdin.read()] if not sys.stdin.isatty() else [])
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise UserError('No prompt given: pass it as an argument (jaxserve generate "Hello") or on stdin.')
    stream = sys.stdout.isatty() if args.stream is None else args.stream
    engine = LLMEngine(engine_config(args, precompile=False), kv_for_sequences=1)  # one prompt at a time
    params = sampling_params(args, engine.loaded.generation_defaults)
    tok = engine.tokenizer
    for i, prompt in enumerate(prompts):
        if args.raw or not tok.has_chat_template:
            ids = tok.encode(prompt)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            ids = tok.apply_chat_template(messages + [{"role": "user", "content": prompt}])
        engine.add_request(str(i), prompt, params, prompt_token_ids=ids)
        text = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                delta = out.outputs[0].delta_text
                if delta and not text:
                    mark("first token")
                text += delta
                if stream and delta:
                    sys.stdout.write(delta)
                    sys.stdout.flush()
        if stream:
            sys.stdout.write("\n")
        else:
            print(text)
        if len(prompts) > 1 and i < len(prompts) - 1:
            print()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    name = args.name.replace("-", "_")
    try:
        mod = importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"bench.{name}":
            raise
        raise UserError(f"Unknown benchmark {args.name!r}: see `jaxserve bench --help`.") from None
    return int(mod.main(args.bench_args) or 0)


def cmd_serve(args: argparse.Namespace) -> int:
    from jaxserve.tokenizer import import_in_background

    import_in_background()
    from jaxserve.server.app import serve

    if getattr(args, "data_parallel_size", 1) > 1 or getattr(args, "router", "auto") != "auto":
        from jaxserve.server.replicas import run_replicas

        return run_replicas(args, args.argv)

    return serve(args)


def cmd_convert(args: argparse.Namespace) -> int:
    from jaxserve.convert import convert

    return convert(args)


# The engine settings that shape the lowered steps and the memory plan.
LOWER_FIELDS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "gpu_memory_utilization",
                "attention_backend", "dtype", "kv_cache_dtype", "tensor_parallel_size", "quantization",
                "enable_expert_parallel")


def cmd_lower(args: argparse.Namespace) -> int:
    from jaxserve.worker.lower import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="jaxserve",
        description="LLM inference and serving on JAX: paged KV cache, prefix caching, continuous batching.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    g = sub.add_parser("generate", help="generate text for prompts (chat template applied unless --raw)",
                       description="Generate a completion for each prompt. For a chat model the prompt is sent "
                       "as a user message through the model's chat template.")
    g.add_argument("prompt", nargs="*", help="prompt text (or read from stdin)")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--system", default=None, help="system message for chat models")
    s = g.add_mutually_exclusive_group()
    s.add_argument("--stream", dest="stream", action="store_true", default=None, help="print tokens as they come "
                   "(default on a terminal)")
    s.add_argument("--no-stream", dest="stream", action="store_false", help="print the whole answer at the end")
    add_sampling_args(g)
    add_engine_args(g, skip=("seed",))  # --seed is the sampling seed here
    g.set_defaults(func=cmd_generate, command_parser=g)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    sv.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                    help="HF model directory or .gguf file (same as --model)")
    try:
        from jaxserve.server.app import add_serve_args

        add_serve_args(sv)
    except ImportError:
        pass
    add_engine_args(sv)
    sv.set_defaults(func=cmd_serve, command_parser=sv)

    b = sub.add_parser("bench", help="benchmarks: sim, offline, serve, roofline, ... (code in bench/)")
    b.add_argument("name", help="benchmark name, e.g. sim")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for the benchmark (see its --help)")
    b.set_defaults(func=cmd_bench)

    lw = sub.add_parser("lower", help="lower every step for a GPU or TPU from a model config: no device, no weights",
                        description="Export the engine's whole step (forward, attention kernels, sampler) for every "
                        "bucket with jax.export for --platform, from the model's config.json alone (weights are "
                        "shapes), on an abstract mesh of --tensor-parallel-size devices; print the memory plan "
                        "for --device-memory. With --compile the target's own compiler then runs here too.")
    lw.add_argument("--platform", required=True, choices=("cuda", "tpu"), help="the target platform")
    lw.add_argument("--model", "-m", required=True, metavar="CONFIG",
                    help="HF model directory (its config.json is read) or a config.json file")
    lw.add_argument("--device-memory", type=bytes_arg, default=None, metavar="BYTES",
                    help="memory per device, e.g. 141GiB (default: 80GiB on cuda, 16GiB on tpu)")
    lw.add_argument("--compute-capability", default="9.0", metavar="X.Y",
                    help="the GPU's compute capability; below 9.0 the portable xla attention is lowered "
                    "(default: 9.0)")
    lw.add_argument("--compile", action="store_true",
                    help="also compile every bucket with the target's own compiler on this host (XLA:GPU "
                    "deviceless with ptxas, or libtpu compile-only): needs jaxserve[compile-cuda] or "
                    "jaxserve[compile-tpu]")
    lw.add_argument("--target", default=None, metavar="NAME",
                    help="with --compile: h100, h200, b200 or a GpuTargetConfigProto file (cuda; default h100), "
                    "v5e, v6e, v5p or v7x (tpu; default v5e)")
    lw.add_argument("--buckets", choices=("all", "largest"), default="all",
                    help="with --compile: every bucket, or the largest mixed and decode buckets")
    lw.add_argument("--num-layers", type=int, default=None, metavar="N",
                    help="with --compile: compile N layers instead of the model's count (same shapes; one layer "
                    "of each kind first: MoE/dense, sliding/global); the memory plan stays the whole model's")
    lw.add_argument("--json", default=None, metavar="PATH", help="with --compile: write the figures as JSON")
    add_engine_args(lw, skip=tuple(n for n in EngineConfig.field_names() if n not in LOWER_FIELDS))
    lw.set_defaults(func=cmd_lower, command_parser=lw)

    c = sub.add_parser("convert", help="convert an HF directory or GGUF file to an Orbax checkpoint")
    c.add_argument("src")
    c.add_argument("dst")
    c.set_defaults(func=cmd_convert)
    return p


def main(argv: list[str] | None = None) -> int:
    mark("cli")  # the interpreter and the CLI's imports
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # `serve --data-parallel-size N` hands them on to its replicas
    verbose = getattr(args, "verbose", False) or args.command == "serve"
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        if getattr(args, "config", None):
            apply_config_file(args, args.command_parser, argv)
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from jaxserve.model.default_model import DefaultModelError

        if isinstance(e, (UserError, DefaultModelError)):  # anything else is a bug: its traceback shows
            print(f"jaxserve: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
