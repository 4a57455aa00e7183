"""The dot-product formats (runtime/weight_formats.py's Bf16Weight, W8A8Weight and W4A8Weight,
csrc/dot_matmul.cc): the native kernel against float64 on bfloat16-rounded inputs (bfloat16) and
against the exact integer arithmetic (W8A8, W4A8), its rows independent of the batch, the portable
path against the AVX-512 instructions, AMX tiles against both (where the CPU has them), the XLA
reference path, the layouts, and the run-time choice of instructions (made once, by the backend)."""

from __future__ import annotations

import platform
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.runtime import cpu_isa, cpu_kernels, native_build, panels, quant, quant_params, weight_formats

WHY = cpu_kernels.available()
needs_kernel = pytest.mark.skipif(WHY is not None, reason=f"native CPU kernel unavailable: {WHY}")
FORMATS = ["bfloat16", "w8a8", "w4a8", "q8a8"]  # q8a8: what w4a8 makes of a GGUF's Q8_0 blocks
EXACT = ("w8a8", "w4a8", "q8a8")  # integer block sums: the same bits on every path
linear = jax.jit(quant.linear)
gated = jax.jit(quant.linear_gated)


def problem(seed: int, m: int, k: int, n: int, fmt: str):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, :32] = 0  # a zero block (a zero activation scale), and below a row of zeros
    if m > 2:
        x[2] = 0
    w = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    return x, w, jax.device_put(weight_formats.quantize(w, fmt))


