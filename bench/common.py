"""Helpers shared by the benchmark tools: percentiles, tables, JSON with machine facts, prompts.

Every tool writes one JSON document: {"benchmark", "command", "machine", "model", "config", "results"}.
`machine_info()` records what the numbers depend on (CPU, core count, load, jax/torch versions,
git commit), so a figure can be traced back to where and how it was measured.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import shlex
import signal
import subprocess
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# ---- statistics ------------------------------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default), p in [0, 100]; nan for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, all threads (a compile's cost, whatever the load)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def median_seconds(fn, *args, repeats: int) -> float:
    """Median wall time of fn(*args) over `repeats` synced calls, after one warm-up call."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def summarize(values: Sequence[float], percentiles: Iterable[float] = (50, 90, 99)) -> dict:
    """{"mean", "median", "p90", "p99", "min", "max", "n"} (nan when empty)."""
    xs = [float(v) for v in values]
    out = {"n": len(xs), "mean": sum(xs) / len(xs) if xs else math.nan}
    for p in percentiles:
        out["median" if p == 50 else f"p{p:g}"] = percentile(xs, p)
    out["min"] = min(xs) if xs else math.nan
    out["max"] = max(xs) if xs else math.nan
    return out


# ---- output ----------------------------------------------------------------------------------------
def fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if v != 0 and abs(v) < 10 ** -digits:
            return f"{v:.2g}"
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table(rows: Sequence[Sequence], headers: Sequence[str], title: str | None = None) -> str:
    """A plain-text table (right-aligned numbers); also valid Markdown."""
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = lambda cs: "| " + " | ".join(c.rjust(w) if i else c.ljust(w)
                                        for i, (c, w) in enumerate(zip(cs, widths))) + " |"
    out = [f"\n{title}"] if title else []
    out.append(line(headers))
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def kv_table(pairs: Sequence[tuple[str, object]], title: str | None = None) -> str:
    return table([(k, v) for k, v in pairs], ("metric", "value"), title)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=False)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=False).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(jax_devices: bool = True) -> dict:
    """Where the numbers come from. Imports jax only when asked (and already cheap if imported)."""
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "git_commit": _git_commit(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    if jax_devices:
        try:
            import jax

            info["jax"] = jax.__version__
            info["jax_backend"] = jax.default_backend()
            info["devices"] = [str(d.device_kind) for d in jax.devices()]
        except Exception as e:  # noqa: BLE001 - informational only
            info["jax"] = f"unavailable: {e}"
    if "torch" in sys.modules:
        info["torch"] = sys.modules["torch"].__version__
        info["torch_threads"] = sys.modules["torch"].get_num_threads()
    xla = os.environ.get("XLA_FLAGS")
    if xla:
        info["XLA_FLAGS"] = xla
    return info


def command_line(name: str, argv: Sequence[str] | None) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    return "jaxserve bench " + name + ("" if not args else " " + shlex.join(args))


def write_json(path: str | os.PathLike | None, doc: dict) -> None:
    if not path:
        return
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=2, default=_json_default) + "\n")
    print(f"\nwrote {p}")


def _json_default(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "_asdict"):
        return o._asdict()
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    return str(o)


def report(benchmark: str, argv, *, model: dict, config: dict, results: dict, out: str | None,
           jax_devices: bool = True) -> dict:
    doc = {"benchmark": benchmark, "command": command_line(benchmark, argv), "machine": machine_info(jax_devices),
           "model": model, "config": config, "results": results}
    write_json(out, doc)
    return doc


# ---- models and prompts -------------------------------------------------------------------------
def model_info(loaded_or_path, config=None) -> dict:
    """{"name", "path", architecture numbers} from a LoadedModel (or a path + ModelConfig)."""
    if config is None:
        name, path, config = loaded_or_path.name, str(loaded_or_path.path), loaded_or_path.config
    else:
        name, path = Path(str(loaded_or_path)).name, str(loaded_or_path)
    return {"name": name, "path": path, "model_type": config.model_type, "layers": config.num_layers,
            "hidden": config.hidden_size, "heads": config.num_heads, "kv_heads": config.num_kv_heads,
            "vocab": config.vocab_size, "tied_embeddings": config.tie_word_embeddings}


