"""Each test module's seconds from a pytest junit XML; writes tests/module_seconds.json.

    python -m pytest -q -n 2 --dist loadgroup --junitxml=/tmp/suite.xml
    python tools/suite_seconds.py /tmp/suite.xml [--top 30]

tests/conftest.py hands xdist's workers the modules longest first by these figures. The table it
prints (module, seconds, tests) is the one bench/RESULTS.md keeps for the suite's time.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "module_seconds.json"


def module_of(classname: str) -> str | None:
    """'tests.server.test_errors.TestX' -> 'tests/server/test_errors.py' (the longest prefix that is a file)."""
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):
        path = Path(*parts[:n]).with_suffix(".py")
        if (ROOT / path).is_file():
            return path.as_posix()
    return None


def module_seconds(xml: Path) -> dict[str, tuple[float, int]]:
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for case in ET.parse(xml).getroot().iter("testcase"):
        module = module_of(case.get("classname", ""))
        if module:
            totals[module][0] += float(case.get("time", 0) or 0)
            totals[module][1] += 1
    return {m: (round(s, 1), n) for m, (s, n) in totals.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("junit_xml", type=Path)
    ap.add_argument("--top", type=int, default=30, help="rows of the printed table")
    ap.add_argument("--no-write", action="store_true", help="print only; leave tests/module_seconds.json")
    args = ap.parse_args()
    found = module_seconds(args.junit_xml)
    rows = sorted(found.items(), key=lambda kv: -kv[1][0])
    total = sum(s for s, _ in found.values())
    print(f"{len(found)} modules, {sum(n for _, n in found.values())} tests, {total:.0f} s over all workers\n")
    print("| s | tests | module |\n|--:|--:|---|")
    for module, (s, n) in rows[:args.top]:
        print(f"| {s:.0f} | {n} | {module} |")
    if not args.no_write:
        OUT.write_text(json.dumps({m: s for m, (s, _) in rows}, indent=0) + "\n")
        print(f"\nwrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
