"""bench tails_sim: vllm_tails' closed loop through the real scheduler; what the burst policy does."""

from bench.tails_sim import simulate


def test_burst_prefill_first_trades_the_chunk_step_gaps_for_one_wait_per_stream():
    kw = dict(num_prompts=64, concurrency=32, output_len=128, budget=512, cost=(0.03, 2e-4, 2.5e-4), seed=0)
    off = simulate("random", burst_prefill_first=False, **kw)
    on = simulate("random", burst_prefill_first=True, **kw)
    decode_step_ms = 1e3 * (0.03 + 32 * 2.5e-4)
    # off: streams decode beside the burst's 512-token chunk steps, over 1% of the gaps
    assert off["itl_p99_ms"] > 2 * decode_step_ms
    # on: each stream waits once, for the burst (under 1% of 64 x 127 gaps), then decodes steadily
    assert on["itl_p99_ms"] <= decode_step_ms + 1e-6
    assert on["itl_max_ms"] > off["itl_max_ms"]
    assert on["ttft_p99_s"] <= off["ttft_p99_s"] + 1e-9
