"""transformers' float32 forward of a model jaxserve serves: the numerical reference that the suite
(tests/model/test_default_model.py) and `jaxserve bench quality --reference transformers` compare
greedy tokens against, and the model `jaxserve bench hf_baseline` times. torch and transformers
are test extras (`pip install -e '.[test]'`), not the product's dependencies.

A GGUF file loads through transformers' own GGUF reader, which dequantizes every tensor to float32
(the weights `--quantization none` runs), from a copy without the vocabulary arrays: the reader
spends about a minute indexing those ~150k strings, which the model's config and tensors do not
need (the prompts are tokenized by jaxserve's tokenizer, the same ids for both sides).
"""

from __future__ import annotations

import contextlib
import functools
import struct
import tempfile
from pathlib import Path

# A top-2 logit margin below this is a near-tie: float32 summation order alone can flip its argmax,
# so a greedy text that parts from the reference there is not counted against a format.
NEAR_TIE = 0.05

_VOCABULARY = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def without_vocabulary(src: Path, dst: Path) -> Path:
    """A copy of GGUF file `src` at `dst` without its three vocabulary arrays (tokens, token types,
    merges), byte for byte otherwise."""
    from jaxserve.model.gguf_loader import GGUFFile

    g = GGUFFile(src)
    raw = g._raw = memoryview(g.data)  # the byte view the header readers (_string, _value) walk
    n_tensors, n_kv = struct.unpack_from("<QQ", raw, 8)
    pos, kept = 24, []
    for _ in range(n_kv):
        start = pos
        key, pos = g._string(pos)
        _, pos = g._value(pos + 4, struct.unpack_from("<I", raw, pos)[0])
        if key not in _VOCABULARY:
            kept.append(bytes(raw[start:pos]))
    infos_at = pos
    for _ in range(n_tensors):
        _, pos = g._string(pos)
        ndim = struct.unpack_from("<I", raw, pos)[0]
        pos += 4 + 8 * ndim + 12
    align = int(g.metadata.get("general.alignment", 32))
    head = bytes(raw[:8]) + struct.pack("<QQ", n_tensors, len(kept)) + b"".join(kept) + bytes(raw[infos_at:pos])
    head += b"\0" * (-len(head) % align)
    with open(dst, "wb") as f:
        f.write(head)
        f.write(raw[-(-pos // align) * align:])
    return dst


@contextlib.contextmanager
def _gguf_name_map_once():
    """transformers builds gguf's (immutable) tensor-name map once per submodule, ~400 times at ~60
    ms each: while loading, the same map every time."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def load_float32(path: Path):
    """transformers' float32 model of `path` (an HF directory or a .gguf file), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if path.suffix != ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as tmp, _gguf_name_map_once():
        copy = without_vocabulary(path, Path(tmp) / path.name)
        return AutoModelForCausalLM.from_pretrained(tmp, gguf_file=copy.name, dtype=torch.float32).eval()


def greedy(model, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Per prompt (token ids), the reference's greedy continuation of `new_tokens` (no EOS stop) and
    each step's top-2 logit margin."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one-row decode of a small model: ~4x faster than 2 threads beside jax's
    out = []
    try:
        for ids in prompts:
            with torch.no_grad():
                gen = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                     eos_token_id=None, pad_token_id=0, output_scores=True,
                                     return_dict_in_generate=True)
            margins = [float(torch.topk(sc[0], 2).values.diff().abs()[0]) for sc in gen.scores]
            out.append((gen.sequences[0, len(ids):].tolist(), margins))
    finally:
        torch.set_num_threads(threads)
    return out


def compare(got: list[list[int]], reference: list[tuple[list[int], list[float]]]) -> dict:
    """Greedy texts `got` against the reference's: how many are equal, and for each that parts, its
    prompt index, the first token that differs and the reference's margin there, split into
    near-ties and the others ("far": a real numerical difference)."""
    exact, near, far = 0, [], []
    for i, (tokens, (want, margins)) in enumerate(zip(got, reference)):
        at = next((j for j, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
        if at is None:
            exact += 1
        else:
            (near if margins[at] < NEAR_TIE else far).append((i, at, round(margins[at], 3)))
    return {"prompts": len(reference), "exact": exact, "near_ties": near, "far": far}
