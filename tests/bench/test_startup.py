import json


def test_startup_cold_run(tiny_model, tmp_path, capsys):
    from bench import startup

    out = tmp_path / "st.json"
    kw = json.dumps({"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 32, "num_blocks": 32})
    assert startup.main(["--mode", "llm", "--model", tiny_model("llama"), "--repeats", "0", "--no-precompile",
                         "--warm-kernels", "--engine-args", kw, "--out", str(out)]) == 0
    cold = json.loads(out.read_text())["results"]["cold"]
    phases = [name for name, _, _ in cold["phases"]]  # the child's marks (jaxserve/startup_trace.py)
    assert phases[0] == "imports" and phases[-1] == "first token" and {"tokenizer", "engine"} <= set(phases)
    assert cold["total_s"] > 0 and cold["compiles"] >= 1
    assert "Start-up to first token" in capsys.readouterr().out
