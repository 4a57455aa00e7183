def test_hf_counts_only_wanted_tokens(tiny_model):
    from bench import hf_baseline

    model, _ = hf_baseline.load_hf_model(tiny_model("llama"))
    reqs = [([5, 6, 7, 8, 9], 3), ([10, 11], 6), ([12, 13, 14], 2)]
    res = hf_baseline.run(model, reqs, batch_size=2, single_prompt=[5, 6, 7], single_tokens=5,
                          single_repeats=1, log=lambda *a: None)
    assert res["single"]["output_tokens"] == 11 and res["batched"]["output_tokens"] == 11
    assert res["batched"]["generated_tokens"] == 2 * 6 + 1 * 2  # padded rows do the batch's max
    assert res["single_decode"]["decode_tok_s"] > 0
    assert res["best_output_tok_s"] == max(res["single"]["output_tok_s"], res["batched"]["output_tok_s"])


def test_hf_cli(tiny_model, tmp_path):
    import json

    from bench import hf_baseline

    out = tmp_path / "hf.json"
    assert hf_baseline.main(["--model", tiny_model("llama"), "--num-prompts", "3", "--prompt-len", "5,10",
                             "--output-len", "2,4", "--batch-size", "2", "--single-tokens", "4", "--quiet",
                             "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["results"]["batched"]["requests"] == 3 and doc["machine"]["torch_threads"] >= 1
