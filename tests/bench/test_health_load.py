import json

from bench import health_load


def test_phases_split_the_probes():
    streams = [
        health_load.Stream(start=10.0, first=11.0, end=12.0),
        health_load.Stream(start=10.0, first=11.5, end=13.0),
    ]
    rows = [(t, 0.001, 200) for t in (9.0, 10.5, 11.2, 11.6, 12.5, 13.5)]
    got = {k: [r[0] for r in v] for k, v in health_load.phases(rows, streams, 10.0).items()}
    assert got == {
        "idle": [9.0],
        "arrival": [10.5, 11.2],
        "streaming": [11.6, 12.5],
        "after": [13.5],
    }


def test_against_a_real_server(bench_server, tmp_path, capsys):
    out = tmp_path / "h.json"
    rc = health_load.main(
        [
            "--base-url",
            bench_server,
            "--num-streams",
            "12",
            "--max-tokens",
            "5",
            "--idle-seconds",
            "0.3",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    assert res["failures"] == 0
    assert res["engine_after"] == {"running": 0, "waiting": 0, "kv_cache_usage_perc": 0}
    probes = res["health_ms"]
    assert probes["idle"]["n"] > 0 and probes["after"]["n"] > 0
    assert sum(p["non_200"] for p in probes.values()) == 0
    assert "/health latency" in capsys.readouterr().out
