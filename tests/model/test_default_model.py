"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end.

Greedy tokens from our GGUF loader + Flax model must equal transformers' own GGUF loader (torch)
on the same file; the CLI must answer the France question with Paris.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench import hf_reference

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


NEW_TOKENS = 24


@pytest.fixture(scope="module")
def reference(default_llm):
    """transformers' float32 forward of the same GGUF (its own loader, bench/hf_reference.py): per
    prompt, the greedy tokens and each step's top-2 logit margin."""
    tok = default_llm.get_tokenizer()
    model = hf_reference.load_float32(default_llm.engine.loaded.path)
    return hf_reference.greedy(model, [tok.encode(p) for p in PROMPTS], NEW_TOKENS)


def _greedy(llm):
    from jaxserve import SamplingParams

    return llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
                        use_tqdm=False)


def test_greedy_tokens_match_transformers_gguf_loader(default_llm, reference):
    # The default model is a bfloat16 checkpoint (Q4_1 GGUF); computed in float32 with its default
    # bfloat16 KV cache, greedy tokens match transformers' float32 forward exactly.
    assert str(default_llm.engine.runner.kv_dtype) == "bfloat16"
    tok = default_llm.get_tokenizer()
    for prompt, out, (want, _) in zip(PROMPTS, _greedy(default_llm), reference):
        assert out.prompt_token_ids == tok.encode(prompt)  # the ids the reference continued
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
    seen = hf_reference.compare([o.outputs[0].token_ids for o in _greedy(llm)], reference)
    far = [(PROMPTS[i], at, margin) for i, at, margin in seen["far"]]
    assert not far, f"{llm.engine.quantization}: greedy parted from the float32 reference outside near-ties: {far}"
    assert seen["exact"] >= len(PROMPTS) // 2


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