def ordinary_token_ids(vocab_size: int, special_ids: Iterable[int] = ()) -> list[int]:
    """Token ids a random prompt may use: the vocabulary minus special (control) tokens."""
    special = {int(t) for t in special_ids}
    return [t for t in range(vocab_size) if t not in special]


def clean_prompt(ids: Sequence[int], allowed: Sequence[int], special: set[int]) -> list[int]:
    """Replace special token ids (which the workload generators may draw) by ordinary ones, deterministically."""
    n = len(allowed)
    return [t if t not in special else allowed[(t * 2654435761) % n] for t in ids]


def mixed_workload(num_prompts: int = 64, seed: int = 0, vocab_size: int = 32000, special_ids: Iterable[int] = (),
                   prompt_len: tuple[int, int] = (20, 400), output_len: tuple[int, int] = (16, 256)
                   ) -> list[tuple[list[int], int]]:
    """The issue-2 workload: `num_prompts` prompts of uniformly random lengths and outputs (fixed seed).

    Token ids are drawn uniformly from the vocabulary without its special tokens. Run with
    ignore_eos so every request generates exactly its wanted number of tokens.
    """
    rng = random.Random(seed)
    allowed = ordinary_token_ids(vocab_size, special_ids)
    out = []
    for _ in range(num_prompts):
        n = rng.randint(*prompt_len)
        out.append(([allowed[rng.randrange(len(allowed))] for _ in range(n)], rng.randint(*output_len)))
    return out


WORKLOAD_NAMES = ("mixed", "prefill_heavy", "decode_heavy", "agent_tree", "multi_turn_chat", "no_sharing")


def workload_items(name: str, num_requests: int, seed: int, vocab_size: int, special_ids: Iterable[int] = (),
                   max_model_len: int | None = None, prompt_len=(20, 400), output_len=(16, 256)
                   ) -> tuple[list[tuple[list[int], int, float]], int]:
    """[(prompt_ids, max_tokens, arrival_time_s)] for a named workload, plus how many prompts were clipped.

    "mixed" is the issue-2 workload (arrival 0 for all); the others come from bench/workloads.py with
    special token ids replaced by ordinary ones. Prompts too long for `max_model_len` lose their
    oldest tokens (keeping the last ones), and max_tokens is cut to fit.
    """
    special = {int(t) for t in special_ids}
    if name == "mixed":
        items = [(p, m, 0.0) for p, m in mixed_workload(num_requests, seed, vocab_size, special, prompt_len,
                                                          output_len)]
    else:
        from bench.workloads import WORKLOADS

        if name not in WORKLOADS:
            raise ValueError(f"Unknown workload {name!r}: choose one of {', '.join(WORKLOAD_NAMES)}.")
        allowed = ordinary_token_ids(vocab_size, special)
        items = [(clean_prompt(w.prompt_token_ids, allowed, special), int(w.max_tokens), float(w.arrival_time))
                 for w in WORKLOADS[name](num_requests=num_requests, seed=seed, vocab_size=vocab_size)]
    clipped = 0
    if max_model_len:
        fitted = []
        for p, m, t in items:
            m = min(m, max(1, max_model_len // 4)) if len(p) + m >= max_model_len else m
            room = max_model_len - m - 1
            if len(p) > room:
                p, clipped = p[-room:], clipped + 1
            fitted.append((p, m, t))
        items = fitted
    return items, clipped


def special_token_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    ids |= set(getattr(tokenizer, "eos_token_ids", ()) or ())
    return {int(t) for t in ids}


def load_tokenizer(model: str | None):
    """jaxserve's Tokenizer for a model argument (None = the default model), without loading weights."""
    from jaxserve.model.loader import resolve_model_path
    from jaxserve.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(resolve_model_path(model))


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log_tail=lambda: "") -> float:
    """Poll `url`/health until it answers 200; fail fast if the server process exits. Returns seconds waited."""
    import httpx

    t0 = time.perf_counter()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server ({shlex.join(map(str, proc.args))}) exited with code "
                               f"{proc.returncode}:\n{log_tail()}")
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"the server ({shlex.join(map(str, proc.args))}) not healthy after "
                               f"{timeout:.0f} s:\n{log_tail()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.05)


def stop_server(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM (the server drains), then kill if it does not exit in time."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
