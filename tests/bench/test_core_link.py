"""bench/core_link.py: the vCPUs' placement probe that benchmark runs record."""

import os

import pytest

from bench import core_link


def test_placement_names():
    assert core_link.placement(None) == "?"
    assert core_link.placement(52.0) == "near"
    assert core_link.placement(350.0) == "far"


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")
def test_round_trip_is_measured():
    ns = core_link.round_trip_ns()
    # a line's round trip between two cores: tens to a few thousand ns, never zero
    assert ns is not None and 5 < ns < 1e5


def test_cli_prints_a_placement(capsys):
    assert core_link.main(["1"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.endswith(("(near)", "(far)", "(?)")), line
