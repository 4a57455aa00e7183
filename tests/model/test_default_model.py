"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end.

Greedy tokens from our GGUF loader + Flax model must equal transformers' own GGUF loader (torch)
on the same file; the CLI must answer the France question with Paris.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.model.gguf_loader import GGUFFile

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Les montagnes les plus hautes",
    "Once upon a time, in a land far away,",
]


@pytest.fixture(scope="module")
def default_llm():
    from jaxserve import LLM

    # exact float32 (the default here may be another format: jaxserve/default_format.py; the CLI
    # test below runs the defaults)
    return LLM(precompile=False, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=64 << 20,
               quantization="none")


def _without_vocabulary(src: Path, dst: Path) -> Path:
    """A copy of a GGUF file without its three vocabulary arrays (tokens, token types, merges),
    byte for byte otherwise. transformers' GGUF reader takes about a minute here to index those
    ~150k strings, which the model's config (llama.vocab_size) and tensors do not need."""
    g = GGUFFile(src)
    raw = g._raw = memoryview(g.data)  # the byte view the header readers (_string, _value) walk
    n_tensors, n_kv = struct.unpack_from("<QQ", raw, 8)
    pos, kept = 24, []
    for _ in range(n_kv):
        start = pos
        key, pos = g._string(pos)
        _, pos = g._value(pos + 4, struct.unpack_from("<I", raw, pos)[0])
        if key not in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
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


NEW_TOKENS = 24
NEAR_TIE = 0.05  # tests/test_default_numerics.py's: a top-2 margin below it is a near-tie


@pytest.fixture(scope="module")
def reference(default_llm, tmp_path_factory):
    """transformers' float32 forward of the same GGUF (its own loader): per prompt, the prompt ids,
    the greedy tokens and each step's top-2 logit margin."""
    import functools

    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    # transformers builds gguf's (immutable) tensor-name map once per submodule, ~400 times at
    # ~60 ms each: built once here, the same map every time.
    mp = pytest.MonkeyPatch()
    mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
    path = _without_vocabulary(default_llm.engine.loaded.path, tmp_path_factory.mktemp("ref") / "model.gguf")
    ref_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32)
    mp.undo()
    tok = default_llm.get_tokenizer()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one-row decode of a small model: 4x faster than 2 threads beside jax's
    out = []
    try:
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            with torch.no_grad():
                gen = ref_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                         eos_token_id=None, pad_token_id=0, output_scores=True,
                                         return_dict_in_generate=True)
            margins = [float(torch.topk(sc[0], 2).values.diff().abs()[0]) for sc in gen.scores]
            out.append((ids, gen.sequences[0, len(ids):].tolist(), margins))
    finally:
        torch.set_num_threads(threads)
    return out


def _greedy(llm):
    from jaxserve import SamplingParams

    return llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
                        use_tqdm=False)


def test_greedy_tokens_match_transformers_gguf_loader(default_llm, reference):
    # The default model is a bfloat16 checkpoint (Q4_1 GGUF); computed in float32 with its default
    # bfloat16 KV cache, greedy tokens match transformers' float32 forward exactly.
    assert str(default_llm.engine.runner.kv_dtype) == "bfloat16"
    for prompt, out, (ids, want, _) in zip(PROMPTS, _greedy(default_llm), reference):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == want, prompt


def test_default_settings_match_the_reference_outside_near_ties(reference):
    """The shipped model with no settings at all: the format this machine picks by default
    (jaxserve/default_format.py: bfloat16 where the CPU has bfloat16 dot products) parts from the
    float32 reference only where its top-2 margin is a near-tie."""
    from jaxserve import LLM

    llm = LLM(precompile=False, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64,
              kv_cache_memory=64 << 20)
    # bfloat16 compute on the native attention passes the machine's dot-product choice to it (isa 1
    # where the bfloat16 matmul has AVX-512 BF16; float32 compute keeps isa 0: test_cpu_kernel.py)
    backend = llm.engine.runner.backend
    if llm.engine.quantization == "bfloat16" and backend.attention == "cpu":
        from jaxserve.runtime import cpu_kernels

        assert backend.attention_isa == cpu_kernels.attention_isa(backend.dot_isa)
        assert ("avx512_bf16 dot products" in backend.describe()) == (backend.attention_isa == 1)
    exact, far = 0, []
    for prompt, out, (_, want, margins) in zip(PROMPTS, _greedy(llm), reference):
        got = out.outputs[0].token_ids
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if at is None:
            exact += 1
        elif margins[at] >= NEAR_TIE:
            far.append((prompt, at, round(margins[at], 3)))
    assert not far, f"{llm.engine.quantization}: greedy parted from the float32 reference outside near-ties: {far}"
    assert exact >= len(PROMPTS) // 2


def test_chat_answers_paris(default_llm):
    from jaxserve import SamplingParams

    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_cli_generate_answers_paris():
    r = run_cli("generate", "--max-model-len", "512", "--kv-cache-memory", "64MiB", "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["generate", "--model", "/no/such/model", "hi"], "does not exist"),
        (["generate", "--temperature", "-1", "--max-model-len", "512", "--kv-cache-memory", "64MiB", "hi"],
         "temperature"),
        (["generate", "--kv-cache-memory", "lots", "hi"], "memory size"),
        (["generate", "--max-model-len", "16", "--kv-cache-memory", "64MiB", "--raw", "word " * 40], "max_model_len"),
    ],
)
def test_cli_errors_are_one_line(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert needle in lines[-1] and "Traceback" not in r.stderr, r.stderr
