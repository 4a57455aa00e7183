"""tools/export_hf.py: the default model exported as an HF directory runs in transformers (float32)
with jaxserve's logprobs and greedy tokens, its tokenizer and chat template, and a layout vLLM loads
(the tied embedding under model.embed_tokens.weight)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from bench.common import REPO
from jaxserve.errors import UserError

PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
N_TOP = 5


def _tool():
    spec = importlib.util.spec_from_file_location("export_hf", REPO / "tools" / "export_hf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-hf")
    subprocess.run([sys.executable, str(REPO / "tools" / "export_hf.py"), "--dtype", "float32", "--out", str(out)],
                   check=True, cwd=REPO, timeout=300)
    return out


@pytest.mark.slow
def test_layout_and_config(export):
    from safetensors import safe_open

    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 100000.0
    assert cfg["dtype"] == cfg["torch_dtype"] == "float32"
    with safe_open(str(export / "model.safetensors"), "np") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == 2 + 30 * 9
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.slow
def test_transformers_matches_jaxserve(export):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxserve import LLM, SamplingParams

    llm = LLM(precompile=False, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64, num_blocks=32,
              kv_cache_dtype="float32",  # the default bfloat16 KV would differ from float32 by ~2e-3
              quantization="none")  # exact float32, whatever format this machine runs by default
    tok = AutoTokenizer.from_pretrained(str(export))
    ours = llm.get_tokenizer()
    assert tok(PROMPT)["input_ids"] == ours.encode(PROMPT)
    chat = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        ours.hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)

    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=N_TOP, prompt_logprobs=N_TOP)
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    prompt, gen = out.prompt_token_ids, out.outputs[0].token_ids
    ids = prompt + gen
    model = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double().numpy()  # row p predicts ids[p + 1]
    ref = logits - logits.max(-1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(-1, keepdims=True))
    scale = np.abs(logits).max()

    # greedy: every generated token is transformers' argmax after the tokens before it
    assert gen == logits[len(prompt) - 1:].argmax(-1).tolist()
    got, want = [], []
    steps = out.prompt_logprobs[1:] + out.outputs[0].logprobs  # TokenLogprob for ids[1:], in order
    assert len(steps) == len(ids) - 1
    for p, lp in enumerate(steps):
        assert lp.token_id == ids[p + 1]
        got.append(lp.logprob)
        want.append(ref[p, ids[p + 1]])
        assert len(lp.top) == N_TOP
        for t, v in lp.top:
            got.append(v)
            want.append(ref[p, t])
    err = np.abs(np.array(got) - np.array(want)).max() / scale
    assert err <= 1e-3, f"max logprob difference {err:.2e} relative to the logit scale {scale:.1f}"


def test_refuses_a_non_gguf_model(tmp_path):
    with pytest.raises(UserError, match="not a .gguf file"):
        _tool().export_hf(str(tmp_path), tmp_path / "out")
    with pytest.raises(UserError, match="dtype"):
        _tool().export_hf(None, tmp_path / "out", dtype="int8")
