"""`--config FILE`: YAML presets fill in flags the command line did not set; mistakes name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxserve.args import apply_config_file, engine_config
from jaxserve.cli import build_parser

PRESETS = sorted(str(p) for p in (Path(__file__).parent.parent / "configs").glob("*.yaml"))


def parse(argv, tmp_path=None, text=None):
    if text is not None:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(text)
        argv = [*argv, "--config", str(cfg)]
    args = build_parser().parse_args(argv)
    apply_config_file(args, args.command_parser, argv)
    return args


def test_values_fill_in_and_command_line_wins(tmp_path):
    args = parse(["serve", "--max-num-seqs", "8"], tmp_path,
                 "max-num-seqs: 32\nkv-cache-memory: 64MiB\nprefix_cache: hash\ndecode-first: true\n"
                 "no-precompile: true\n")
    cfg = engine_config(args)
    assert cfg.max_num_seqs == 8 and cfg.kv_cache_memory == 64 << 20 and cfg.prefix_cache == "hash"
    assert cfg.prefill_first is False and cfg.precompile is False


def test_presets_exist():
    assert len(PRESETS) >= 3


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_parse_into_valid_engine_configs(preset):
    args = parse(["serve", "--config", preset])
    engine_config(args)  # validates every field


@pytest.mark.parametrize(
    "text, needle",
    [
        ("max-num-sequences: 4\n", "Unknown key 'max-num-sequences'"),
        ("prefix-cache: lru\n", "choose one of radix, hash, off"),
        ("kv-cache-memory: lots\n", "Invalid memory size"),
        ("max-num-seqs: [1, 2]\n", "max_num_seqs"),
        ("- just a list\n", "mapping"),
        ("a: [unclosed\n", "not valid YAML"),
        ("no-precompile: maybe\n", "expected true or false"),
    ],
)
def test_mistakes_name_the_key(tmp_path, text, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
        engine_config(parse(["serve"], tmp_path, text))


def test_missing_file_is_one_clear_error(capsys):
    from jaxserve.cli import main

    assert main(["generate", "--config", "/no/such.yaml", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["jaxserve: error: Config file '/no/such.yaml' does not exist."]


def test_only_user_errors_are_one_line(monkeypatch, capsys):
    """A UserError is `jaxserve: error: ...` and exit 2; any other exception is a bug and keeps
    its traceback (it propagates), never a silent exit."""
    from jaxserve import cli
    from jaxserve.errors import UserError

    def bad_input(args):
        raise UserError("Invalid max_tokens=0: must be >= 1.", param="max_tokens")

    def bug(args):
        raise KeyError("internal")

    monkeypatch.setattr(cli, "cmd_generate", bad_input)
    assert cli.main(["generate", "hi"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["jaxserve: error: Invalid max_tokens=0: must be >= 1."]
    monkeypatch.setattr(cli, "cmd_generate", bug)
    with pytest.raises(KeyError, match="internal"):
        cli.main(["generate", "hi"])


def test_flags_are_generated_from_the_config():
    """Every EngineConfig field is a `serve` flag (scheduler knobs included), with its default."""
    import dataclasses

    from jaxserve.config import EngineConfig

    args = build_parser().parse_args(["serve", "some/model", "--lpm-max-queue", "7", "--no-async-scheduling",
                                      "--memory-fraction", "0.5", "--decode-first"])
    cfg = engine_config(args)
    assert cfg.model == "some/model" and cfg.lpm_max_queue == 7 and cfg.async_scheduling is False
    assert cfg.gpu_memory_utilization == 0.5 and cfg.prefill_first is False
    defaults = engine_config(build_parser().parse_args(["serve"]))
    for f in dataclasses.fields(EngineConfig):
        assert getattr(defaults, f.name) == getattr(EngineConfig(), f.name), f.name
    sched = defaults.scheduler_config(num_blocks=10, max_model_len=64)
    assert sched.lpm_max_wait_steps == defaults.lpm_max_wait_steps and sched.policy == defaults.schedule


def test_speculative_config_from_a_flag_and_from_yaml(tmp_path):
    flag = engine_config(parse(["serve", "--speculative-config",
                                '{"method": "ngram", "num_speculative_tokens": 3}']))
    assert flag.speculative.method == "ngram" and flag.speculative.num_speculative_tokens == 3
    f = tmp_path / "spec.yaml"
    f.write_text("speculative-config: {method: draft, model: /some/draft, num_speculative_tokens: 2}\n")
    cfg = engine_config(parse(["serve", "--config", str(f)]))
    assert cfg.speculative.method == "draft" and cfg.speculative.model == "/some/draft"
    agents = engine_config(parse(["serve", "--config", str(Path(__file__).parent.parent / "configs" / "agents.yaml")]))
    assert agents.speculative.method == "ngram"
