"""Conversation traces for `jaxserve bench serve --dataset conversations|shared_system|agent_session`.

Text prompts, so a router that reads request text (SMG's cache_aware) sees what a real client sends.
Each turn's prompt is the whole history so far, the previous answers included (the server's own
answers, not canned ones), as a chat client resends it:
- `conversations`: every conversation has its own long system prompt (distinct prefixes per
  conversation: the case where routing decides the hit rate);
- `shared_system`: one system prompt for all conversations (a hit wherever a request lands);
- `agent_session`: an agent tree: a shared trunk (system + task), fanning out into branches that
  each take several tool-call steps on top of the trunk.

Conversations run concurrently (`--concurrency` of them at a time), each one's turns in order;
per request: TTFT, ITL, TPOT, E2E, and SLO goodput, as the rest of `bench serve`.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

KINDS = ("conversations", "shared_system", "agent_session")
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu river mountain ocean forest desert "
         "valley harbor bridge castle garden market station library museum theater stadium airport "
         "engine signal vector matrix kernel buffer socket thread packet router cache block token").split()


@dataclass
class Conversation:
    system: str
    users: list[str]  # one user message per turn
    prefix: str = ""  # shared text before the system prompt (agent trunk)
    answers: list[str] = field(default_factory=list)

    def prompt(self, turn: int) -> str:
        parts = [self.prefix + self.system]
        for k in range(turn + 1):
            parts.append(f"\nUser: {self.users[k]}\nAssistant:")
            if k < turn:
                parts.append(" " + self.answers[k])
        return "".join(parts)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def make(kind: str, num: int, turns: int, system_words: int = 300, user_words: int = 12,
         seed: int = 0, branches: int = 3) -> list[Conversation]:
    """`num` conversations of `turns` turns (agent_session: num // branches trunks x branches)."""
    if kind not in KINDS:
        raise ValueError(f"Unknown conversation trace {kind!r}: choose one of {', '.join(KINDS)}.")
    rng = random.Random(seed)
    shared = f"System {seed}: " + _text(rng, system_words)
    out = []
    for c in range(num):
        if kind == "conversations":
            system = f"System {c}: " + _text(rng, system_words)
            out.append(Conversation(system, [_text(rng, user_words) for _ in range(turns)]))
        elif kind == "shared_system":
            out.append(Conversation(shared, [_text(rng, user_words) for _ in range(turns)]))
        else:
            trunk = c // branches
            task = random.Random(seed * 7919 + trunk)
            system = f"Agent task {trunk}: " + _text(task, system_words)
            steps = [f"branch {c % branches} step {t}: call tool " + _text(rng, user_words) for t in range(turns)]
            out.append(Conversation(system, steps, prefix="Tools: search, read, write.\n"))
    return out


async def run(base_url: str, model: str, convs: list[Conversation], max_tokens: int, concurrency: int,
              headers: dict | None = None, timeout: float = 600) -> tuple[list, float]:
    """Run every conversation (`concurrency` at a time); returns (RequestResults in order, seconds)."""
    import httpx

    from bench.serve import send_request

    url = base_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(concurrency)
    results = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30)) as client:
        t0 = time.perf_counter()

        async def one(conv: Conversation) -> None:
            async with sem:
                conv.answers = []
                for turn in range(len(conv.users)):
                    payload = {"model": model, "prompt": conv.prompt(turn), "max_tokens": max_tokens,
                               "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                               "ignore_eos": True}
                    r, text = await send_request(client, url, payload, headers or {}, t0, keep_text=True)
                    results.append(r)
                    conv.answers.append(text.strip().replace("\nUser:", " User") or "ok")

        await asyncio.gather(*(one(c) for c in convs))
        return results, time.perf_counter() - t0
