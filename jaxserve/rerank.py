"""Rerank / score prompts, the Qwen3-Reranker way: a causal LM judges a (query, document) pair and
answers "yes" or "no"; the score is p(yes) of softmax over the two answer tokens' logits at the
last prompt position (pooling.PoolingParams(score=True) reads them).

The prompt is the model card's: a fixed system turn, a user turn of instruction, query and
document, and the assistant's turn opened with an empty think block. Jax-free.
"""

from __future__ import annotations

DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
          "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def pair_text(query: str, document: str, instruction: str | None = None) -> str:
    """The user turn's body for one pair."""
    return f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"


def pair_prompt(tokenizer, query: str, document: str, instruction: str | None = None) -> list[int]:
    """Token ids of one pair's prompt: prefix, body and suffix tokenized apart (as the model card
    does), so the fixed parts are the same tokens in every prompt and share the prefix cache."""
    enc = tokenizer.encode
    return (enc(PREFIX, add_special_tokens=False)
            + enc(pair_text(query, document, instruction), add_special_tokens=False)
            + enc(SUFFIX, add_special_tokens=False))