def w8a8_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """W8A8 by hand in numpy: int8 weights per column, int8 activations per block of 32 along k
    (scale max |x_block| / 127), each block's exact integer sum times its scale, then scale[n]."""
    qw = weight_formats.quantize_int8(w)
    q = panels.from_panels(qw.q).astype(np.int64)
    k = x.shape[1]
    xq, sx = activation_blocks(x)
    sums = np.einsum("mbk,bkn->mbn", xq, q.reshape(k // 32, 32, -1)).astype(np.float64)
    return (sums * sx).sum(axis=1) * qw.scale


def activation_blocks(x: np.ndarray):
    """int8 activations per block of 32 along k by hand: (xq int64 [M, K / 32, 32], sx float64
    [M, K / 32, 1]), scale max |x_block| / 127, rint(x * 127 / max)."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return np.clip(np.rint(xb * inv), -127, 127).astype(np.int64), (amax / np.float32(127)).astype(np.float64)


def w4a8_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """W4A8 by hand: Q4_1's values Q, d and m (gguf's quantizer), the activations' blocks, and per
    block sx (d sum(xq Q) + m sum(xq)) in float64."""
    q4 = weight_formats.quantize(w, "q4_1")
    k = x.shape[1]
    q = panels.from_panels(panels.nibbles(np.asarray(q4.q))).astype(np.int64).reshape(k // 32, 32, -1)
    d, mins = (panels.from_panels(np.asarray(a)).astype(np.float64) for a in (q4.d, q4.m))  # [K / 32, N]
    xq, sx = activation_blocks(x)
    sums = np.einsum("mbk,bkn->mbn", xq, q).astype(np.float64)
    return (sx * (d * sums + mins * xq.sum(axis=2, keepdims=True))).sum(axis=1)


def q8a8_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Q8_0's values and d (gguf's quantizer) times the activations' blocks: per block sx d sum(xq Q)."""
    q8 = weight_formats.quantize(w, "q8_0")
    k = x.shape[1]
    q = panels.from_panels(np.asarray(q8.q)).astype(np.int64).reshape(k // 32, 32, -1)
    d = panels.from_panels(np.asarray(q8.d)).astype(np.float64)
    xq, sx = activation_blocks(x)
    return (sx * d * np.einsum("mbk,bkn->mbn", xq, q)).sum(axis=1)


def reference(x: np.ndarray, w: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "w8a8":
        return w8a8_reference(x, w).astype(np.float64)
    if fmt == "w4a8":
        return w4a8_reference(x, w)
    if fmt == "q8a8":
        return q8a8_reference(x, w)
    bf = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
    return bf(x) @ bf(w)


def test_layouts_round_trip():
    w = np.random.default_rng(0).standard_normal((96, 128)).astype(np.float32)
    b = weight_formats.quantize_bf16(w)
    assert b.q.dtype == jnp.bfloat16 and b.q.shape == (2, 48, 128)
    assert b.q[1, 5, 2 * 7 + 1] == w[2 * 5 + 1, 64 + 7].astype(ml_dtypes.bfloat16)  # [p, i, 2j + t]
    np.testing.assert_array_equal(np.asarray(weight_formats.dequantize(b)),
                                  w.astype(ml_dtypes.bfloat16).astype(np.float32))
    a = weight_formats.quantize_w8a8(w)
    i8 = weight_formats.quantize_int8(w)
    assert a.q.dtype == np.uint8 and a.q.shape == (2, 24, 256)
    np.testing.assert_array_equal(panels.from_words(a.q, 4).astype(np.int32) - 128, i8.q)
    np.testing.assert_array_equal(np.asarray(weight_formats.dequantize(a)), np.asarray(weight_formats.dequantize(i8)))
    q4 = weight_formats.quantize(w, "q4_1")
    f = weight_formats.to_w4a8(q4)  # Q4_1's values and blocks, two k quads a byte
    assert f.q.dtype == np.uint8 and f.q.shape == (2, 12, 256) and f.d.shape == f.m.shape == (2, 3, 64)
    vals = panels.from_panels(panels.nibbles(q4.q))  # [K, N] in 0..15
    assert f.q[1, 5, 4 * 7 + 2] == vals[8 * 5 + 2, 64 + 7] | vals[8 * 5 + 4 + 2, 64 + 7] << 4  # [p, g, 4j + t]
    np.testing.assert_array_equal(np.asarray(weight_formats.dequantize(f)), np.asarray(weight_formats.dequantize(q4)))
    q8 = weight_formats.quantize(w, "q8_0")
    e = weight_formats.to_q8a8(q8)  # Q8_0's values + 128 in quads, m = -128 d
    assert e.q.shape == (2, 24, 256) and e.q[1, 5, 4 * 7 + 2] == int(q8.q[1, 4 * 5 + 2, 7]) + 128
    np.testing.assert_array_equal(np.asarray(e.m, np.float32), -128 * np.asarray(e.d, np.float32))
    np.testing.assert_array_equal(np.asarray(weight_formats.dequantize(e)), np.asarray(weight_formats.dequantize(q8)))
    ids = jnp.asarray([0, 5, 63, 64, 127, 5], jnp.int32)
    for qw in (b, a, f, e):
        np.testing.assert_array_equal(np.asarray(quant.embed(qw, ids)),
                                      np.asarray(weight_formats.dequantize(qw)).T[ids])


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k,n", [(64, 64), (576, 192), (96, 128)])
@pytest.mark.parametrize("m", [1, 5, 6, 7, 48, 49, 113])
def test_native_matches_reference(fmt, m, k, n):
    x, w, qw = problem(m * 1000 + k, m, k, n, fmt)
    got = np.asarray(linear(x, qw))
    want = reference(x, w, fmt)
    # bfloat16: float32 sums of exact products; W8A8, W4A8: exact block sums, float32 after
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    if m > 2:
        assert not got[2].any()
    xla = np.asarray(jax.jit(lambda x, w: quant.linear(x, w, native=False))(x, qw))
    np.testing.assert_allclose(xla, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cap", ["auto", "avx512", "portable"])
def test_rows_do_not_depend_on_the_batch(fmt, cap):
    """The same row gives bit-identical results alone, in a batch of 7, or of 100, at any offset,
    plain and gated, on either path."""
    isa = cpu_kernels.choose_isa(cap)
    x, _, qw = problem(0, 100, 576, 192, fmt)
    lin = jax.jit(lambda x, w: quant.linear(x, w, isa=isa))
    gat = jax.jit(lambda x, w, u: quant.linear_gated(x, w, u, isa=isa))
    full, full_g = np.asarray(lin(x, qw)), np.asarray(gat(x, qw, qw))
    for lo, hi in [(0, 1), (3, 10), (50, 100), (97, 98), (20, 36), (1, 8), (60, 67)]:
        np.testing.assert_array_equal(np.asarray(lin(x[lo:hi], qw)), full[lo:hi])
        np.testing.assert_array_equal(np.asarray(gat(x[lo:hi], qw, qw)), full_g[lo:hi])


def run_under(cap: str, fn, *args):
    """fn(*args, isa=...) jitted, on the instructions chosen under cap (as $JAXSERVE_CPU_ISA=cap would)."""
    isa = cpu_kernels.choose_isa(cap)
    return np.asarray(jax.jit(lambda *a: fn(*a, isa=isa))(*args))


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_portable_path_computes_the_same_sums(fmt):
    """The fallback for CPUs without AVX512_BF16 / AVX512_VNNI: W8A8's and W4A8's integer sums are the same bits;
    bfloat16 sums the pairs in vdpbf16ps' documented order (bit-identical on the AMD Zen 5 this
    was written on; kept to float32 rounding here, where a CPU may differ on subnormals)."""
    x, w, qw = problem(3, 37, 576, 256, fmt)
    fast = run_under("avx512", quant.linear, x, qw)
    fast_g = run_under("avx512", lambda x, w, isa: quant.linear_gated(x, w, w, 30, isa=isa), x, qw)
    port = run_under("portable", quant.linear, x, qw)
    port_g = run_under("portable", lambda x, w, isa: quant.linear_gated(x, w, w, 30, isa=isa), x, qw)
    assert cpu_kernels.choose_isa("portable")[fmt] == 0
    if fmt in EXACT:
        np.testing.assert_array_equal(port, fast)
        np.testing.assert_array_equal(port_g, fast_g)
    else:
        np.testing.assert_allclose(port, fast, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(port_g, fast_g, rtol=1e-6, atol=1e-6)
    want = reference(x, w, fmt)
    np.testing.assert_allclose(port, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


needs_amx = pytest.mark.skipif(WHY is not None or not {"amx_bf16", "amx_int8"} <= cpu_isa.cpu_features()
                               or cpu_kernels.amx_permitted() is not None,
                               reason="no AMX tiles here (CPU, build or Linux: cpu_kernels.amx_permitted)")


@needs_amx
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k,n", [(576, 192), (1536, 576), (96, 128)])
def test_amx_tiles_against_avx512(fmt, k, n):
    """isa 2 at every row count a tile meets (1..40 rows: partial tiles, W8A8's partial tiles on
    isa 1, a second tile; 64 and 113: whole and partial work items): W8A8's and W4A8's block sums
    are exact, so AMX gives AVX512_VNNI's bits; bfloat16 is float32-rounding close to vdpbf16ps
    and to the float64 reference. K = 96: an odd number of 32-k tile steps."""
    assert cpu_kernels.choose_isa("auto")[fmt] == 2
    x, w, qw = problem(k + n, 113, k, n, fmt)
    fns = {(cap, g): compile_under(cap, g, x, qw) for cap in ("auto", "avx512") for g in (False, True)}
    for m in [*range(1, 41), 64, 113]:  # the call's real rows: a traced operand, one compile per path
        rows = jnp.asarray([m], jnp.int32)
        got = {key: np.asarray(fn(x, qw, rows))[:m] for key, fn in fns.items()}
        for g in (False, True):
            amx, avx = got["auto", g], got["avx512", g]
            if fmt in EXACT or k % 32:
                np.testing.assert_array_equal(amx, avx, err_msg=f"m={m}")
            else:
                np.testing.assert_allclose(amx, avx, rtol=1e-5, atol=1e-5 * np.abs(avx).max(), err_msg=f"m={m}")
    want = reference(x, w, fmt)
    np.testing.assert_allclose(got["auto", False], want[:113], rtol=1e-5, atol=1e-5 * np.abs(want).max())


def compile_under(cap: str, gated_call: bool, x, w):
    """linear (or linear_gated, the weight twice) with traced real rows, compiled now for (x, w),
    on the instructions chosen under cap (as $JAXSERVE_CPU_ISA=cap would)."""
    isa = cpu_kernels.choose_isa(cap)
    if gated_call:
        fn = jax.jit(lambda x, w, rows: quant.linear_gated(x, w, w, rows, isa=isa))
    else:
        fn = jax.jit(lambda x, w, rows: quant.linear(x, w, rows, isa=isa))
    return fn.lower(x, w, jnp.zeros((1,), jnp.int32)).compile()


def test_isa_cap_is_checked(monkeypatch):
    monkeypatch.setenv(cpu_isa.ISA_ENV, "amx512")
    with pytest.raises(ValueError, match="JAXSERVE_CPU_ISA='amx512': expected one of auto, avx512, portable"):
        cpu_kernels.choose_isa()
    with pytest.raises(ValueError, match="'amx512': expected one of auto, avx512, portable"):
        cpu_kernels.choose_isa("amx512")


@needs_kernel
def test_the_backend_reads_the_isa_cap_once(monkeypatch):
    """$JAXSERVE_CPU_ISA is read when the backend is decided, not when a layer is traced: the
    backend's ops pass its choice to every call."""
    from jaxserve.runtime.backend import resolve_backend

    monkeypatch.setenv(cpu_isa.ISA_ENV, "portable")
    backend = resolve_backend(None, "float32", "float32")
    assert backend.dot_isa == cpu_kernels.choose_isa("portable")
    assert "w8a8: portable" in backend.describe()
    monkeypatch.setenv(cpu_isa.ISA_ENV, "amx512")  # not read again: tracing below does not fail
    x, _, qw = problem(0, 4, 64, 64, "w8a8")
    hlo = jax.jit(backend.ops().linear).lower(x, qw).as_text()
    assert re.search(r"isa = 0 : i32", hlo), hlo
    with pytest.raises(ValueError, match="amx512"):
        resolve_backend(None, "float32", "float32")


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,rows", [(1, 1), (9, 7), (64, 58)])
def test_gated_matches_silu_times_up(fmt, m, rows):
    x, w, qg = problem(m, m, 576, 1536, fmt)
    qu = jax.device_put(weight_formats.quantize(w[:, ::-1] * 2, fmt))
    got = np.asarray(gated(x, qg, qu, rows))
    g, u = (np.asarray(linear(x, q, rows)) for q in (qg, qu))
    np.testing.assert_allclose(got[:rows], (jax.nn.silu(g) * u)[:rows], rtol=2e-6, atol=2e-6)
    assert not got[rows:].any()
    xla = np.asarray(jax.jit(lambda x, a, b: quant.linear_gated(x, a, b, native=False))(x, qg, qu))
    np.testing.assert_allclose(xla[:rows], got[:rows], rtol=1e-4, atol=1e-4 * np.abs(got).max())


@needs_kernel
def test_instructions_follow_the_cpu_flags(monkeypatch):
    monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)
    flags = cpu_isa.cpu_features()
    paths = cpu_kernels.kernel_paths()
    assert paths == cpu_kernels.kernel_paths(cpu_kernels.choose_isa("auto"))
    for fmt, (flag, _) in cpu_isa.DOT_PATHS.items():
        isa, amx = cpu_kernels.choose_isa()[fmt], cpu_isa.AMX_PATHS[fmt]
        if flag not in flags:  # a CPU without the instruction runs the portable path
            assert isa == 0 and paths[fmt] == "portable"
        # AMX wherever the CPU has it and Linux grants it
        assert (isa == 2) == (isa > 0 and amx in flags and cpu_kernels.amx_permitted() is None)
        assert paths[fmt] == {2: amx, 1: flag, 0: "portable"}[isa]
    assert paths["amx"].startswith("amx") == any(f.startswith("amx") for f in flags)
    assert all(cpu_kernels.choose_isa("avx512")[fmt] < 2 for fmt in cpu_isa.DOT_PATHS)
    monkeypatch.setenv(cpu_isa.ISA_ENV, "portable")  # the user's cap, read by choose_isa()
    assert cpu_kernels.choose_isa() == cpu_kernels.choose_isa("portable")
    assert cpu_kernels.kernel_paths()["w8a8"] == cpu_kernels.kernel_paths()["bfloat16"] == "portable"


def test_quantize_params_makes_the_dot_formats():
    rng = np.random.default_rng(1)
    params = {"embed_tokens": {"embedding": rng.standard_normal((128, 64)).astype(np.float32)},
              "layers_0": {"mlp": {"up_proj": {"kernel": rng.standard_normal((64, 128)).astype(np.float32)}}}}
    before = quant_params.weight_bytes(params)
    for fmt, cls, share in (("bfloat16", weight_formats.Bf16Weight, 0.5), ("w8a8", weight_formats.W8A8Weight, 0.3),
                            ("w4a8", weight_formats.W4A8Weight, 0.17)):
        out = quant_params.quantize_params(params, fmt)
        assert isinstance(out["layers_0"]["mlp"]["up_proj"]["kernel"], cls)
        assert isinstance(out["embed_tokens"]["embedding"], cls)
        assert quant_params.weight_bytes(out) <= before * share


@needs_kernel
@pytest.mark.parametrize("arch,scheme", [("llama", "bfloat16"), ("llama", "w8a8"), ("qwen2", "w8a8"),
                                         ("qwen2", "w4a8")])
def test_engine_runs_the_dot_formats(tiny_model, arch, scheme):
    """A tiny random-init model (qwen2: tied embeddings) with `quantization=scheme`: every linear
    kernel in the format, half / a quarter / a sixth of float32's bytes, perplexity on the shipped
    text within 1% (bfloat16) / 2% (w8a8) of float32's and teacher-forced greedy agreement >= 95% /
    90%; w4a8 against q4_1 (the same 4-bit weights, float activations): what quantizing the
    activations costs, within 2% and >= 90%."""
    from bench.quality import PROMPTS, greedy_agreement, quality_text, text_logprobs
    from jaxserve import LLM, SamplingParams
    from jaxserve.config import QUANTIZATIONS

    if scheme not in QUANTIZATIONS:
        pytest.skip(f"config.QUANTIZATIONS does not offer {scheme!r} yet (the engine's wiring)")
    path = tiny_model(arch, hidden=128, heads=4, kv_heads=2)
    kw = {"precompile": False, "max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64,
          "num_blocks": 96, "use_tqdm": False}
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs = {}
    base = "q4_1" if scheme == "w4a8" else "none"  # none: float32, whatever this machine's default
    for name in {"none", base, scheme}:
        llm = LLM(path, quantization=name, **kw)
        ids = llm.get_tokenizer().encode(quality_text())[:kw["max_model_len"]]
        logp = text_logprobs(llm.engine.runner, ids)
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        runs[name] = {"llm": llm, "ppl": float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean())),
                      "prompts": [o.prompt_token_ids for o in outs], "tokens": [o.outputs[0].token_ids for o in outs],
                      "bytes": quant_params.weight_bytes(llm.engine.runner.params)}
    ref, got = runs[base], runs[scheme]
    cls, share, ppl_tol, agree = {"bfloat16": (weight_formats.Bf16Weight, 0.55, 0.01, 0.95),
                                  "w8a8": (weight_formats.W8A8Weight, 0.30, 0.02, 0.90),
                                  "w4a8": (weight_formats.W4A8Weight, 0.17, 0.02, 0.90)}[scheme]
    params = got["llm"].engine.runner.params
    kernels = [w for p, w in jax.tree_util.tree_flatten_with_path(params, is_leaf=weight_formats.is_quantized)[0]
               if getattr(p[-1], "key", None) in ("kernel", "embedding")]
    assert kernels and all(isinstance(w, cls) for w in kernels)
    assert got["bytes"] <= share * runs["none"]["bytes"]
    assert abs(got["ppl"] / ref["ppl"] - 1) <= ppl_tol
    assert greedy_agreement(got["llm"].engine.runner, got["prompts"], ref["tokens"]) >= agree


@pytest.mark.skipif(native_build.compiler() is None or platform.machine() not in ("x86_64", "AMD64"),
                    reason="needs an x86 C++ compiler")
@pytest.mark.parametrize("march", ["haswell", "x86-64"])
@pytest.mark.parametrize("source", sorted(p.name for p in native_build.CSRC.glob("*.cc")))
def test_sources_build_for_cpus_without_avx512(tmp_path, march, source):
    """The portable paths compile for an AVX2 (haswell) and a baseline x86-64 CPU: the library is
    built -march=native on the machine that runs it, so these are what such machines get."""
    import subprocess

    from jax import ffi

    # -O0: an intrinsic the target lacks fails at any level (always_inline target mismatch is an
    # error at -O0 too); the attention kernels (then one paged_attention.cc): 5.6 s at -O0, 20 s at
    # -O1, 80 s at -O3 on 2 cores
    flags = [f for f in native_build.FLAGS if f not in ("-march=native", "-shared", "-O3")]
    (tmp_path / "formats.h").write_text(native_build.formats_header())  # generated, as build() does
    cmd = [native_build.compiler(), *flags, "-O0", f"-march={march}", "-c", f"-I{ffi.include_dir()}",
           f"-I{tmp_path}", str(native_build.CSRC / source), "-o", str(tmp_path / "out.o")]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
