"""The engine's side of speculative decoding: which running sequences draft at a step, their
drafts (n-gram lookup before scheduling; the draft model's once the scheduler gave the drafts
slots), the grammar's masks at every verified position, and the acceptance counts."""

from __future__ import annotations

import numpy as np

from jaxserve.core.batch import PENDING
from jaxserve.spec import ngram
from jaxserve.spec.draft import DraftModel
from jaxserve.config import SpeculativeConfig


class Speculator:
    @classmethod
    def for_config(cls, config: SpeculativeConfig | None, runner_cfg, num_blocks: int, vocab_size: int):
        """(speculator, drafter): (None, None) without speculative decoding; the draft method's
        model (spec.draft.DraftModel) mirrors the target's steps on its own KV cache."""
        if config is None:
            return None, None
        drafter = DraftModel(config.model, runner_cfg, num_blocks, vocab_size) if config.method == "draft" else None
        return cls(config, drafter), drafter

    def __init__(self, config: SpeculativeConfig, drafter=None):
        self.config = config
        self.drafter = drafter  # spec.draft.DraftModel for the draft method, else None
        k = config.num_speculative_tokens
        # drafted / accepted tokens, and verifications by how many drafts they accepted
        self.stats = dict(draft_tokens=0, accepted_tokens=0, verifications=0, acceptance_counts=[0] * (k + 1))

    def propose(self, running, seqs: dict) -> None:
        """Drafts for the running sequences whose last token is on the host (n-gram: the tokens;
        draft model: how many, drafted once the step's slots are allocated). Off above
        disable_by_batch_size running requests; a sequence whose lookup finds nothing waits
        1, 2, 4, .. 16 steps before it tries again, so those steps keep the overlap."""
        cfg = self.config
        active = len(running) <= cfg.disable_by_batch_size
        for req in running:
            req.spec_token_ids = []
            seq = seqs.get(req.request_id)
            if not active or seq is None:
                continue
            if seq.spec_wait > 0:
                seq.spec_wait -= 1
                continue
            if req.token_ids[-1] == PENDING or req.num_tokens - req.num_computed_tokens != 1 or req.score_prompt:
                continue
            k = min(cfg.num_speculative_tokens, req.max_tokens - req.num_output_tokens - 1)
            if k <= 0:
                continue
            if self.drafter is not None:
                req.spec_token_ids = [PENDING] * k
                continue
            drafts = ngram.propose(np.asarray(req.token_ids, np.int32), k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            if drafts and seq.matcher is not None:
                drafts = drafts[:seq.matcher.valid_prefix(drafts)]
            if drafts:
                seq.spec_misses = 0
            else:
                seq.spec_misses += 1
                seq.spec_wait = min(1 << (seq.spec_misses - 1), 16)
            req.spec_token_ids = drafts

    def due(self, seq, num_running: int) -> bool:
        """Whether the sequence drafts at the next step (then this step's tokens must be read first)."""
        return seq.spec_wait == 0 and num_running <= self.config.disable_by_batch_size

    def draft_tokens(self, scheduled, seqs: dict) -> None:
        """Fill the drafts of verifying rows from the draft model (their slots are allocated)."""
        todo = [sr for sr in scheduled if sr.num_draft]
        if not todo or self.drafter is None:
            return
        drafts = self.drafter.propose([(sr.request.token_ids, sr.request.block_ids, sr.num_draft) for sr in todo])
        for sr, d in zip(todo, drafts):
            req = sr.request
            seq = seqs[req.request_id]
            if seq.matcher is not None:  # a draft outside the grammar ends the run of drafts
                n = seq.matcher.valid_prefix(d)
                sr.num_new_tokens -= sr.num_draft - n
                sr.num_draft = n
                d = d[:n]
            req.spec_token_ids = d

    @staticmethod
    def fill_masks(matcher, drafts: list[int], rows) -> None:
        """The grammar's mask before each draft and after the last (rows: the bitmask from the
        row's first logits row), leaving the matcher where it was."""
        for j, tok in enumerate(drafts):
            matcher.fill_bitmask(rows[j])
            matcher.accept(tok)  # valid: drafts are cut to the grammar's valid prefix
        matcher.fill_bitmask(rows[len(drafts)])
        matcher.rollback(len(drafts))

    def record(self, drafted: int, accepted: int) -> None:
        st = self.stats
        st["verifications"] += 1
        st["draft_tokens"] += drafted
        st["accepted_tokens"] += accepted
        st["acceptance_counts"][accepted] += 1

    def summary(self) -> dict:
        """get_stats()'s spec_* entries."""
        st = self.stats
        out = {f"spec_{k}": (list(v) if isinstance(v, list) else v) for k, v in st.items()}
        out["spec_mean_acceptance_length"] = (1 + st["accepted_tokens"] / st["verifications"] if st["verifications"]
                                              else 0.0)
        return out
