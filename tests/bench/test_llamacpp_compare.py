"""`jaxserve bench llamacpp_compare` without llama-cpp-python: llama.cpp reported as not installed,
jaxserve's half measured (on the tiny model quantized to Q4_1 at load, to keep the test short: the
bench itself runs on the default model's GGUF file)."""

from __future__ import annotations

import json

from bench import llamacpp_compare


def test_jaxserve_half_runs_and_llamacpp_is_reported_missing(tmp_path, capsys, tiny_model):
    out = tmp_path / "r.json"
    assert llamacpp_compare.main(["--model", tiny_model("llama"), "--llamacpp-python", "", "--formats", "q4_1",
                                  "--tokens", "3", "--rounds", "2", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    rates = results["rates"]
    assert len(rates["jaxserve q4_1"]) == 2 and all(r > 0 for r in rates["jaxserve q4_1"])
    try:
        import llama_cpp  # noqa: F401  (in this interpreter: then it is measured, not missing)

        assert any(name.startswith("llama.cpp") for name in rates)
    except ImportError:
        assert results["llamacpp"].startswith("llama-cpp-python not installed") and len(rates) == 1
        assert "not installed" in capsys.readouterr().out
