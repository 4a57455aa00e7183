"""The last layer runs its output projection, residual and MLP on the logits rows alone when a step
has fewer logits rows than tokens (model/decoder.py). Those rows' logits must be the ones the whole
layer gives: the same forward, once with one logits row per token (nothing pruned) and once with
the bucket's logits rows, on a dense, a Gemma 3 and a mixture-of-experts model, with a row that
asks for logits at earlier tokens too (extra rows) and one that samples nothing."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core.batch import RowSpec, Sampling
from jaxserve.model.loader import load_model
from jaxserve.worker.runner import ModelRunner, RunnerConfig


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_moe"])
def test_pruned_last_layer_keeps_logits(tiny_model, arch):
    lm = load_model(tiny_model(arch))
    runner = ModelRunner(lm.config, lm.params, RunnerConfig(
        block_size=16, num_blocks=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64))
    rng = np.random.default_rng(0)
    ids = [rng.integers(3, lm.config.vocab_size, size=n).tolist() for n in (30, 21, 12)]
    rows = [RowSpec(ids[0], 0, 30, [7, 3], Sampling(), extra=[(4, Sampling()), (17, Sampling())]),
            RowSpec(ids[1], 0, 20, [5, 9]),  # a prefill chunk that samples nothing
            RowSpec(ids[2], 0, 12, [11], Sampling())]
    b, key, _ = runner.builder.build(rows)
    t, s, m = len(b.input_ids), len(b.logits_indices), int(b.num_logits[0])
    assert m == 4 and s < t, (m, s, t)

    def logits(batch):
        out, _ = runner._forward(runner.params, runner.kv.layers, batch, runner.last_tokens)
        return np.asarray(out)[:m]

    every = np.concatenate([b.logits_indices, np.full(t - s, b.logits_indices[-1], np.int32)])
    whole = b._replace(logits_indices=jnp.asarray(every))
    np.testing.assert_allclose(logits(b), logits(whole), rtol=1e-5, atol=1e-5)
