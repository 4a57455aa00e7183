"""`jaxserve bench quality --reference transformers`: each format's greedy texts against transformers'
float32 forward (bench/hf_reference.py), in its table and JSON."""

import json


def test_quality_compares_greedy_with_transformers(tiny_model, tmp_path, capsys):
    from bench import quality

    out = tmp_path / "quality.json"
    assert quality.main(["--model", tiny_model("llama"), "--formats", "none,int8", "--kv-cache-dtypes", "",
                         "--max-tokens", "6", "--text-tokens", "48", "--decode-tokens", "2", "--num-blocks", "48",
                         "--reference", "transformers", "--out", str(out)]) == 0
    rows = {r["format"]: r["vs_transformers"] for r in json.loads(out.read_text())["results"]["formats"]}
    # float32 weights and KV (a float32 checkpoint) follow the reference's greedy texts in full
    assert rows["none"] == {"prompts": len(quality.PROMPTS), "exact": len(quality.PROMPTS), "near_ties": [],
                            "far": []}
    # int8 weights: counted against the same texts, each text that parts named with its margin
    seen = rows["int8"]
    assert seen["exact"] + len(seen["near_ties"]) + len(seen["far"]) == len(quality.PROMPTS)
    assert all(m < 0.05 for _, _, m in seen["near_ties"]) and all(m >= 0.05 for _, _, m in seen["far"])
    assert f"{len(quality.PROMPTS)}/{len(quality.PROMPTS)} exact" in capsys.readouterr().out


def test_compare_splits_partings_by_the_reference_margin():
    from bench.hf_reference import compare

    reference = [([1, 2, 3], [0.5, 0.5, 0.5]), ([4, 5, 6], [0.3, 0.01, 0.3]), ([7, 8], [0.2, 0.4])]
    seen = compare([[1, 2, 3], [4, 9, 9], [7, 0]], reference)
    assert seen == {"prompts": 3, "exact": 1, "near_ties": [(1, 1, 0.01)], "far": [(2, 1, 0.4)]}
