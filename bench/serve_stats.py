"""What a serving run measured (`jaxserve bench serve`, bench/serve.py): each request's result, the
SLOs a request must meet to count as goodput, and a load level's summary (throughput, latency
percentiles, goodput) and its table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bench import common


@dataclass
class RequestResult:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # seconds since the level started
    error: str | None = None

    @property
    def tpot(self) -> float:
        if not self.ok or self.output_tokens < 2:
            return math.nan
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def parse_slo(specs: list[str]) -> dict[str, float]:
    """['ttft:500ms', 'tpot:50ms', 'e2e:10s'] -> {'ttft': 0.5, 'tpot': 0.05, 'e2e': 10.0} (seconds)."""
    out = {}
    for spec in specs:
        for part in spec.replace(",", " ").split():
            key, _, val = part.partition(":")
            key = key.lower()
            if key not in ("ttft", "tpot", "e2e", "itl") or not val:
                raise ValueError(f"Invalid SLO {part!r}: use ttft:500ms, tpot:50ms, itl:100ms or e2e:10s.")
            v = val.lower()
            scale = 1e-3 if v.endswith("ms") else 1.0
            num = v[:-2] if v.endswith("ms") else v.rstrip("s")
            try:
                out[key] = float(num) * scale
            except ValueError:
                raise ValueError(f"Invalid SLO value {val!r} in {part!r}: e.g. 500ms or 2s.") from None
    return out


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    if not r.ok:
        return False
    checks = {"ttft": r.ttft, "tpot": r.tpot if r.output_tokens > 1 else 0.0, "e2e": r.e2e,
              "itl": max(r.itl) if r.itl else 0.0}
    return all(checks[k] <= v for k, v in slo.items())


def summarize(results: list[RequestResult], duration: float, slo: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    ms = lambda xs: {k: (v * 1e3 if k != "n" else v) for k, v in common.summarize(xs).items()}
    good = sum(meets_slo(r, slo) for r in ok) if slo else None
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else math.nan,
        "input_tokens": n_in, "output_tokens": n_out,
        "input_tok_s": n_in / duration if duration else math.nan,
        "output_tok_s": n_out / duration if duration else math.nan,
        "total_tok_s": (n_in + n_out) / duration if duration else math.nan,
        "ttft_ms": ms([r.ttft for r in ok]), "tpot_ms": ms([r.tpot for r in ok if not math.isnan(r.tpot)]),
        "itl_ms": ms([x for r in ok for x in r.itl]), "e2e_ms": ms([r.e2e for r in ok]),
        "goodput_req_s": (good / duration) if good is not None and duration else None,
        "goodput_fraction": (good / len(results)) if good is not None and results else None,
        "slo_s": slo or None, "errors": errors,
    }


def print_level(name: str, s: dict) -> None:
    pairs = [("requests ok / failed", f"{s['completed']} / {s['failed']}"), ("duration s", s["duration_s"]),
             ("request/s", s["request_throughput"]), ("input tok/s", s["input_tok_s"]),
             ("output tok/s", s["output_tok_s"]), ("total tok/s", s["total_tok_s"])]
    if s["goodput_req_s"] is not None:
        pairs.append(("goodput req/s (" + " ".join(f"{k}<={v * 1e3:g}ms" for k, v in s["slo_s"].items()) + ")",
                      f"{s['goodput_req_s']:.2f} ({100 * s['goodput_fraction']:.0f}% of requests)"))
    print(common.kv_table(pairs, f"== {name} =="))
    rows = [(m.upper(), s[f"{m}_ms"]["mean"], s[f"{m}_ms"]["median"], s[f"{m}_ms"]["p90"], s[f"{m}_ms"]["p99"])
            for m in ("ttft", "tpot", "itl", "e2e")]
    print(common.table(rows, ("latency ms", "mean", "median", "p90", "p99")))
    for err, n in list(s["errors"].items())[:5]:
        print(f"  failed x{n}: {err}")
