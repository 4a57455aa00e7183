"""Draft-model proposals: a smaller model with the target's tokenizer drafts k tokens greedily.

Its KV cache has the target's block count and uses the target's block tables: the draft runs each
target step on the same batch (`mirror`), so every block the target computed (prefills, verified
rows, recomputed preemptions, blocks later shared through the prefix cache) holds the draft's K/V
for the same tokens too. A proposal is then k one-token steps of the draft from the sequence's
last token, writing into slots the scheduler already gave the drafts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.core.batch import RowSpec, Sampling, StepBatch
from jaxserve.core.buckets import BucketKey
from jaxserve.errors import UserError
from jaxserve.model.loader import load_model
from jaxserve.worker.runner import ModelRunner


class DraftModel:
    def __init__(self, path: str, target_cfg, num_blocks: int, target_vocab: int):
        try:
            loaded = load_model(path)
        except UserError as e:
            raise UserError(f"speculative_config model: {e}", param="speculative_config") from None
        if loaded.config.vocab_size != target_vocab:
            raise UserError(
                f"The draft model {path!r} has {loaded.config.vocab_size} tokens but the target has "
                f"{target_vocab}: a draft model must share the target's tokenizer.", param="speculative_config")
        cfg = dataclasses.replace(target_cfg, num_blocks=num_blocks, quantization=None)
        self.runner = ModelRunner(loaded.config, loaded.params, cfg)
        loaded.params = None

    def resize_kv(self, num_blocks: int) -> None:
        self.runner.resize_kv(num_blocks)

    def precompile(self, progress=None) -> float:
        """The buckets a draft meets: those without logit adjustments (`mirror` strips them)."""
        return self.runner.precompile(progress, keys=[k for k in self.runner.all_buckets() if k.w == 0])

    def mirror(self, batch: StepBatch, key: BucketKey) -> None:
        """Run the target's step on the draft's cache (its sampled tokens are not used)."""
        if key.w:  # the draft needs no logit adjustments: the same rows in the W = 0 bucket
            s = key.s
            none_i, none_f = np.zeros((s, 0), np.int32), np.zeros((s, 0), np.float32)
            batch = batch._replace(adj_ids=none_i, adj_out_counts=none_f, adj_in_prompt=none_f, adj_bias=none_f,
                                   bitmask=none_i)
            key = BucketKey(key.t, s, 0, c=key.c)
        self.runner.execute(batch, key)

    def propose(self, seqs: list[tuple[list[int], list[int], int]]) -> list[list[int]]:
        """seqs: (token_ids, block_ids, k) of sequences whose last token has no K/V yet; returns k
        greedy draft tokens each, in k one-token steps of the draft over all of them."""
        drafts: list[list[int]] = [[] for _ in seqs]
        for step in range(max((k for _, _, k in seqs), default=0)):
            live = [i for i, (_, _, k) in enumerate(seqs) if k > step]
            rows = [RowSpec(seqs[i][0] + drafts[i], len(seqs[i][0]) - 1 + step, 1, seqs[i][1], Sampling())
                    for i in live]
            batch, key, rowmap = self.runner.builder.build(rows)
            tokens = self.runner.fetch(self.runner.execute(batch, key), key.s, False).tokens
            for i, out in zip(live, rowmap.out):
                drafts[i].append(int(tokens[out]))
        return drafts
