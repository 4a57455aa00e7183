"""`python -m bench.replicas`: N jaxserve replicas behind SMG, round_robin vs cache_aware, then a
replica killed mid-run; next to the simulator's prediction for the same trace.

Launches `jaxserve serve --data-parallel-size N --router none` (extra flags: --server-args), starts
SMG with each policy in turn over the same replicas, runs the conversation trace (one request at a
time, conversation after conversation, so round-robin cannot be sticky by accident), reads every
replica's `vllm:prefix_cache_hits` / `vllm:prompt_tokens` to see where each turn landed, then
kills the replica holding conversation 0 and runs one more turn of every conversation through SMG
(failed requests counted). Prints a table and writes JSON (--out).

    python -m bench.replicas --server-args "--max-model-len 1024 --max-num-seqs 8" --out r.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import conversations
from bench.launch import free_port
from bench import sim_replicas as sr
from jaxserve.server.replicas import smg_command

COUNTERS = ("vllm:prefix_cache_hits", "vllm:prompt_tokens")


def counters(url: str) -> dict[str, float]:
    """A replica's prefix-hit and prompt token counters (zeros while it is down)."""
    out = dict.fromkeys(COUNTERS, 0.0)
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    for fam in text_string_to_metric_families(text):
        if fam.name in COUNTERS:
            out[fam.name] = sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return out


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def replica_pids(launcher: int) -> dict[int, int]:
    """port -> pid of the launcher's replica processes."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline") as f:
                argv = f.read().split("\0")
        except OSError:
            continue
        if ppid == launcher and "--port" in argv:
            out[int(argv[argv.index("--port") + 1])] = int(pid)
    return out


def launch_fleet(model_args: list[str], n: int, log_path: str, timeout: float = 1800):
    """Start `jaxserve serve --data-parallel-size n --router none`; wait until every replica is up."""
    port = free_port()
    args = [sys.executable, "-m", "jaxserve.cli", "serve", *model_args, "--port", str(port),
            "--data-parallel-size", str(n), "--router", "none", "--replica-max-restarts", "2",
            "--log-level", "warning"]
    with open(log_path, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, text=True)
    t0, deadline = time.monotonic(), time.monotonic() + timeout
    while "route them with SMG" not in open(log_path).read():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("replicas did not start:\n" + open(log_path).read()[-3000:])
        time.sleep(1)
    return proc, [f"http://127.0.0.1:{port + 1 + i}" for i in range(n)], time.monotonic() - t0


@contextlib.contextmanager
def running_fleet(model_args: list[str], n: int, log_path: str):
    """`launch_fleet` for a `with` block: (launcher, replica urls, start-up s); SIGTERM at the end."""
    proc, urls, startup_s = launch_fleet(model_args, n, log_path)
    try:
        yield proc, urls, startup_s
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


@contextlib.contextmanager
def routed(urls: list[str], policy: str):
    """SMG in front of `urls` with `policy` for a `with` block; yields its url."""
    router, url = start_router(urls, policy)
    try:
        yield url
    finally:
        router.terminate()
        router.wait(30)


def reset_prefix_caches(urls: list[str]) -> None:
    for u in urls:
        httpx.post(u + "/reset_prefix_cache", timeout=60).raise_for_status()


def start_router(urls: list[str], policy: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = smg_command(port, "127.0.0.1", urls, policy, None)
    cmd[cmd.index("--prometheus-port") + 1] = str(free_port())
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("smg did not come up")
        time.sleep(0.5)


def converse(url: str, replicas: list[str], convs, turns: range, model: str, max_tokens: int) -> dict:
    """Each conversation's turns in order, one request at a time, through the router at `url`."""
    before = {u: counters(u) for u in replicas}
    landed, prompt_tokens, failed = [[] for _ in convs], [[] for _ in convs], 0
    for c, conv in enumerate(convs):
        for turn in turns:
            snap = {u: counters(u)["vllm:prompt_tokens"] for u in replicas}
            r = httpx.post(url + "/v1/completions", timeout=600, json={
                "model": model, "prompt": conv.prompt(turn), "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True})
            if r.status_code != 200:
                failed += 1
                conv.answers.append("failed")
                continue
            body = r.json()
            conv.answers.append(body["choices"][0]["text"].strip() or "ok")
            prompt_tokens[c].append(body["usage"]["prompt_tokens"])
            grew = [i for i, u in enumerate(replicas) if counters(u)["vllm:prompt_tokens"] > snap[u]]
            landed[c].append(grew[0] if len(grew) == 1 else -1)
    after = {u: counters(u) for u in replicas}
    hits = sum(after[u]["vllm:prefix_cache_hits"] - before[u]["vllm:prefix_cache_hits"] for u in replicas)
    queries = sum(sum(p) for p in prompt_tokens)
    return {"landed": landed, "failed": failed, "hit_tokens": hits, "prompt_tokens": prompt_tokens,
            "hit_ratio": hits / max(queries, 1)}


def predict(prompt_tokens: list[list[int]], n: int, policy: str, answer_len: int, num_blocks: int,
            block_size: int = 16) -> dict:
    """The simulator on the measured trace's shape: the same per-turn prompt lengths."""
    convs = []
    rng = iter(range(10**9))
    for lens in prompt_tokens:
        turns, prev = [], 0
        for k, n_tok in enumerate(lens):
            new = n_tok - (prev + answer_len if k else 0)
            turns.append([next(rng) % 30000 for _ in range(max(new, 1))])
            prev = n_tok
        convs.append(sr.Conv(turns, answer_len))
    return sr.simulate_replicas(convs, n, policy, num_blocks=num_blocks, block_size=block_size, concurrency=1)


def run(model_args: list[str], n: int = 3, num_conversations: int = 6, turns: int = 5, system_words: int = 300,
        user_words: int = 12, max_tokens: int = 8, num_blocks: int = 512, log_path: str = "/tmp/replicas.log",
        seed: int = 0, kill: bool = True) -> dict:
    with running_fleet(model_args, n, log_path) as (proc, urls, startup_s):
        out = {"replicas": n, "startup_s": startup_s, "policies": {}}
        model = httpx.get(urls[0] + "/v1/models").json()["data"][0]["id"]
        for policy in ("round_robin", "cache_aware"):
            reset_prefix_caches(urls)
            convs = conversations.make("conversations", num_conversations, turns + 1, system_words, user_words,
                                       seed=seed)
            with routed(urls, policy) as url:
                t0 = time.monotonic()
                res = converse(url, urls, convs, range(turns), model, max_tokens)
                res["seconds"] = time.monotonic() - t0
                sim = predict(res["prompt_tokens"], n, policy, max_tokens, num_blocks)
                res["predicted_hit_ratio"] = sim["hit_ratio"]
                if policy == "cache_aware" and kill:  # kill the replica holding conversation 0, mid-run
                    victim = urls[res["landed"][0][-1]]
                    port = int(victim.rsplit(":", 1)[1])
                    old = replica_pids(proc.pid)[port]
                    os.kill(old, signal.SIGKILL)
                    after = converse(url, urls, convs, range(turns, turns + 1), model, max_tokens)
                    res["after_kill_failed"] = after["failed"]
                    res["after_kill_requests"] = num_conversations
                    deadline = time.monotonic() + 1800
                    while not (replica_pids(proc.pid).get(port, old) != old and healthy(victim)):
                        if time.monotonic() > deadline:
                            raise RuntimeError("the killed replica did not come back")
                        time.sleep(1)
                    res["restarted"] = True
                out["policies"][policy] = res
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--server-args", default="", help="extra `jaxserve serve` arguments (model, lengths, ...)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-words", type=int, default=300, help="~400 tokens for a real tokenizer")
    p.add_argument("--user-words", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=512, help="KV blocks per replica, for the simulator")
    p.add_argument("--no-kill", action="store_true", help="skip killing a replica")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    res = run(shlex.split(args.server_args), args.replicas, args.conversations, args.turns, args.system_words,
              args.user_words, args.max_tokens, args.num_blocks, kill=not args.no_kill)
    print(f"{args.replicas} replicas up in {res['startup_s']:.0f} s")
    print(f"{'policy':12} {'hit tokens':>10} {'hit ratio':>9} {'predicted':>9} {'failed':>6} {'seconds':>7}")
    for policy, r in res["policies"].items():
        print(f"{policy:12} {r['hit_tokens']:10.0f} {r['hit_ratio']:9.1%} {r['predicted_hit_ratio']:9.1%} "
              f"{r['failed']:6d} {r['seconds']:7.1f}")
    ca = res["policies"]["cache_aware"]
    if "after_kill_failed" in ca:
        print(f"after killing a replica: {ca['after_kill_failed']} of {ca['after_kill_requests']} requests failed; "
              f"restarted: {ca['restarted']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
