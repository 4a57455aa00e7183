"""Tokenizer: the GGUF-metadata tokenizer matches transformers' GGUF-derived one; HF dirs load; no torch."""

import json
import subprocess
import sys

import pytest

from jaxserve.model.default_model import default_model_path
from jaxserve.tokenizer import Tokenizer

TEXTS = [
    "Hello world!", "The capital of France is", "",
    "Café résumé naïve façade Ωμέγα Привет", "日本語のテキスト、中文文本。한국어 텍스트",
    "emoji 😀👍🏽🇫🇷 👨‍👩‍👧 ❤️", "def f(x):\n\treturn x**2  # square\n\n\nclass A: pass",
    "   lots   of\t\tspaces \n\n  ", "<|im_start|>user\nHi<|im_end|>\n<repo_name>x<file_sep>y",
    "In 2024, 12345 apples cost $3.50 (≈ €3.20)", " leading space", "a\r\nb\r\n", "ＡＢＣ　全角",
    "x" * 300, "don't won't I'm they're", "<|endoftext|>", "<|im_start|", "\u200b zero width",
]


@pytest.fixture(scope="module")
def path():
    return default_model_path(download=False)


@pytest.fixture(scope="module")
def tok(path):
    return Tokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def ref(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_parity(tok, ref, text):
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert tok.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)


def test_digits_split_individually(tok):
    # llama.cpp's "smollm" pre-tokenizer (and the original tokenizer.json) split every digit
    toks = tok.convert_ids_to_tokens(tok.encode("year 2024 and 31415"))
    assert [t for t in toks if t.strip("Ġ").isdigit()] == list("202431415")


def test_special_tokens_and_facts(tok, ref):
    assert tok.vocab_size == 49152 == len(ref)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == {2} and tok.pad_token_id == 2
    assert tok.encode("<|im_start|>assistant") == [1, 520, 9531]
    assert tok.decode([1, 520, 9531]) == "assistant"
    assert tok.decode([1, 520, 9531], skip_special_tokens=False) == "<|im_start|>assistant"
    assert {0, 1, 2} <= tok.all_special_ids


def test_chat_template_parity(tok, ref):
    assert tok.has_chat_template
    convs = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi! 😀"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "日本語?"}],
    ]
    for msgs in convs:
        for gen in (True, False):
            text = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False) == text
            ids = ref.apply_chat_template(msgs, add_generation_prompt=gen, return_dict=True)["input_ids"]
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == list(ids)
    assert tok.apply_chat_template(convs[0], tokenize=False).endswith("<|im_start|>assistant\n")


def test_hf_dir(tmp_path, ref):
    ref.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    t = Tokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert t.encode(text) == ref.encode(text)
        assert t.decode(t.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)
    assert t.eos_token_ids == {0, 2}
    msgs = [{"role": "user", "content": "Hi"}]
    assert t.apply_chat_template(msgs, tokenize=False) == ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)


def test_hf_dir_chat_template_jinja_file(tmp_path, ref):
    ref.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    t = Tokenizer.from_pretrained(tmp_path)
    assert t.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "[x]"


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        Tokenizer.from_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_gguf_tokenizer_needs_no_torch(path):
    code = ("import sys; from jaxserve.tokenizer import Tokenizer; "
            f"t = Tokenizer.from_pretrained({str(path)!r}); "
            "assert t.encode('Hello') and t.apply_chat_template([{'role': 'user', 'content': 'x'}]); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def _spm_gguf(path):
    import gguf
    import numpy as np

    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁w", "el", "ll", "llo", "▁hel", "▁hello",
              "or", "orl", "▁world", "▁wor", "ld", "a", "▁a"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", [0.0] * 259 + [-float(i) for i in range(len(pieces))])
    w.add_array("tokenizer.ggml.token_type", [2, 3, 3] + [6] * 256 + [1] * len(pieces))
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def test_sentencepiece_gguf(tmp_path):
    """A sentencepiece ("llama") GGUF vocabulary: merges rebuilt from scores, byte fallback, BOS."""
    from transformers import AutoTokenizer

    _spm_gguf(tmp_path / "spm.gguf")
    t = Tokenizer.from_pretrained(tmp_path / "spm.gguf")
    r = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for s in ["hello world", "hello\nworld é😀", "", "a", "wor ld", "hello</s>"]:
        assert t.encode(s) == r.encode(s), s
        ids = t.encode(s)
        for skip in (True, False):
            assert t.decode(ids, skip) == r.decode(ids, skip_special_tokens=skip)
    assert t.bos_token_id == 1 and t.eos_token_ids == {2} and t.encode("a")[0] == 1
    # Leading spaces: llama.cpp / sentencepiece always add the dummy prefix ("▁▁a"); transformers'
    # Metaspace skips it when the text already starts with a space. We follow llama.cpp.
    assert t.convert_ids_to_tokens(t.encode("  a")) == ["<s>", "▁", "▁", "▁a"]
    assert t.decode(t.encode("  a")) == "  a"
