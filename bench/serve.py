"""`jaxserve bench serve`: a load generator for any OpenAI-compatible completions endpoint.

Sends streaming /v1/completions requests (prompts as token ids, greedy, ignore_eos, usage in the
last chunk) and reports, per load level, as vLLM's and SGLang's serving benchmarks do:
requests ok/failed, request/s, input/output tok/s, TTFT / TPOT / ITL / E2E latency (mean, median,
p90, p99) and goodput under SLOs.

Load: `--concurrency N` (closed loop: N requests in flight), and/or `--request-rate R` (Poisson
arrivals, R req/s; `inf` = all at once; `workload` = the workload's own arrival times times
--time-scale). Several levels, comma-separated (`--concurrency 1,8,32`), run one after another.
Bounds: `--num-requests` per level, and/or `--duration` seconds (the dataset repeats if needed).

Datasets: `--dataset mixed|prefill_heavy|decode_heavy|agent_tree|multi_turn_chat|no_sharing`
(bench/workloads.py, token ids from --model's vocabulary without special tokens), or a JSONL file
with one request a line: {"prompt": "text" or [ids], "max_tokens": n}.

Definitions: TTFT = request sent -> first chunk with text; ITL = time between text chunks;
TPOT = (E2E - TTFT) / (output tokens - 1); output tokens from the final usage chunk (else the
number of text chunks). Goodput = requests/s that met every SLO (`--slo ttft:500ms tpot:50ms e2e:10s`).

    jaxserve bench serve --launch [--concurrency 1,8,32] [--num-requests 64] [--plot lat.png] [--out f.json]
    jaxserve bench serve --base-url http://127.0.0.1:8000 --request-rate 4 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass

from bench import common, conversations
from bench.launch import launched_server
from bench.serve_stats import RequestResult, parse_slo, print_level, summarize


# ---- one request --------------------------------------------------------------------------------
async def send_request(client, url: str, payload: dict, headers: dict, t_level: float, keep_text: bool = False):
    """One streamed request -> RequestResult (and, with keep_text, the text it streamed)."""
    r = RequestResult(start=time.perf_counter() - t_level)
    pieces: list[str] = []
    if keep_text:
        return r, await _stream(client, url, payload, headers, r, pieces) or "".join(pieces)
    await _stream(client, url, payload, headers, r, pieces)
    return r


async def _stream(client, url: str, payload: dict, headers: dict, r: RequestResult, pieces: list[str]) -> None:
    prompt = payload["prompt"]
    r.prompt_tokens = len(prompt) if isinstance(prompt, list) else 0
    chunks = 0
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                r.error = f"HTTP {resp.status_code}: {body[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    r.error = str(msg["error"])[:200]
                    return
                now = time.perf_counter()
                for ch in msg.get("choices") or ():
                    text = ch.get("text")
                    if text is None:
                        text = (ch.get("delta") or {}).get("content")
                    if text:
                        pieces.append(text)
                        chunks += 1
                        if last is None:
                            r.ttft = now - t0
                        else:
                            r.itl.append(now - last)
                        last = now
                usage = msg.get("usage")
                if usage:
                    r.output_tokens = int(usage.get("completion_tokens") or 0)
                    r.prompt_tokens = int(usage.get("prompt_tokens") or r.prompt_tokens)
        r.e2e = time.perf_counter() - t0
        if not r.output_tokens:
            r.output_tokens = chunks
        if last is None:
            r.error = "no text in the stream"
            return
        r.ok = True
    except Exception as e:  # noqa: BLE001 - any transport failure counts as a failed request
        r.error = f"{type(e).__name__}: {e}"[:200]
    return


# ---- one load level -----------------------------------------------------------------------------
@dataclass
class Level:
    concurrency: int | None  # None: unbounded
    rate: float | str | None  # req/s, inf, "workload", or None (closed loop)

    @property
    def name(self) -> str:
        parts = []
        if self.concurrency:
            parts.append(f"c={self.concurrency}")
        if self.rate is not None:
            parts.append(f"rate={self.rate}")
        return " ".join(parts) or "all at once"


async def run_level(base_url: str, model: str, items, level: Level, args, headers: dict) -> tuple[list, float]:
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=max(level.concurrency or 0, 256), max_keepalive_connections=256)
    timeout = httpx.Timeout(args.request_timeout, connect=30)
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(level.concurrency) if level.concurrency else None
    results: list[RequestResult] = []

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t_level = time.perf_counter()

        async def one(prompt, max_tokens):
            try:
                payload = _payload(model, prompt, max_tokens, args)
                results.append(await send_request(client, url, payload, headers, t_level))
            finally:
                if sem:
                    sem.release()

        tasks = []
        t_next = 0.0
        n = 0
        limit = args.num_requests if args.num_requests else (10**9 if args.duration else len(items))
        while n < limit:
            if args.duration and time.perf_counter() - t_level >= args.duration:
                break
            prompt, max_tokens, arrival = items[n % len(items)]
            if level.rate == "workload":
                t_next = arrival * args.time_scale + (n // len(items)) * (items[-1][2] * args.time_scale)
            elif level.rate is not None and level.rate != math.inf:
                t_next += rng.expovariate(level.rate)
            wait = t_next - (time.perf_counter() - t_level)
            if level.rate is not None and wait > 0:
                await asyncio.sleep(wait)
            if sem:
                await sem.acquire()
            tasks.append(asyncio.create_task(one(prompt, max_tokens)))
            n += 1
        if tasks:
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_level
    return results, duration


def _payload(model: str, prompt, max_tokens: int, args) -> dict:
    p = {"model": model, "prompt": prompt, "max_tokens": int(max_tokens), "temperature": 0.0, "stream": True,
         "stream_options": {"include_usage": True}}
    if not args.no_ignore_eos:
        p["ignore_eos"] = True
    return p


# ---- datasets -----------------------------------------------------------------------------------
def load_dataset(args) -> tuple[list[tuple[object, int, float]], dict]:
    if args.dataset in conversations.KINDS:  # multi-turn: prompts depend on earlier answers
        convs = conversations.make(args.dataset, args.num_conversations, args.turns, args.system_words,
                                   args.user_words, seed=args.seed)
        return convs, {"dataset": args.dataset, "conversations": len(convs), "turns": args.turns,
                       "system_words": args.system_words}
    if os.path.isfile(args.dataset) or args.dataset.endswith(".jsonl"):
        items = []
        with open(args.dataset) as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                d = json.loads(line)
                prompt = d.get("prompt", d.get("prompt_token_ids"))
                if prompt is None:
                    raise ValueError(f"{args.dataset}:{i + 1}: no 'prompt' field")
                mt = d.get("max_tokens", d.get("output_len", args.max_tokens))
                items.append((prompt, int(mt), float(d.get("arrival_time", 0.0))))
        return items, {"dataset": args.dataset}
    tok = common.load_tokenizer(args.model)
    vocab = args.vocab_size or len(tok)
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    olo, ohi = (int(x) for x in args.output_len.split(","))
    n = args.num_requests or 256
    items, clipped = common.workload_items(args.dataset, n, args.seed, vocab, common.special_token_ids(tok),
                                           args.max_model_len, (lo, hi), (olo, ohi))
    return items, {"dataset": args.dataset, "vocab": vocab, "clipped": clipped}


# ---- main ---------------------------------------------------------------------------------------
def _levels(args) -> list[Level]:
    concs = [int(c) for c in str(args.concurrency).split(",")] if args.concurrency else [None]
    rates: list = [None]
    if args.request_rate:
        rates = []
        for r in args.request_rate.split(","):
            rates.append("workload" if r == "workload" else (math.inf if r == "inf" else float(r)))
    if concs == [None] and rates == [None]:
        concs = [32]
    return [Level(c, r) for c in concs for r in rates]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxserve bench serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (or use --launch)")
    t.add_argument("--launch", action="store_true",
                   help="start `jaxserve serve` on a free 127.0.0.1 port, stop it after")
    t.add_argument("--server-args", default="", help="extra `jaxserve serve` arguments for --launch, one string")
    t.add_argument("--server-log", default=None, help="--launch: server log file (default: a temp file)")
    t.add_argument("--launch-timeout", type=float, default=900, help="--launch: seconds to wait for /health")
    t.add_argument("--served-model-name", default=None, help="model name to send (default: the first of /v1/models)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key (default $OPENAI_API_KEY)")
    t.add_argument("--model", "-m", default=None,
                   help="model whose tokenizer/vocab builds the prompts, and --launch's model (default: the default)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", default="mixed", help=f"{', '.join(common.WORKLOAD_NAMES)}, or a .jsonl file")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--prompt-len", default="20,400", help="mixed: min,max prompt tokens")
    d.add_argument("--output-len", default="16,256", help="mixed: min,max new tokens")
    d.add_argument("--max-tokens", type=int, default=128, help="JSONL lines without max_tokens; the answer "
                   "length of conversation traces (default 128)")
    d.add_argument("--num-conversations", type=int, default=6, help="conversation traces: how many (default 6)")
    d.add_argument("--turns", type=int, default=5, help="conversation traces: turns each (default 5)")
    d.add_argument("--system-words", type=int, default=300,
                   help="conversation traces: system prompt words (~400 tokens at 300) (default 300)")
    d.add_argument("--user-words", type=int, default=12, help="conversation traces: words per user turn")
    d.add_argument("--vocab-size", type=int, default=None, help="token ids below this (default: the tokenizer's)")
    d.add_argument("--max-model-len", type=int, default=None, help="clip prompts to fit this context")
    d.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (lengths then vary)")
    g = p.add_argument_group("load")
    g.add_argument("--concurrency", default=None, help="requests in flight; comma-separated levels (default 32)")
    g.add_argument("--request-rate", default=None, help="Poisson req/s, 'inf', or 'workload'; comma-separated")
    g.add_argument("--time-scale", type=float, default=1.0, help="--request-rate workload: stretch arrival times")
    g.add_argument("--num-requests", type=int, default=None, help="requests per level (default: the dataset, 256)")
    g.add_argument("--duration", type=float, default=None, help="stop sending new requests after this many s")
    g.add_argument("--warmup", type=int, default=2, help="untimed requests before the first level (default 2)")
    g.add_argument("--request-timeout", type=float, default=600.0)
    o = p.add_argument_group("output")
    o.add_argument("--slo", nargs="*", default=[], help="goodput SLOs, e.g. ttft:500ms tpot:50ms e2e:10s")
    o.add_argument("--plot", default=None, help="PNG: latency CDFs (+ throughput vs level when several)")
    o.add_argument("--out", default=None, help="write JSON here")
    o.add_argument("--save-requests", action="store_true", help="per-request records in the JSON")
    return p


async def _model_name(base_url: str, headers: dict) -> str:
    import httpx

    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.get(base_url.rstrip("/") + "/v1/models", headers=headers)
        r.raise_for_status()
        return r.json()["data"][0]["id"]


async def _bench(base_url: str, args, items, headers) -> tuple[str, list]:
    model = args.served_model_name or await _model_name(base_url, headers)
    if args.warmup and args.dataset not in conversations.KINDS:
        warm = [(p if not isinstance(p, list) else p[: max(8, len(p) // 4)], min(m, 8), 0.0)
                for p, m, _ in items[: args.warmup]]
        wargs = argparse.Namespace(**{**vars(args), "num_requests": len(warm), "duration": None})
        await run_level(base_url, model, warm, Level(1, None), wargs, headers)
    out = []
    for level in _levels(args):
        print(f"running {level.name} ...", flush=True)
        if args.dataset in conversations.KINDS:
            res, dur = await conversations.run(base_url, model, items, args.max_tokens, level.concurrency or 8,
                                               headers, args.request_timeout)
        else:
            res, dur = await run_level(base_url, model, items, level, args, headers)
        s = summarize(res, dur, parse_slo(args.slo))
        print_level(level.name, s)
        out.append((level, s, res))
    return model, out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not args.base_url and not args.launch:
        raise ValueError("Give --base-url URL of a running server, or --launch to start `jaxserve serve`.")
    parse_slo(args.slo)  # fail early
    _levels(args)
    items, ds_info = load_dataset(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    server_info = None
    if args.launch:
        with launched_server(args) as (url, server_info):
            model, levels = asyncio.run(_bench(url, args, items, headers))
    else:
        model, levels = asyncio.run(_bench(args.base_url, args, items, headers))

    if len(levels) > 1:
        rows = [(lv.name, s["completed"], s["failed"], s["request_throughput"], s["output_tok_s"],
                 s["ttft_ms"]["median"], s["ttft_ms"]["p99"], s["tpot_ms"]["median"], s["tpot_ms"]["p99"],
                 s["e2e_ms"]["median"]) for lv, s, _ in levels]
        print(common.table(rows, ("level", "ok", "failed", "req/s", "out tok/s", "TTFT med ms", "TTFT p99 ms",
                                  "TPOT med ms", "TPOT p99 ms", "E2E med ms"), "Summary"))
    if args.plot:
        plot(levels, args.plot)
    results = []
    for lv, s, res in levels:
        entry = {"concurrency": lv.concurrency, "request_rate": lv.rate if lv.rate != math.inf else "inf",
                 "summary": s}
        if args.save_requests:
            entry["requests"] = [{**asdict(r), "tpot": r.tpot} for r in res]
        results.append(entry)
    common.report("serve", argv, model={"served_model_name": model, "tokenizer_model": args.model or "default"},
                  config={**vars(args), "dataset_info": ds_info, "server": server_info,
                          "base_url": args.base_url or (server_info or {}).get("command")},
                  results={"levels": results}, out=args.out, jax_devices=False)
    return 0 if all(s["completed"] for _, s, _ in levels) else 1


def plot(levels, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    several = len(levels) > 1
    fig, axes = plt.subplots(2, 3 if several else 2, figsize=(15 if several else 10, 8))
    axes = axes.ravel()
    metrics = [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E latency")]
    for ax, (key, label) in zip([axes[0], axes[1], axes[3 if several else 2], axes[4 if several else 3]], metrics):
        for lv, _, res in levels:
            ok = [r for r in res if r.ok]
            if key == "itl":
                xs = sorted(x for r in ok for x in r.itl)
            elif key == "tpot":
                xs = sorted(r.tpot for r in ok if not math.isnan(r.tpot))
            else:
                xs = sorted(getattr(r, key) for r in ok)
            if xs:
                ax.plot([x * 1e3 for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], label=lv.name)
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of requests" if key != "itl" else "fraction of intervals")
        ax.set_title(f"{label} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if several:
        xs = list(range(len(levels)))
        names = [lv.name for lv, _, _ in levels]
        ax = axes[2]
        ax.plot(xs, [s["output_tok_s"] for _, s, _ in levels], "o-", label="output tok/s")
        ax.plot(xs, [s["total_tok_s"] for _, s, _ in levels], "s--", label="total tok/s")
        ax.set_xticks(xs, names, rotation=20, fontsize=8)
        ax.set_ylabel("tok/s")
        ax.set_title("Throughput vs load")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax = axes[5]
        ax.plot(xs, [s["ttft_ms"]["p99"] for _, s, _ in levels], "o-", label="TTFT p99")
        ax.plot(xs, [s["ttft_ms"]["median"] for _, s, _ in levels], "s--", label="TTFT median")
        ax.plot(xs, [s["tpot_ms"]["p99"] for _, s, _ in levels], "^-", label="TPOT p99")
        ax.set_xticks(xs, names, rotation=20, fontsize=8)
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.set_title("Latency vs load")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
