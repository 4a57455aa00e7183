"""`jaxserve bench tails_pairs`: vllm_tails files read as pairs, wins counted per figure, the sign test."""

import json

import pytest

from bench import tails_pairs


def run(engine, dataset, ttft_s, itl_ms, tok_s, goodput=1.0, link=(60.0, 400.0)):
    return {"engine": engine, "dataset": dataset, "failed": 0, "p99_ttft_ms": ttft_s * 1e3, "p99_itl_ms": itl_ms,
            "output_throughput": tok_s, "request_goodput": goodput, "core_link_ns_before": link[0],
            "core_link_ns_after": link[1]}


def write(path, runs):
    path.write_text(json.dumps({"results": {"runs": runs}}))
    return str(path)


def test_sign_test():
    assert tails_pairs.sign_test_p(3, 3) == pytest.approx(1 / 8)
    assert tails_pairs.sign_test_p(0, 3) == 1.0
    assert tails_pairs.sign_test_p(13, 16) == pytest.approx((560 + 120 + 16 + 1) / 2**16)


def test_pairs_summary_and_report(tmp_path, capsys):
    files = [
        write(tmp_path / "p1.json", [run("jaxserve", "random", 3.6, 60, 440), run("vllm", "random", 4.0, 200, 360)]),
        write(tmp_path / "p2.json", [run("vllm", "random", 4.0, 210, 350), run("jaxserve", "random", 4.3, 70, 390)]),
        write(tmp_path / "p3.json", [run("jaxserve", "random", 3.9, 65, 420), run("vllm", "random", 3.9, 190, 340)]),
        write(tmp_path / "only_one.json", [run("jaxserve", "random", 9.0, 900, 10)]),  # not a pair: left out
    ]
    out = tmp_path / "summary.json"
    assert tails_pairs.main([*files, "--datasets", "random", "--out", str(out)]) == 0
    summary = {s["figure"]: s for s in json.loads(out.read_text())["results"]["summary"]}
    ttft = summary["P99 TTFT ms"]
    assert (ttft["pairs"], ttft["wins"]) == (3, 2)  # p3's tie counts as "at least as good"
    assert ttft["median_diff"] == pytest.approx(-0.0)
    assert ttft["sign_test_p"] == pytest.approx(0.5)
    itl, tok = summary["P99 ITL ms"], summary["out tok/s"]
    assert (itl["wins"], itl["median_diff"]) == (3, -140)
    assert (tok["wins"], tok["median_diff"]) == (3, 80)
    printed = capsys.readouterr().out
    assert "3 pairs, jaxserve against vllm" in printed and " nf |" in printed


def test_no_pairs_is_an_error(tmp_path):
    lone = write(tmp_path / "lone.json", [run("vllm", "random", 4.0, 200, 360)])
    with pytest.raises(SystemExit, match="both jaxserve and vllm"):
        tails_pairs.main([lone])
