"""bench/sim_replicas.py: N simulated replicas (real schedulers and caches) behind three routers."""

from bench.sim import main as sim_main
from bench.sim_replicas import conversation_trace, simulate_replicas


def test_cache_aware_keeps_conversations_home_round_robin_scatters_them():
    convs = conversation_trace(6, 5, 200, 10, 4, seed=3)
    one = simulate_replicas(convs, 1, "round_robin", concurrency=1)
    rr = simulate_replicas(convs, 3, "round_robin", concurrency=1)
    ca = simulate_replicas(convs, 3, "cache_aware", concurrency=1)
    ll = simulate_replicas(convs, 3, "least_load", concurrency=1)
    assert all(len(set(turns)) == 1 for turns in ca["landed"])  # each conversation stays home
    assert len({turns[0] for turns in ca["landed"]}) == 3  # and new ones spread over the replicas
    assert [i for turns in rr["landed"] for i in turns] == [k % 3 for k in range(30)]
    assert ca["hit_tokens"] == one["hit_tokens"] >= 2 * rr["hit_tokens"] > 0
    assert ll["landed"][0] == [0] * 5  # one conversation at a time: the idle replica 0 every time
    assert ca["query_tokens"] == rr["query_tokens"]  # same trace, same prompts


def test_cli_table(capsys):
    assert sim_main(["--replicas", "2", "--conversations", "4", "--turns", "3", "--system-tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert "cache_aware" in out and "round_robin" in out and "least_load" in out
