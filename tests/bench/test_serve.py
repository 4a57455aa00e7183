import json
import math

import pytest

from bench import launch, serve, serve_stats


def test_parse_slo_and_goodput():
    assert serve_stats.parse_slo(["ttft:500ms", "tpot:50ms", "e2e:2s"]) == {"ttft": 0.5, "tpot": 0.05, "e2e": 2.0}
    with pytest.raises(ValueError):
        serve_stats.parse_slo(["foo:1s"])
    fast = serve_stats.RequestResult(ok=True, output_tokens=11, ttft=0.1, e2e=0.6, itl=[0.05] * 10)
    slow = serve_stats.RequestResult(ok=True, output_tokens=11, ttft=0.9, e2e=1.4)
    assert fast.tpot == pytest.approx(0.05)
    slo = serve_stats.parse_slo(["ttft:500ms", "tpot:60ms"])
    s = serve_stats.summarize([fast, slow, serve_stats.RequestResult(error="x")], 2.0, slo)
    assert s["completed"] == 2 and s["failed"] == 1 and s["goodput_req_s"] == pytest.approx(0.5)
    assert s["output_tok_s"] == pytest.approx(11) and s["ttft_ms"]["median"] == pytest.approx(500)


def test_levels():
    a = serve.build_parser().parse_args(["--concurrency", "1,8"])
    assert [lv.concurrency for lv in serve._levels(a)] == [1, 8]
    b = serve.build_parser().parse_args(["--request-rate", "2,inf"])
    assert [lv.rate for lv in serve._levels(b)] == [2.0, math.inf]


def test_against_a_real_server(bench_server, tiny_model, tmp_path, capsys):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    rc = serve.main(["--base-url", bench_server, "--model", tiny_model("llama"), "--prompt-len", "8,40",
                     "--output-len", "3,10", "--max-model-len", "256", "--num-requests", "6",
                     "--concurrency", "1,3", "--slo", "ttft:10s", "tpot:1s", "--plot", str(png),
                     "--out", str(out), "--save-requests"])
    assert rc == 0
    doc = json.loads(out.read_text())
    levels = doc["results"]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 3]
    for lv in levels:
        s = lv["summary"]
        assert s["completed"] == 6 and s["failed"] == 0 and s["goodput_fraction"] == 1.0
        wanted = sum(r["output_tokens"] for r in lv["requests"])
        assert s["output_tokens"] == wanted > 0 and s["ttft_ms"]["p99"] > 0
    assert png.stat().st_size > 10_000
    assert "Summary" in capsys.readouterr().out


def test_poisson_rate_and_jsonl(bench_server, tmp_path):
    ds = tmp_path / "d.jsonl"
    ds.write_text('{"prompt": "Hello there", "max_tokens": 4}\n{"prompt": [5, 6, 7], "max_tokens": 3}\n')
    out = tmp_path / "s.json"
    assert serve.main(["--base-url", bench_server, "--dataset", str(ds), "--request-rate", "50",
                       "--num-requests", "4", "--warmup", "0", "--out", str(out)]) == 0
    s = json.loads(out.read_text())["results"]["levels"][0]["summary"]
    assert s["completed"] == 4 and s["output_tokens"] == 4 + 3 + 4 + 3


def test_unreachable_server_counts_failures(tiny_model, tmp_path):
    ds = tmp_path / "d.jsonl"
    ds.write_text('{"prompt": [5, 6, 7], "max_tokens": 3}\n')
    port = launch.free_port()
    assert serve.main(["--base-url", f"http://127.0.0.1:{port}", "--served-model-name", "m", "--dataset", str(ds),
                       "--num-requests", "2", "--warmup", "0", "--concurrency", "2"]) == 1


@pytest.mark.parametrize("kind", ["conversations", "agent_session"])
def test_conversation_traces_feed_answers_back(bench_server, tmp_path, kind):
    from bench import conversations

    convs = conversations.make(kind, 3, 2, system_words=6, user_words=2, seed=1)
    assert len({c.prefix + c.system for c in convs}) == (3 if kind == "conversations" else 1)
    out = tmp_path / "c.json"
    assert serve.main(["--base-url", bench_server, "--dataset", kind, "--num-conversations", "3", "--turns", "2",
                       "--system-words", "6", "--user-words", "2", "--max-tokens", "3", "--concurrency", "2",
                       "--slo", "ttft:30s", "--out", str(out)]) == 0
    s = json.loads(out.read_text())["results"]["levels"][0]["summary"]
    assert s["completed"] == 6 and s["failed"] == 0 and s["goodput_fraction"] == 1.0
    assert s["output_tokens"] == 6 * 3


def test_conversation_prompt_is_the_history():
    from bench.conversations import Conversation

    c = Conversation("S.", ["hi", "more"], answers=["yo"])
    assert c.prompt(0) == "S.\nUser: hi\nAssistant:"
    assert c.prompt(1) == "S.\nUser: hi\nAssistant: yo\nUser: more\nAssistant:"
