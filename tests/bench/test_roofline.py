import pytest

from bench import roofline as rl
from jaxserve.model.config import ModelConfig
from jaxserve.runtime import cpu_kernels

SMOLLM2 = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True)


def test_smollm2_costs_match_the_design_notes():
    c = rl.model_costs(SMOLLM2, context=0)
    assert c.params_lm_head == 576 * 49152
    assert c.flops_per_token / 1e9 == pytest.approx(0.269, abs=0.002)  # DESIGN.md: ~0.27 GFLOP/token
    assert c.weight_bytes == pytest.approx(538e6, rel=0.01)
    c512 = rl.model_costs(SMOLLM2, context=512)
    assert c512.flops_attention == 4 * 30 * 9 * 64 * 512
    assert c512.kv_bytes_per_token_ctx == 2 * 30 * 3 * 64 * 512 * 4
    bf16_kv = rl.model_costs(SMOLLM2, context=512, kv_dtype_bytes=2)  # float32 weights, bfloat16 KV
    assert bf16_kv.kv_bytes_per_token_ctx == c512.kv_bytes_per_token_ctx / 2
    assert bf16_kv.weight_bytes == c512.weight_bytes


def test_ceilings_take_the_lower_bound():
    measured = {"matmul_gflops": {"1": 10.0, "64": 135.0, "large": 190.0},
                "memory_gbps": {"read": 20.0, "copy": 30.0}}
    one = rl.ceilings(SMOLLM2, 1, 0, measured)
    assert one["bandwidth_tok_s"] == pytest.approx(30e9 / rl.model_costs(SMOLLM2, 0).weight_bytes)
    assert one["roofline_tok_s"] == min(one["compute_tok_s"], one["bandwidth_tok_s"])
    big = rl.ceilings(SMOLLM2, 64, 0, measured)
    assert big["matmul_gflops"] == 135.0 and big["bound"] == "compute"
    assert big["compute_tok_s"] == pytest.approx(135e9 / (2 * 134479872), rel=1e-6)
    f = rl.fraction(250.0, SMOLLM2, 64, 0, measured)
    long_ctx = [rl.ceilings(SMOLLM2, 64, 4096, measured, kv_dtype_bytes=b)["bandwidth_tok_s"] for b in (4, 2)]
    assert long_ctx[1] > long_ctx[0]  # half the KV bytes per step: a higher bandwidth ceiling
    assert f["fraction_of_roofline"] == pytest.approx(250.0 / big["roofline_tok_s"])
    w = rl.work_fraction(10.0, 1000, 500, SMOLLM2, 64, 0, measured)
    assert 0 < w["fraction_of_compute"] < 1


def test_measure_quick_on_small_shapes():
    tiny = ModelConfig(model_type="llama", vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16)
    m = rl.measure(tiny, batches=(1, 8), quick=True)
    assert set(m["matmul_gflops"]) == {"1", "8", "large"}
    assert all(v > 0 for v in m["matmul_gflops"].values())
    # every precision measured; the ceiling's rate is the fastest of them at each size
    assert set(m["matmul_gflops_by_precision"]) == {"float32", "bfloat16", "int8"}
    for key, best in m["matmul_gflops"].items():
        rates = {p: max(v for v in r[key].values() if v is not None)
                 for p, r in m["matmul_gflops_by_precision"].items()}
        assert best == max(rates.values()) and m["matmul_precision"][key] == max(rates, key=rates.get)
    if cpu_kernels.available() is None:  # on CPU the low precisions are the native dot-product kernels
        assert all(r["native"] > 0 for p in ("bfloat16", "int8") for r in m["matmul_gflops_by_precision"][p].values())
    assert m["memory_gbps"]["read"] > 0 and m["memory_gbps"]["copy"] > 0


def test_cli_writes_json(tiny_model, tmp_path, capsys):
    import json

    assert rl.main(["--model", tiny_model("llama"), "--batch", "1,4", "--quick",
                    "--out", str(tmp_path / "r.json")]) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [c["batch"] for c in doc["results"]["ceilings"]] == [1, 4]
    assert "Ceilings" in capsys.readouterr().out
