"""Turn a scheduler plan into padded numpy arrays for one step (host side, no jax).

T (tokens) and S (sequences) are padded to buckets (powers of two and their 1.5x midpoints) so each
bucket compiles once.
Padding tokens write to the reserved null block 0 and padding sequences have no tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.sampling_params import SamplingParams


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def token_buckets(max_tokens: int, smallest: int = 1) -> list[int]:
    """Step sizes that compile: powers of two from `smallest`, plus the midpoints 24, 48, 96, ...
    (padding a step costs at most a third, not half), capped by `max_tokens` (always included)."""
    out, t = [], smallest
    while t < max_tokens:
        out.append(t)
        if t >= 16 and t * 3 // 2 < max_tokens:
            out.append(t * 3 // 2)
        t *= 2
    return out + [max(max_tokens, smallest)]


@dataclass
class StepInputs:
    input_ids: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    slot_mapping: np.ndarray  # i32[T]
    seq_lens: np.ndarray  # i32[S]
    query_start_loc: np.ndarray  # i32[S+1]
    block_tables: np.ndarray  # i32[S, max_blocks]
    num_seqs: np.ndarray  # i32[1]
    logits_indices: np.ndarray  # i32[S]
    num_tokens: int  # real tokens (<= T)


def build_step_inputs(
    rows: list[tuple[list[int], int, int, list[int]]],  # (token_ids, start, num_new, block_ids)
    *,
    t_bucket: int,
    s_bucket: int,
    block_size: int,
    max_blocks: int,
) -> StepInputs:
    input_ids = np.zeros(t_bucket, np.int32)
    positions = np.zeros(t_bucket, np.int32)
    slot_mapping = np.zeros(t_bucket, np.int32)  # padding -> null block 0
    seq_lens = np.zeros(s_bucket, np.int32)
    qsl = np.zeros(s_bucket + 1, np.int32)
    tables = np.zeros((s_bucket, max_blocks), np.int32)
    logits_indices = np.zeros(s_bucket, np.int32)
    t = 0
    for i, (token_ids, start, n, block_ids) in enumerate(rows):
        end = start + n
        pos = np.arange(start, end, dtype=np.int32)
        blocks = np.asarray(block_ids, np.int32)
        input_ids[t : t + n] = token_ids[start:end]
        positions[t : t + n] = pos
        slot_mapping[t : t + n] = blocks[pos // block_size] * block_size + pos % block_size
        seq_lens[i] = end
        tables[i, : len(blocks)] = blocks
        t += n
        qsl[i + 1] = t
        logits_indices[i] = t - 1
    qsl[len(rows) + 1 :] = t
    return StepInputs(
        input_ids, positions, slot_mapping, seq_lens, qsl, tables,
        np.array([len(rows)], np.int32), logits_indices, t,
    )


def build_sampling_arrays(
    params: list[SamplingParams],
    seeds: list[int],
    steps: list[int],
    banned: list[list[int]],  # per row token ids to forbid this step (min_tokens)
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    s_bucket: int,
):
    """Returns (SamplingTensors fields as a dict, mode fields as a dict)."""
    s = s_bucket
    temperature = np.zeros(s, np.float32)
    top_k = np.zeros(s, np.int32)
    top_p = np.ones(s, np.float32)
    min_p = np.zeros(s, np.float32)
    seed_arr = np.zeros(s, np.uint32)
    step_arr = np.zeros(s, np.int32)
    presence = np.zeros(s, np.float32)
    frequency = np.zeros(s, np.float32)
    repetition = np.ones(s, np.float32)
    for i, p in enumerate(params):
        temperature[i] = p.temperature
        top_k[i] = p.top_k
        top_p[i] = p.top_p
        min_p[i] = p.min_p
        seed_arr[i] = seeds[i] & 0xFFFFFFFF
        step_arr[i] = steps[i]
        presence[i] = p.presence_penalty
        frequency[i] = p.frequency_penalty
        repetition[i] = p.repetition_penalty
    use_pen = any(p.uses_penalties for p in params)
    lo = next_pow2(max((len(o) for o in output_ids), default=1)) if use_pen else 0
    lp = next_pow2(max((len(o) for o in prompt_ids), default=1)) if use_pen else 0
    out_arr = np.full((s, lo), -1, np.int32)
    prompt_arr = np.full((s, lp), -1, np.int32)
    if use_pen:
        for i, p in enumerate(params):
            if p.uses_penalties:
                out_arr[i, : len(output_ids[i])] = output_ids[i]
                prompt_arr[i, : len(prompt_ids[i])] = prompt_ids[i]
    entries = [
        list((p.logit_bias or {}).items()) + [(b, -np.inf) for b in ban] for p, ban in zip(params, banned)
    ]
    width = max((len(e) for e in entries), default=0)
    a = next_pow2(width) if width else 0
    bias_ids = np.full((s, a), -1, np.int32)
    bias_values = np.zeros((s, a), np.float32)
    for i, e in enumerate(entries):
        for j, (tok, val) in enumerate(e):
            bias_ids[i, j] = tok
            bias_values[i, j] = val
    num_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=-1)
    tensors = dict(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seed_arr, steps=step_arr,
        presence=presence, frequency=frequency, repetition=repetition, output_ids=out_arr,
        prompt_ids=prompt_arr, bias_ids=bias_ids, bias_values=bias_values,
    )
    mode = dict(
        all_greedy=all(p.greedy for p in params),
        truncation=any(p.uses_truncation for p in params),
        penalty_widths=(lo, lp),
        bias_width=a,
        num_logprobs=num_logprobs,
    )
    return tensors, mode
