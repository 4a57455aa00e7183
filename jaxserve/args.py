"""Command-line flags <-> `EngineConfig`: one flag per config field, `--config FILE` presets, and the
namespace -> config step. Below the CLI, the server and `jaxserve lower`, which all build an engine
from parsed flags (so none of them imports the CLI).
"""

from __future__ import annotations

import argparse
import dataclasses

import yaml

from jaxserve.config import EngineConfig, parse_bytes
from jaxserve.errors import UserError


def bytes_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _field_type(f: dataclasses.Field):
    ann = str(f.type)
    if f.metadata.get("metavar") == "BYTES":
        return bytes_arg
    for name, t in (("bool", bool), ("int", int), ("float", float)):
        if ann.split(" ")[0] == name:
            return t
    return str


def add_config_args(g, cls=EngineConfig, skip: tuple[str, ...] = ()) -> None:
    """One flag per dataclass field: name, type, choices, help and default all come from the field,
    so the config and the CLI cannot drift apart."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        meta = f.metadata
        flag = meta.get("flag") or "--" + f.name.replace("_", "-")
        aliases = [a for a in meta.get("aliases", ()) if not a.startswith("!")]
        negatives = [a[1:] for a in meta.get("aliases", ()) if a.startswith("!")]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = meta.get("help", "") + ("" if default is None else f" (default: {default})")
        kind = _field_type(f)
        if kind is bool:
            g.add_argument(flag, *aliases, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                           help=help_text)
            for neg in negatives:
                g.add_argument(neg, dest=f.name, action="store_false", help=f"same as --no-{flag[2:]}")
        else:
            g.add_argument(flag, *aliases, dest=f.name, type=kind, default=default, choices=meta.get("choices"),
                           metavar=meta.get("metavar"), help=help_text)


def add_engine_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    g = p.add_argument_group("model and engine (EngineConfig)")
    add_config_args(g, skip=skip)
    g.add_argument("--verbose", "-v", action="store_true", help="log engine details to stderr")
    g.add_argument("--config", default=None, metavar="YAML",
                   help="read flag values from a YAML file (keys are flag names, e.g. max-num-seqs: 32); "
                   "flags given on the command line win. Presets: configs/")


def apply_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Fill in values from `--config FILE` for every flag the command line did not set."""
    path = getattr(args, "config", None)
    if not path:
        return
    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise UserError(f"Config file {path!r} does not exist.", param="config") from None
    except yaml.YAMLError as e:
        raise UserError(f"Config file {path!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(values, dict):
        raise UserError(f"Config file {path!r} must be a mapping of flag names to values.")
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
            raise UserError(f"Unknown key {key!r} in config file {path!r}: use flag names of "
                             f"`jaxserve {args.command} --help`, e.g. max-num-seqs.")
        if any(opt in given for opt in action.option_strings):
            continue
        try:
            if action.nargs == 0:  # a switch (store_true / store_false): `true` means the flag is given
                if not isinstance(value, bool):
                    raise UserError("expected true or false")
                if isinstance(action, argparse.BooleanOptionalAction):
                    value = value != name.startswith("no-")  # `no-precompile: true` means False
                else:
                    value = action.const if value else not action.const
            elif isinstance(value, str) and action.type not in (None, str):
                value = action.type(value)  # e.g. "1GiB" -> bytes
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            raise UserError(f"Invalid value {value!r} for {key!r} in config file {path!r}: {e}") from None
        if action.choices is not None and value not in action.choices:
            raise UserError(f"Invalid value {value!r} for {key!r} in config file {path!r}: "
                             f"choose one of {', '.join(map(str, action.choices))}.")
        setattr(args, action.dest, value)


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    kw = {k: getattr(args, k) for k in EngineConfig.field_names() if hasattr(args, k)}
    if getattr(args, "model_arg", None):  # `jaxserve serve MODEL`, as `vllm serve MODEL`
        if kw.get("model") not in (None, args.model_arg):
            raise UserError(f"Two models given: {args.model_arg!r} and --model {kw['model']!r}: pass one.",
                            param="model")
        kw["model"] = args.model_arg
    kw.update(overrides)
    return EngineConfig(**kw)
