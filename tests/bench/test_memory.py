import json


def test_memory_accounts_phases(tiny_model, tmp_path, capsys):
    from bench import memory

    out = tmp_path / "mem.json"
    kw = json.dumps({"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 32, "num_blocks": 32})
    assert memory.main(["--model", tiny_model("llama"), "--no-precompile", "--engine-args", kw, "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    names = [p["phase"] for p in res["phases"]]
    assert names == ["python", "imports", "jax backend", "native code", "tokenizer", "engine", "first token"]
    assert all(p["rss"] > 0 for p in res["phases"]) and res["phases"][-1]["rss"] >= res["phases"][0]["rss"]
    assert res["weight_bytes"] > 0 and res["kv_bytes"] > 0
    assert "Resident memory by start-up phase" in capsys.readouterr().out
