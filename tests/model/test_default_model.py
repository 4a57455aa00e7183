"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end.

Greedy tokens from our GGUF loader + Flax model must equal transformers' own GGUF loader (torch)
on the same file; the CLI must answer the France question with Paris.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Les montagnes les plus hautes",
    "Once upon a time, in a land far away,",
]


@pytest.fixture(scope="module")
def default_llm():
    from jaxserve import LLM

    return LLM(precompile=False, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=64 << 20)


def test_greedy_tokens_match_transformers_gguf_loader(default_llm):
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve import SamplingParams

    # The default model is a bfloat16 checkpoint (Q4_1 GGUF) computed in float32: its KV cache is
    # bfloat16 by default, and greedy tokens still match transformers' float32 forward.
    assert str(default_llm.engine.runner.kv_dtype) == "bfloat16"
    path = default_llm.engine.loaded.path
    ref_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32)
    outs = default_llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                                use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = out.prompt_token_ids
        with torch.no_grad():
            ref = ref_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, prompt


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
