"""Models run with quantized weights (`quantization=`): the weights in memory after load (from the
arrays' sizes; no float copy of a linear kernel survives), perplexity on the shipped text and greedy
agreement with the float32 model over a fixed prompt set (bench/quality.py's measures), the
default model kept as its GGUF blocks generating what its float32 form generates, and the errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.quality import PROMPTS, greedy_agreement, quality_text, text_logprobs
from jaxserve import LLM, SamplingParams
from jaxserve.errors import UserError
from jaxserve.runtime import quant_params, weight_formats

ENGINE_KW = {"precompile": False, "max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64,
             "num_blocks": 96, "use_tqdm": False}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def float32_bytes(params) -> int:
    shapes = [jax.eval_shape(weight_formats.dequantize, x) if weight_formats.is_quantized(x) else x
              for x in jax.tree.leaves(params, is_leaf=weight_formats.is_quantized)]
    return sum(int(np.prod(x.shape)) * 4 for x in shapes)


def evaluate(llm: LLM, ids: list[int], ref_tokens=None) -> dict:
    runner = llm.engine.runner
    logp = text_logprobs(runner, ids)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    result = {"perplexity": float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean())),
              "prompts": [o.prompt_token_ids for o in outs], "tokens": [o.outputs[0].token_ids for o in outs],
              "bytes": quant_params.weight_bytes(runner.params), "float32_bytes": float32_bytes(runner.params)}
    if ref_tokens is not None:
        result["greedy"] = greedy_agreement(runner, result["prompts"], ref_tokens)
    return result


@pytest.fixture(scope="module")
def reference(tiny_model):
    """reference(arch) -> (model path, text ids, the float32 model's measures), once per arch."""
    made: dict = {}

    def get(arch: str):
        if arch not in made:
            path = tiny_model(arch, hidden=128, heads=4, kv_heads=2)
            llm = LLM(path, **ENGINE_KW)
            ids = llm.get_tokenizer().encode(quality_text())[:ENGINE_KW["max_model_len"]]
            made[arch] = path, ids, evaluate(llm, ids)
        return made[arch]

    return get


@pytest.fixture(scope="module")
def measured() -> dict:
    """(arch, scheme) -> a quantized model's measures, kept by the test that made them (so the xla
    backend's test compares with the native run without repeating it)."""
    return {}


# weights / float32, perplexity tolerance, greedy agreement
BUDGETS = {"int8": (0.30, 0.02, 0.90), "fp8": (0.30, 0.05, 0.80), "q8_0": (0.30, 0.02, 0.90),
           "q4_0": (0.17, 0.10, None), "q4_1": (0.17, 0.10, None)}


@pytest.mark.parametrize("arch,scheme", [("llama", "int8"), ("llama", "fp8"), ("llama", "q8_0"), ("llama", "q4_0"),
                                         ("llama", "q4_1"),
                                         ("qwen2", "int8"), ("qwen2", "q4_1")])  # qwen2: tied embeddings
def test_quantized_tiny_model(reference, measured, arch, scheme):
    path, ids, ref = reference(arch)
    budget, ppl_tol, agree = BUDGETS[scheme]
    llm = LLM(path, quantization=scheme, **ENGINE_KW)
    params = llm.engine.runner.params
    kernels = [w for p, w in jax.tree_util.tree_flatten_with_path(params, is_leaf=weight_formats.is_quantized)[0]
               if getattr(p[-1], "key", None) in ("kernel", "embedding")]
    assert kernels and all(weight_formats.is_quantized(w) for w in kernels)  # no float copy survives
    got = measured[arch, scheme] = evaluate(llm, ids, ref["tokens"])
    assert got["bytes"] <= budget * got["float32_bytes"]
    assert got["float32_bytes"] == ref["bytes"]  # the same weights, counted in float32
    assert abs(got["perplexity"] / ref["perplexity"] - 1) <= ppl_tol
    if agree is not None:
        assert got["greedy"] >= agree


def test_xla_backend_dequantizes_inside_the_computation(reference, measured):
    """Without the native linear layers (the xla backend) the same weights give the same model."""
    path, ids, _ = reference("llama")
    native = measured.get(("llama", "q4_1")) or evaluate(LLM(path, quantization="q4_1", **ENGINE_KW), ids)
    llm = LLM(path, quantization="q4_1", attention_backend="xla", **ENGINE_KW)
    assert not llm.engine.runner.backend.native_linear
    assert quant_params.has_quantized(llm.engine.runner.params)
    got = evaluate(llm, ids, native["tokens"])
    assert got["bytes"] == native["bytes"]
    assert abs(got["perplexity"] / native["perplexity"] - 1) < 1e-3 and got["greedy"] >= 0.95


def test_bfloat16_compute_keeps_scales_and_runs(reference):
    """dtype bfloat16 (the accelerators' default; XLA path): norms in bfloat16, quantized parts as
    they are, the weights dequantized to bfloat16 inside the matmul."""
    path, ids, ref = reference("llama")
    llm = LLM(path, quantization="q8_0", dtype="bfloat16", attention_backend="xla", **ENGINE_KW)
    w = llm.engine.runner.params["layers_0"]["mlp"]["up_proj"]["kernel"]
    assert (w.q.dtype, w.d.dtype) == (jnp.int8, jnp.float16)
    assert llm.engine.runner.params["norm"]["weight"].dtype == jnp.bfloat16
    assert abs(evaluate(llm, ids)["perplexity"] / ref["perplexity"] - 1) < 0.05


def test_orbax_checkpoint_quantized_once_restored(reference, tmp_path):
    """A lazy (Orbax) checkpoint is restored, then quantized: the same weights as from safetensors."""
    from jaxserve.convert import convert_model

    path = reference("llama")[0]
    convert_model(path, tmp_path / "orbax")
    direct = LLM(path, quantization="int8", **ENGINE_KW)
    restored = LLM(str(tmp_path / "orbax"), quantization="int8", **ENGINE_KW)
    a, b = (jax.tree.leaves(x.engine.runner.params) for x in (direct, restored))
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_errors_name_the_scheme(tiny_model):
    with pytest.raises(UserError, match="'fp4'.*int8, fp8, q8_0, q4_0, q4_1, gguf") as e:
        LLM(tiny_model("llama"), quantization="fp4", **ENGINE_KW)
    assert e.value.param == "quantization"
    with pytest.raises(UserError, match="not a .gguf file"):
        LLM(tiny_model("llama"), quantization="gguf", **ENGINE_KW)


@pytest.mark.slow
def test_default_model_kept_as_gguf_blocks_generates_as_float32():
    """Q4_1 / Q8_0 read exactly and summed in the float32 kernel's order: the same tokens."""
    kw = {**ENGINE_KW, "max_num_seqs": 2}
    prompts = PROMPTS[:2]
    ref = [o.outputs[0].token_ids
           for o in LLM(None, quantization="none", **kw).generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(None, quantization="gguf", **kw)
    params = llm.engine.runner.params
    assert quant_params.weight_bytes(params) <= 0.18 * float32_bytes(params)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == ref
