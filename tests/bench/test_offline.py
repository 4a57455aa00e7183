import json

from tests.bench.conftest import ENGINE_ARGS

SMALL = ["--num-prompts", "4", "--prompt-len", "8,40", "--output-len", "3,12", "--single-tokens", "8",
         "--single-repeats", "1", *ENGINE_ARGS]


def test_offline_mixed_counts_every_token(tiny_model, tmp_path, capsys):
    from bench import offline

    out = tmp_path / "off.json"
    assert offline.main(["--model", tiny_model("llama"), "--no-roofline", "--step-profile", "--out", str(out),
                         *SMALL]) == 0
    doc = json.loads(out.read_text())
    r = doc["results"]["workloads"]["mixed"]
    assert r["requests"] == 4 and r["output_tokens"] == r["wanted_output_tokens"]  # ignore_eos: fixed lengths
    # the profile run schedules like the timed one: same steps, every prompt and output token once
    prof = r["step_profile"]
    assert sum(b["steps"] for b in prof) == r["steps"]
    assert sum(b["real_tokens"] for b in prof) == r["computed_tokens"]
    assert r["output_tok_s"] > 0 and r["compile_s"] > 0 and r["compiles_during_run"] == 0
    single = doc["results"]["single_request"]
    assert single["new_tokens"] == 8 and single["decode_tok_s"] > 0
    assert doc["command"].startswith("jaxserve bench offline") and doc["machine"]["cpu_count"] >= 1
    printed = capsys.readouterr().out
    assert "jaxserve offline" in printed and "time per step bucket" in printed


def test_offline_simulator_workload_with_roofline(tiny_model, tmp_path):
    from bench import offline

    rl_json = tmp_path / "rl.json"
    rl_json.write_text(json.dumps({"results": {"measured": {
        "matmul_gflops": {"1": 1.0, "8": 5.0, "large": 10.0}, "memory_gbps": {"read": 5.0, "copy": 5.0}}}}))
    out = tmp_path / "off.json"
    args = ["--model", tiny_model("llama"), "--workload", "multi_turn_chat", "--single-tokens", "0",
            "--roofline-json", str(rl_json), "--out", str(out), *SMALL]
    assert offline.main(args) == 0
    r = json.loads(out.read_text())["results"]["workloads"]["multi_turn_chat"]
    assert r["requests"] == 4 and r["roofline"]["fraction_of_roofline"] > 0
    assert r["prefix_cache_hit_blocks"] >= 0
