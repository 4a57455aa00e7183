import json


def test_startup_cold_run(tiny_model, tmp_path, capsys):
    from bench import startup

    out = tmp_path / "st.json"
    kw = json.dumps({"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 32, "num_blocks": 32})
    assert startup.main(["--model", tiny_model("llama"), "--repeats", "0", "--no-precompile",
                         "--engine-args", kw, "--out", str(out)]) == 0
    cold = json.loads(out.read_text())["results"]["cold"]
    assert cold["total_s"] >= cold["first_token_s"] > 0 and cold["compiles"] >= 1
    assert "Start-up to first token" in capsys.readouterr().out
