"""Pooling: a prompt's final hidden states made into one vector (embeddings) or one score (rerank).

A pooling request is an ordinary request of one output token whose prefill also reads back the
final-norm hidden state of the rows it needs (the runner's `pool` bucket variant): the last token
(last-token pooling, the reranker's score), or every prompt token (mean and CLS pooling, which
then skip the prefix cache, as prompt logprobs do). `Pooler` accumulates those rows on the host
as the chunks land, so chunked prefill, preemption and cache hits give the same vector.

What a model pools with comes from its sentence-transformers files (`modules.json`,
`1_Pooling/config.json`, a `Normalize` module) when present, else last-token + L2 norm, which is
Qwen3-Embedding's. Jax-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxserve.errors import UserError
from jaxserve.sampling_params import SamplingParams

METHODS = ("last", "mean", "cls")
# sentence-transformers 1_Pooling/config.json flags -> our method
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """What one request pools: `method` over the prompt, the first `dimensions` values
    (Matryoshka models), then L2-normalised if `normalize`. `score`: instead of a vector, the
    reranker's p(yes) from the last position's logits of the engine's two score tokens."""

    method: str = "last"
    normalize: bool = True
    dimensions: int | None = None
    score: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"Unknown pooling method {self.method!r}: use one of {', '.join(METHODS)}.",
                            param="pooling")
        if self.score and self.method != "last":
            raise UserError("Scoring reads the last token: use method='last'.", param="pooling")

    @property
    def every_row(self) -> bool:
        """Needs a hidden row at every prompt token (so no prefix-cache hit may skip one)."""
        return self.method != "last"


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """A model's pooling, read once when the engine is built."""

    method: str = "last"
    normalize: bool = True
    matryoshka: bool = False  # trained so that any leading slice of the vector embeds (`dimensions`)
    declared: bool = False  # from sentence-transformers files: an embedding model (its pool steps precompile)

    @classmethod
    def from_model(cls, path: str | Path) -> PoolingConfig:
        path = Path(path)
        if not path.is_dir():
            return cls()
        method, normalize = "last", True
        modules = _read_json(path / "modules.json")
        declared = isinstance(modules, list)
        if isinstance(modules, list):
            kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
            normalize = "Normalize" in kinds
            pool = kinds.get("Pooling")
            if pool is not None:
                conf = _read_json(path / str(pool.get("path", "1_Pooling")) / "config.json") or {}
                method = next((m for k, m in _ST_MODES.items() if conf.get(k)), None)
                if method is None:
                    modes = sorted(k for k, v in conf.items() if k.startswith("pooling_mode") and v)
                    raise UserError(f"The model's pooling ({', '.join(modes) or 'none'}) is not supported: "
                                    "jaxserve pools by last token, mean or CLS.", param="model")
        hf = _read_json(path / "config.json") or {}
        matryoshka = bool(hf.get("is_matryoshka") or hf.get("matryoshka_dimensions"))
        return cls(method, normalize, matryoshka, declared)

    def params(self, dimensions: int | None = None, hidden_size: int | None = None) -> PoolingParams:
        if dimensions is not None:
            if not self.matryoshka:
                raise UserError("This model does not support 'dimensions' (it is not Matryoshka-trained): "
                                "omit it.", param="dimensions")
            if not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1 or (
                    hidden_size is not None and dimensions > hidden_size):
                raise UserError(f"'dimensions' must be an integer from 1 to {hidden_size}.", param="dimensions")
        return PoolingParams(self.method, self.normalize, dimensions)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UserError(f"Cannot read {path}: {e}.", param="model") from None


class Pooler:
    """One request's pooling as its prefill lands: hidden rows in, the vector (or score) out.

    `add` takes rows in position order; a position seen before (a preempted request computing
    its prompt again) is skipped, so each prompt token counts once."""

    def __init__(self, params: PoolingParams, num_tokens: int, score_head: np.ndarray | None = None):
        self.params = params
        self.num_tokens = num_tokens
        self.score_head = score_head  # f32[H, 2]: the (no, yes) tokens' LM-head columns
        self.next_pos = 0 if params.every_row else num_tokens - 1
        self._sum: np.ndarray | None = None
        self.value: np.ndarray | None = None  # set once every needed row landed

    def add(self, positions: list[int], rows: np.ndarray) -> None:
        """rows: f32[len(positions), H], the final-norm hidden states at those prompt positions."""
        for pos, row in zip(positions, rows):
            if pos != self.next_pos or self.value is not None:
                continue  # before next_pos: seen already; last-token pooling reads only its row
            if self.params.method == "mean":
                row64 = np.asarray(row, np.float64)
                self._sum = row64 if self._sum is None else self._sum + row64
            elif self.params.method == "cls" and pos == 0 or self.params.method == "last":
                self._sum = np.asarray(row, np.float64)
            self.next_pos = pos + 1
            if self.next_pos == self.num_tokens:
                self.value = self._finish()

    def _finish(self) -> np.ndarray:
        p = self.params
        v = self._sum / self.num_tokens if p.method == "mean" else self._sum
        if p.score:
            logits = v @ np.asarray(self.score_head, np.float64)  # (no, yes)
            return np.asarray([1.0 / (1.0 + np.exp(logits[0] - logits[1]))], np.float32)  # softmax -> p(yes)
        if p.dimensions is not None:
            v = v[:p.dimensions]
        if p.normalize:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        return v.astype(np.float32)


def pooling_request(params: PoolingParams) -> SamplingParams:
    """The SamplingParams of a pooling request: one greedy token, which nobody reads."""
    return SamplingParams(max_tokens=1, temperature=0.0, pooling=params)


def score_head(params, cfg, tokenizer, tokens: str | None) -> np.ndarray | str:
    """f32[H, 2]: the LM-head columns of the reranker's (no, yes) tokens, taken from the host
    weights once at start-up (so a score is sigmoid(h . (w_yes - w_no)) = softmax over the two
    logits, as Qwen3-Reranker scores); or a sentence saying why this model cannot score."""
    names = [t for t in (tokens or "no,yes").split(",")]
    ids = []
    for name in names:
        got = tokenizer.encode(name, add_special_tokens=False)
        if len(got) != 1:
            return (f"This model cannot rerank: {name!r} is not one token of its vocabulary; start the "
                    "server with --score-tokens NO,YES naming its two answer tokens.")
        ids.append(got[0])
    if len(ids) != 2:
        return "--score-tokens takes two tokens, the 'no' and the 'yes' answer: e.g. no,yes."
    if not isinstance(params, dict):
        return "This model's weights are restored lazily (an Orbax checkpoint): rerank is not available."
    table = params.get("lm_head", {}).get("kernel") if not cfg.tie_word_embeddings else None
    if table is None:
        emb = params.get("embed_tokens", {}).get("embedding")
        if not isinstance(emb, np.ndarray):
            return "This model's LM head is quantized: rerank is not available."
        return np.asarray(emb[ids], np.float32).T
    if not isinstance(table, np.ndarray):
        return "This model's LM head is quantized: rerank is not available."
    return np.asarray(table[:, ids], np.float32)
