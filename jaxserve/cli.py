"""The `jaxserve` command: generate, serve, bench, convert.

Every error a user can cause ends in one line on stderr (`jaxserve: error: ...`) and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from jaxserve.config import ADMISSIONS, ATTENTION_BACKENDS, DTYPES, EVICTIONS, PREFIX_CACHES, SCHEDULES, EngineConfig, parse_bytes

USER_ERRORS = (ValueError, FileNotFoundError, KeyError)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that points at --help."""

    def error(self, message: str):
        self.exit(2, f"jaxserve: error: {message} (see `{self.prog} --help`)\n")


def _bytes_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", "-m", default=None,
                   help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step (default 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step (default 512)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    g.add_argument("--kv-cache-memory", type=_bytes_arg, default=None,
                   help="KV cache budget, e.g. 2GiB (default: --memory-fraction of free device memory; 1GiB max on CPU)")
    g.add_argument("--memory-fraction", type=float, default=0.9, help="fraction of free device memory for the KV cache")
    g.add_argument("--prefix-cache", choices=PREFIX_CACHES, default="radix", help="prefix cache design (default radix)")
    g.add_argument("--eviction", choices=EVICTIONS, default="lru", help="prefix cache eviction policy (default lru)")
    g.add_argument("--schedule", choices=SCHEDULES, default="fcfs", help="admission order (default fcfs)")
    order = g.add_mutually_exclusive_group()
    order.add_argument("--prefill-first", dest="prefill_first", action="store_true", help="admit new prompts before decodes")
    order.add_argument("--decode-first", dest="prefill_first", action="store_false", help="running requests first (default)")
    g.add_argument("--admission", choices=ADMISSIONS, default="optimistic",
                   help="optimistic (vLLM, default): admit while the prompt fits; conservative (SGLang): also "
                        "reserve blocks for running requests' expected output, fewer preemptions")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None,
                   help="default: pallas on TPU/GPU; on CPU the native cpu kernels (attention, and for float32 "
                        "the matmul; built with g++), else xla")
    g.add_argument("--dtype", choices=DTYPES, default=None, help="default: float32 on CPU, bfloat16 on TPU/GPU")
    g.add_argument("--kv-cache-dtype", choices=DTYPES, default=None,
                   help="KV cache storage (default: --dtype, but bfloat16 for a bfloat16 or quantized checkpoint run "
                        "in float32, e.g. the default model); bfloat16 halves KV memory, attention still in float32")
    g.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, help="shard the model over N devices")
    g.add_argument("--no-precompile", dest="precompile", action="store_false",
                   help="compile step shapes on first use instead of at start-up")
    g.add_argument("--verbose", "-v", action="store_true", help="log engine details to stderr")
    g.add_argument("--config", default=None, metavar="YAML",
                   help="read flag values from a YAML file (keys are flag names, e.g. max-num-seqs: 32); "
                   "flags given on the command line win. Presets: configs/")


def apply_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Fill in values from `--config FILE` for every flag the command line did not set."""
    import yaml

    path = getattr(args, "config", None)
    if not path:
        return
    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise FileNotFoundError(f"Config file {path!r} does not exist.") from None
    except yaml.YAMLError as e:
        raise ValueError(f"Config file {path!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(values, dict):
        raise ValueError(f"Config file {path!r} must be a mapping of flag names to values.")
    given = {a.split("=", 1)[0] for a in argv if a.startswith("-")}
    flags = {}
    for action in parser._actions:
        for opt in action.option_strings:
            if opt.startswith("--"):
                flags[opt[2:]] = action
    for key, value in values.items():
        name = str(key).replace("_", "-")
        action = flags.get(name)
        if action is None or name in ("config", "help"):
            raise ValueError(f"Unknown key {key!r} in config file {path!r}: use flag names of "
                             f"`jaxserve {args.command} --help`, e.g. max-num-seqs.")
        if any(opt in given for opt in action.option_strings):
            continue
        try:
            if action.nargs == 0:  # a switch (store_true / store_false): `true` means the flag is given
                if not isinstance(value, bool):
                    raise ValueError("expected true or false")
                value = action.const if value else not action.const
            elif isinstance(value, str) and action.type not in (None, str):
                value = action.type(value)  # e.g. "1GiB" -> bytes
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            raise ValueError(f"Invalid value {value!r} for {key!r} in config file {path!r}: {e}") from None
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"Invalid value {value!r} for {key!r} in config file {path!r}: "
                             f"choose one of {', '.join(map(str, action.choices))}.")
        setattr(args, action.dest, value)


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    kw = {k: getattr(args, k) for k in EngineConfig.field_names() if hasattr(args, k)}
    kw.update(overrides)
    return EngineConfig(**kw)


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
    from jaxserve.engine import LLMEngine

    prompts = args.prompt or ([sys.stdin.read()] if not sys.stdin.isatty() else [])
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise ValueError('No prompt given: pass it as an argument (jaxserve generate "Hello") or on stdin.')
    stream = sys.stdout.isatty() if args.stream is None else args.stream
    engine = LLMEngine(engine_config(args, precompile=False))
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
        raise ValueError(f"Unknown benchmark {args.name!r}: see `jaxserve bench --help`.") from None
    return int(mod.main(args.bench_args) or 0)


def cmd_serve(args: argparse.Namespace) -> int:
    from jaxserve.server.app import serve

    return serve(args)


def cmd_convert(args: argparse.Namespace) -> int:
    from jaxserve.model.orbax_io import convert

    return convert(args)


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
    add_engine_args(g)
    g.set_defaults(func=cmd_generate, command_parser=g)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
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

    c = sub.add_parser("convert", help="convert an HF directory or GGUF file to an Orbax checkpoint")
    c.add_argument("src")
    c.add_argument("dst")
    c.set_defaults(func=cmd_convert)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    verbose = getattr(args, "verbose", False) or args.command == "serve"
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        if getattr(args, "config", None):
            apply_config_file(args, args.command_parser, argv)
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except USER_ERRORS as e:
        msg = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
        print(f"jaxserve: error: {msg}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - known user-facing failures from dependencies
        from jaxserve.model.default_model import DefaultModelError

        if isinstance(e, DefaultModelError):
            print(f"jaxserve: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
