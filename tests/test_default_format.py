"""The weight format run when the user names none (jaxserve/default_format.py, issue 26): the rule
over checkpoint kind x CPU features x platform x explicit settings, with no model; what a
checkpoint's header says; `--quantization none` accepted and bad values refused in one line; and
the default model on this machine getting the chosen format and its log line."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import pytest

from jaxserve import default_format as df
from jaxserve.config import EngineConfig
from jaxserve.default_format import Checkpoint, choose, default_quantization, inspect_checkpoint
from jaxserve.errors import UserError
from jaxserve.model.gguf_loader import GGUFFile

AMX = frozenset({"avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16", "avx_vnni"})
ZEN5 = frozenset({"avx512f", "avx512_vnni", "avx512_bf16"})  # AVX-512 with both dot products, no AMX
VNNI_ONLY = frozenset({"avx2", "avx_vnni"})  # AVX-VNNI (int8), no bfloat16 dot products
BF16_ONLY = frozenset({"avx512f", "avx512_bf16"})
AVX2 = frozenset({"avx2", "fma"})
AMX_BF16_ONLY = frozenset({"amx_tile", "amx_bf16"})
AMX_INT8_ONLY = frozenset({"amx_tile", "amx_int8"})

Q4_1 = Checkpoint("gguf", block_types=frozenset({"Q4_1"}))
Q4_K_M = Checkpoint("gguf", block_types=frozenset({"Q4_K", "Q6_K"}))
Q8_0 = Checkpoint("gguf", block_types=frozenset({"Q8_0"}))
Q5_K = Checkpoint("gguf", block_types=frozenset({"Q5_K", "Q6_K"}))  # a block type without a kernel
BF16_GGUF = Checkpoint("gguf", "bfloat16")
F32_GGUF = Checkpoint("gguf", "float32")
BF16 = Checkpoint("safetensors", "bfloat16")
F32 = Checkpoint("safetensors", "float32")
F16 = Checkpoint("safetensors", "float16")
FP8 = Checkpoint("safetensors", "bfloat16", quantized=True)  # quantization_config: loaded its own way
UNKNOWN = Checkpoint("safetensors", None)
ORBAX = Checkpoint("orbax")


SMALL_Q4_1 = Checkpoint("gguf", block_types=frozenset({"Q4_1"}), num_params=135_000_000)  # the shipped model's size
LARGE_Q4_K_M = Checkpoint("gguf", block_types=frozenset({"Q4_K", "Q6_K"}), num_params=8_000_000_000)
GIB = 2**30


@pytest.mark.parametrize("checkpoint,features,want", [
    # a GGUF of kept blocks whose size is not known: as stored where the CPU has int8 dot products
    (Q4_1, AMX, "gguf"), (Q4_1, ZEN5, "gguf"), (Q4_1, VNNI_ONLY, "gguf"), (Q4_1, AMX_INT8_ONLY, "gguf"),
    (Q4_K_M, AMX, "gguf"), (Q8_0, ZEN5, "gguf"),
    (Q4_1, AVX2, "none"), (Q4_1, BF16_ONLY, "none"), (Q4_1, AMX_BF16_ONLY, "none"), (Q4_1, frozenset(), "none"),
    (Q5_K, AMX, "none"),
    # ... whose bfloat16 weights take at most a quarter of memory (16 GiB here): bfloat16 where the
    # CPU has bfloat16 dot products; larger ones keep their blocks
    (SMALL_Q4_1, AMX, "bfloat16"), (SMALL_Q4_1, ZEN5, "bfloat16"), (SMALL_Q4_1, BF16_ONLY, "bfloat16"),
    (SMALL_Q4_1, AMX_BF16_ONLY, "bfloat16"), (SMALL_Q4_1, VNNI_ONLY, "gguf"), (SMALL_Q4_1, AVX2, "none"),
    (LARGE_Q4_K_M, AMX, "gguf"), (LARGE_Q4_K_M, ZEN5, "gguf"), (LARGE_Q4_K_M, BF16_ONLY, "none"),
    # a bfloat16 checkpoint: bfloat16 matmul inputs where the CPU has bfloat16 dot products
    (BF16, AMX, "bfloat16"), (BF16, ZEN5, "bfloat16"), (BF16, BF16_ONLY, "bfloat16"),
    (BF16, AMX_BF16_ONLY, "bfloat16"), (BF16_GGUF, ZEN5, "bfloat16"),
    (BF16, VNNI_ONLY, "none"), (BF16, AMX_INT8_ONLY, "none"), (BF16, AVX2, "none"),
    # the rest: float32
    (F32, AMX, "none"), (F16, AMX, "none"), (FP8, AMX, "none"), (UNKNOWN, AMX, "none"), (ORBAX, AMX, "none"),
    (F32_GGUF, AMX, "none"), (Checkpoint("other"), AMX, "none"),
])
def test_rule_on_cpu(checkpoint, features, want):
    quantization, why = default_quantization(checkpoint, features, "cpu", 16 * GIB)
    assert quantization == want, why
    assert why


def test_a_gguf_is_expanded_to_bfloat16_only_while_it_takes_a_quarter_of_memory():
    need = 2 * SMALL_Q4_1.num_params
    assert default_quantization(SMALL_Q4_1, AMX, "cpu", 4 * need)[0] == "bfloat16"
    assert default_quantization(SMALL_Q4_1, AMX, "cpu", 4 * need - 1)[0] == "gguf"
    assert default_quantization(SMALL_Q4_1, AMX, "cpu", 0)[0] == "gguf"  # memory unknown: blocks as stored
    why = default_quantization(SMALL_Q4_1, AMX, "cpu", 16 * GIB)[1]
    assert "Q4_1 blocks expanded to bfloat16 (257 MiB)" in why and "--quantization gguf" in why


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("checkpoint", [Q4_1, BF16, F32])
def test_rule_off_cpu_chooses_nothing(checkpoint, platform):
    assert default_quantization(checkpoint, AMX, platform)[0] == "none"


def _unread():
    raise AssertionError("the checkpoint must not be read when the user chose")


def _built():
    return None


def _cfg(**kw) -> EngineConfig:
    return EngineConfig(**kw)


@pytest.mark.parametrize("explicit", ["int8", "w4a8", "gguf", "bfloat16", "none"])
def test_explicit_quantization_is_kept_and_not_logged(explicit):
    assert choose(_cfg(quantization=explicit), _unread, "cpu", AMX, _built) == (explicit, None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_explicit_dtype_means_no_quantization(dtype):
    assert choose(_cfg(dtype=dtype), _unread, "cpu", AMX, _built) == ("none", None)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_accelerators_keep_their_defaults_silently(platform):
    assert choose(_cfg(), _unread, platform, AMX, _built) == ("none", None)


@pytest.mark.parametrize("checkpoint,features,want", [(Q4_1, AMX, "gguf"), (BF16, ZEN5, "bfloat16")])
def test_default_applies_and_says_how_to_get_float32(checkpoint, features, want):
    quantization, line = choose(_cfg(), lambda: checkpoint, "cpu", features, _built)
    assert quantization == want
    assert f"--quantization {want}" in line and "--quantization none or --dtype float32" in line
    # the same with the native backend asked for by name, or a quantized / bfloat16 KV cache
    for kw in ({"attention_backend": "cpu"}, {"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "bfloat16"}):
        assert choose(_cfg(**kw), lambda: checkpoint, "cpu", features, _built)[0] == want, kw


@pytest.mark.parametrize("kw,named", [
    ({"tensor_parallel_size": 2}, "tensor parallel 2"),
    ({"attention_backend": "xla"}, "attention backend xla"),
    ({"attention_backend": "pallas"}, "attention backend pallas"),
    ({"kv_cache_dtype": "float16"}, "float16 KV cache"),
])
def test_float32_off_the_native_single_device_path(kw, named):
    quantization, line = choose(_cfg(**kw), lambda: Q4_1, "cpu", AMX, _built)
    assert quantization == "none" and named in line and line.startswith("Weights: float32")


def test_float32_where_the_native_kernels_did_not_build():
    quantization, line = choose(_cfg(), lambda: BF16, "cpu", AMX, lambda: "RuntimeError: no C++ compiler found")
    assert quantization == "none" and "no C++ compiler found" in line


def test_native_kernels_asked_only_when_a_format_is_chosen():
    def never():
        raise AssertionError("not needed for a float32 checkpoint")

    quantization, line = choose(_cfg(), lambda: F32, "cpu", AMX, never)
    assert quantization == "none" and line.startswith("Weights: float32")


def test_inspect_hf_directories(tmp_path):
    def ckpt(name, cfg):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        return inspect_checkpoint(d)

    assert ckpt("bf16", {"torch_dtype": "bfloat16"}) == BF16
    assert ckpt("torch", {"torch_dtype": "torch.bfloat16"}) == BF16
    assert ckpt("new", {"dtype": "bfloat16"}) == BF16  # newer transformers' key
    assert ckpt("f32", {"torch_dtype": "float32"}) == F32
    assert ckpt("fp8", {"torch_dtype": "bfloat16", "quantization_config": {"quant_method": "fp8"}}) == FP8
    assert ckpt("none", {}) == UNKNOWN
    orbax = tmp_path / "orbax"
    orbax.mkdir()
    (orbax / "jaxserve_orbax.json").write_text("{}")
    assert inspect_checkpoint(orbax) == ORBAX
    assert inspect_checkpoint(tmp_path / "missing").kind == "other"


@pytest.mark.parametrize("matrix_type,types,want", [
    ("Q4_1", None, Q4_1), ("Q8_0", None, Q8_0), ("Q4_K", {"ffn_down": "Q6_K"}, Q4_K_M),
    ("Q4_0", {"ffn_down": "Q5_0"}, Checkpoint("gguf", block_types=frozenset({"Q4_0", "Q5_0"}))),
    ("F32", None, F32_GGUF), ("BF16", None, BF16_GGUF),
])
def test_inspect_gguf_reads_the_layers_block_types(tmp_path, matrix_type, types, want):
    from tests.model.test_quant_gguf import write_tiny_gguf

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, matrix_type, hidden=256, inter=256, types=types)
    got = inspect_checkpoint(path)
    assert got.num_params == sum(math.prod(t.shape) for t in GGUFFile(path).tensors.values()) > 0
    assert dataclasses.replace(got, num_params=0) == want


def test_kept_blocks_are_the_loaders():
    from jaxserve.model.gguf_loader import KEPT_TYPES

    assert df.KEPT_BLOCKS == frozenset(KEPT_TYPES)


def test_none_is_a_quantization_and_bad_values_are_named():
    assert EngineConfig(quantization="none").quantization == "none"
    with pytest.raises(UserError, match=r"quantization='float32'.*gguf, bfloat16.*none") as e:
        EngineConfig(quantization="float32")
    assert e.value.param == "quantization"


def test_cli_takes_none_and_refuses_bad_values_in_one_line(capsys):
    from jaxserve import cli

    args = cli.build_parser().parse_args(["generate", "--quantization", "none", "hi"])
    assert args.quantization == "none"
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["generate", "--quantization", "fp4", "hi"])
    assert e.value.code == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert "fp4" in lines[-1] and "none" in lines[-1]


@pytest.mark.slow
def test_default_model_runs_this_machines_format_and_says_so(caplog):
    """The shipped Q4_1 GGUF with the defaults: the format the rule picks for this CPU (bfloat16
    where it has bfloat16 dot products, else gguf where it has VNNI or AMX-int8: its Q4_1 / Q8_0
    blocks kept), and one INFO line saying so."""
    import jax

    from jaxserve import LLM, SamplingParams
    from jaxserve.model.default_model import default_model_path
    from jaxserve.runtime import cpu_kernels, weight_formats
    from jaxserve.runtime.cpu_isa import cpu_features

    if cpu_kernels.available() is not None:
        pytest.skip(f"native CPU kernels unavailable: {cpu_kernels.available()}")
    want, _ = default_quantization(inspect_checkpoint(default_model_path()), cpu_features(), "cpu",
                                   df.physical_memory())
    assert want == ("bfloat16" if cpu_features() & set(df.BF16_DOT) else
                    "gguf" if cpu_features() & set(df.INT8_DOT) else "none")
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        llm = LLM(precompile=False, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=32, num_blocks=32)
    assert llm.engine.quantization == want
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Weights:")]
    assert len(lines) == 1, lines
    assert (f"--quantization {want}" in lines[0] and "--quantization none or --dtype float32" in lines[0]) \
        if want != "none" else lines[0].startswith("Weights: float32")
    leaves = jax.tree.leaves(llm.engine.runner.params, is_leaf=weight_formats.is_quantized)
    kinds = {type(w).__name__ for w in leaves if weight_formats.is_quantized(w)}
    assert kinds == {"gguf": {"Q4Weight", "Q8Weight"}, "bfloat16": {"Bf16Weight"}, "none": set()}[want], kinds
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
