"""Gemma 3 text against transformers (float32, eager attention): a tiny random Gemma3ForCausalLM with
head_dim 256, sliding (window 20) and global layers alternating, each kind with its own RoPE (global
linearly scaled), query_pre_attn_scalar, a final soft cap, and (1 + w) norms with non-zero weights.
The 40-token prompt straddles the window and two 16-token KV blocks. Logits under chunked prefill
and decode; greedy tokens with 16-token prefill chunks and a prefix-cache hit; the multimodal
checkpoint layout (Gemma3ForConditionalGeneration) loads the same text model."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from jaxserve.model.config import ModelConfig
from jaxserve.model.loader import load_model
from jaxserve.worker.runner import ModelRunner, RunnerConfig
from tests.model.test_hf_parity import BS, assert_greedy_matches_hf, hf_model, run_logits

LAYERS = 4


@pytest.fixture(scope="module")
def gemma(tiny_model):
    return tiny_model("gemma3", layers=LAYERS)


def test_gemma3_config(gemma):
    c = load_model(gemma).config
    assert c.layer_types == ("sliding_attention", "full_attention") * 2
    assert [c.layer_window(i) for i in range(LAYERS)] == [20, None, 20, None]
    assert [c.layer_rope(i) for i in range(LAYERS)] == [1, 0, 1, 0]
    assert c.rope_kinds == ((1e6, {"rope_type": "linear", "factor": 8.0}), (1e4, None))
    assert c.head_dim == 256 and c.sm_scale == 144**-0.5 and c.final_soft_cap == 2.0 and c.tie_word_embeddings


def _logits_vs_transformers(path, backend, chunks, decodes):
    """Chunked prefill of the first 40 tokens (`chunks`: their lengths), then `decodes` decode steps:
    the max logit difference from transformers relative to the logit scale."""
    import torch

    lm = load_model(path)
    ids = np.random.default_rng(1).integers(3, lm.config.vocab_size, size=40 + decodes).tolist()
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0].numpy()
    runner = ModelRunner(lm.config, lm.params, RunnerConfig(
        block_size=BS, num_blocks=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
        attention_backend=backend))
    blocks, got, want, start = [7, 3, 11, 5], [], [], 0
    for n in chunks:
        got.append(run_logits(runner, ids, start, n, blocks))
        want.append(ref[start + n - 1])
        start += n
    for p in range(40, 40 + decodes):
        got.append(run_logits(runner, ids, p, 1, blocks))
        want.append(ref[p])
    return np.abs(np.stack(got) - np.stack(want)).max() / np.abs(ref).max()


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_gemma3_logits_match_transformers(gemma, backend):
    err = _logits_vs_transformers(gemma, backend, [24, 16], 6)
    assert err <= 1e-4, f"max abs logit diff {err:.2e} relative to logit scale"


def test_gemma3_logits_pallas_interpreted(tiny_model):
    """The TPU Pallas kernel (interpreted): a sliding layer and a global layer in one step, kept to
    two layers and three steps (the interpreter is slow)."""
    err = _logits_vs_transformers(tiny_model("gemma3", layers=2), "pallas", [32, 8], 1)
    assert err <= 1e-4, f"max abs logit diff {err:.2e} relative to logit scale"


def test_gemma3_greedy_chunked_and_cached(gemma):

    from jaxserve import LLM

    llm = LLM(gemma, precompile=False, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, num_blocks=32,
              prefix_cache="hash")
    prompt = "The capital of France is Paris. The capital of Italy is Rome. def add(a, b):\n    return a + b\n" * 2
    ids = llm.get_tokenizer().encode(prompt)
    assert 40 < len(ids) < 100
    assert_greedy_matches_hf(llm, gemma, prompt, 12, min_hits=32)


def test_gemma3_multimodal_checkpoint_loads_its_text_tower(gemma, tmp_path):
    """Gemma3ForConditionalGeneration: config.json nests the text model (listing only what differs
    from Gemma3TextConfig's defaults), tensors are named model.language_model.*, and the vision
    tower's tensors are skipped."""
    from safetensors.numpy import load_file, save_file

    text = json.load(open(f"{gemma}/config.json"))
    text.pop("rms_norm_eps")  # Gemma3TextConfig's default, 1e-6, fills it in
    top = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
           "vision_config": {"hidden_size": 8}, "eos_token_id": [2, 1]}
    (tmp_path / "config.json").write_text(json.dumps(top))
    weights = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(f"{gemma}/model.safetensors").items()}
    weights["model.vision_tower.patch_embedding.weight"] = np.zeros((2, 2), np.float32)
    save_file(weights, str(tmp_path / "model.safetensors"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{gemma}/{f}", tmp_path / f)
    plain, mm = load_model(gemma), load_model(str(tmp_path))
    assert mm.config.model_type == "gemma3" and mm.config.rms_norm_eps == 1e-6 and mm.config.eos_token_ids == (2, 1)
    assert mm.config.layer_types == plain.config.layer_types and mm.config.rope_kinds == plain.config.rope_kinds
    flat = lambda lm: {k: np.asarray(v) for k, v in _leaves(lm.params)}  # noqa: E731
    a, b = flat(plain), flat(mm)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _leaves(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", v


def test_gemma3_flat_transformers4_config():
    """The transformers-4 config form: rope_theta / rope_local_base_freq / rope_scaling (global only)
    and sliding_window_pattern (every 6th layer global)."""
    hf = {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
          "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 262208, "rope_theta": 1e6,
          "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
          "sliding_window": 1024, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256}
    c = ModelConfig.from_hf(hf)
    assert [i for i in range(34) if c.layer_window(i) is None] == [5, 11, 17, 23, 29]
    assert c.rope_kinds == ((1e6, {"rope_type": "linear", "factor": 8.0}), (1e4, None))
    inv = c.rope_inv_freq()
    assert inv.shape == (2, 128) and np.allclose(inv[0], 1e6 ** -(np.arange(0, 256, 2) / 256) / 8.0)
    assert c.head_dim == 256 and c.tie_word_embeddings and c.hidden_act == "gelu_tanh"


# A chat template in Gemma 3's style (written for this test, not Google's file): BOS first, the
# system message folded into the first user turn, the assistant's role named "model", content as a
# string or a list of parts, strict user/model alternation, `<start_of_turn>model` as the prompt.
GEMMA_TEMPLATE = """\
{{- bos_token -}}
{%- if messages[0].role == "system" -%}
{%- set sys = messages[0].content if messages[0].content is string else messages[0].content[0].text -%}
{%- set prefix, turns = sys + "\\n\\n", messages[1:] -%}
{%- else -%}{%- set prefix, turns = "", messages -%}{%- endif -%}
{%- for m in turns -%}
{%- if (m.role == "user") != (loop.index0 is even) -%}\
{{ raise_exception("roles must alternate user/model") }}{%- endif -%}
{{- "<start_of_turn>" + ("model" if m.role == "assistant" else m.role) + "\\n" + (prefix if loop.first else "") -}}
{%- if m.content is string -%}{{ m.content | trim }}
{%- else -%}{%- for part in m.content if part.type == "text" -%}{{ part.text | trim }}{%- endfor -%}{%- endif -%}
{{- "<end_of_turn>\\n" -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ "<start_of_turn>model\\n" }}{%- endif -%}"""


def test_gemma_chat_template_renders_through_the_server_path(tmp_path):
    """Gemma's turn markup through the server's chat-template path (a model directory's
    chat_template.jinja): system folded into the first user turn, content parts, the model role,
    and a template's own raise_exception answered as a 400 naming `messages`."""
    import asyncio

    from jaxserve.server import protocol as P
    from jaxserve.server.chat_template import ChatTemplate
    from jaxserve.server.config import ServerConfig
    from jaxserve.server.errors import APIError
    from jaxserve.tokenizer import Tokenizer
    from tests.tiny_models import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(GEMMA_TEMPLATE)
    template = ChatTemplate(Tokenizer.from_hf_dir(tmp_path), ServerConfig(), lambda n, param: None)

    def render(msgs, **kw):
        ids = asyncio.run(template.render([P.ChatMessage.model_validate(m) for m in msgs], **kw))
        return template.tok.decode(ids, skip_special_tokens=False)

    text = render([{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": [{"type": "text", "text": " Hi there "}]},
                   {"role": "assistant", "content": "Hello."},
                   {"role": "user", "content": "Capital of France?"}])
    assert text == ("<|endoftext|><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(APIError) as e:
        render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert e.value.status == 400 and e.value.param == "messages" and "alternate" in str(e.value)
