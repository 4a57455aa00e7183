import asyncio
import gc

from bench.server_probe import Recorder


def test_recorder_times_collections_and_loop_lag():
    rec = Recorder()
    gc.callbacks.insert(0, rec.on_gc)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(rec.on_gc)

    async def lag_a_little() -> None:
        watch = asyncio.ensure_future(rec.watch_loop())
        await asyncio.sleep(0.05)
        watch.cancel()

    asyncio.run(lag_a_little())
    res = rec.summary(since=0.0)
    assert res["gc"]["gen2"]["n"] >= 1 and res["gc"]["gen2"]["max_cpu_ms"] >= 0
    assert rec.lags and res["worst_loop_lag_ms"]
