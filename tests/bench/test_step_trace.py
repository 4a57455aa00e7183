"""The step trace (JAXSERVE_STEP_TRACE) and its table: gaps, idle resets, groups, GC outside steps."""

from collections import namedtuple

from bench import step_trace as table
from jaxserve.step_trace import StepTrace

Key = namedtuple("Key", "t s")


def test_trace_rows_and_summary(tmp_path):
    path = tmp_path / "steps.jsonl"
    tr = StepTrace(str(path))
    common = dict(dispatched=0.0, host_s=0.001, prefill_cap=None, running=2, waiting=0)
    tr.record(step=0, key=Key(64, 8), prefill=50, decode=0, **common)  # first: no gap
    for i in range(1, 5):
        tr.record(step=i, key=Key(8, 8), prefill=0, decode=2, **common)
    tr.record(step=5, key=Key(512, 8), prefill=300, decode=2, **common)
    tr.idle()
    tr.record(step=6, key=Key(8, 8), prefill=0, decode=1, **common)  # after idle: no gap
    tr.close()
    rows = table.load(str(path))
    assert [r["gap_s"] is None for r in rows] == [True, False, False, False, False, False, True]
    assert [r["new_bucket"] for r in rows] == [True, True, False, False, False, True, False]
    s = table.summarize(rows)
    assert s["timed_steps"] == 5
    assert [(g["prefill"], g["steps"], g["decode_rows"]) for g in s["groups"]] == [("0", 4, 8), ("257-512", 1, 2)]
    assert s["slowest"][0]["step"] in range(1, 6)
    table.show(s)
