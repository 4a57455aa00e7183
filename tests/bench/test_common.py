import math

import pytest

from bench import common


def test_percentiles_match_numpy():
    import numpy as np

    xs = [5.0, 1.0, 3.0, 2.0, 4.0, 10.0]
    for p in (0, 50, 90, 99, 100):
        assert common.percentile(xs, p) == pytest.approx(np.percentile(xs, p))
    s = common.summarize(xs)
    assert s["mean"] == pytest.approx(25 / 6) and s["median"] == pytest.approx(3.5) and s["n"] == 6
    assert math.isnan(common.summarize([])["p99"])


def test_table_aligns_and_formats():
    t = common.table([("a", 1234, 0.5), ("bb", 2, float("nan"))], ("name", "n", "x"), "T")
    lines = t.strip().splitlines()
    assert lines[0] == "T" and "1,234" in t and "| -" not in lines[2]
    assert len({len(ln) for ln in lines[1:]}) == 1  # every row the same width


def test_mixed_workload_is_seeded_and_avoids_special_tokens():
    special = {0, 1, 2}
    a = common.mixed_workload(64, 0, 100, special)
    assert a == common.mixed_workload(64, 0, 100, special)
    assert a != common.mixed_workload(64, 1, 100, special)
    assert len(a) == 64
    assert all(20 <= len(p) <= 400 and 16 <= m <= 256 for p, m in a)
    assert not any(t in special or not 0 <= t < 100 for p, _ in a for t in p)


def test_workload_items_clip_to_context_and_replace_specials():
    items, clipped = common.workload_items("agent_tree", 20, 0, 50, {0, 7}, max_model_len=128)
    assert len(items) == 20 and clipped > 0
    for p, m, t in items:
        assert len(p) + m < 128 and t >= 0
        assert 0 not in p and 7 not in p
    with pytest.raises(ValueError, match="Unknown workload"):
        common.workload_items("nope", 1, 0, 50)


def test_machine_info_and_report(tmp_path):
    import json

    doc = common.report("x", ["--a", "b c"], model={"name": "m"}, config={}, results={"v": 1.5},
                        out=tmp_path / "r.json", jax_devices=False)
    on_disk = json.loads((tmp_path / "r.json").read_text())
    assert on_disk["command"] == "jaxserve bench x --a 'b c'" == doc["command"]
    assert on_disk["machine"]["cpu_count"] >= 1 and on_disk["results"]["v"] == 1.5


def test_sampler_bench_runs(tmp_path, capsys):
    import json

    from bench import sampler

    out = tmp_path / "s.json"
    assert sampler.main(["--rows", "4", "--vocab", "1000", "--repeats", "1", "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["results"]["cases"]
    assert [c["case"] for c in cases][:3] == ["greedy", "greedy, logprobs 5", "temperature 0.7"]
    assert all(c["ms"] > 0 for c in cases)
    assert "Sampler, 4 rows" in capsys.readouterr().out
