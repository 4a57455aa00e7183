"""One tokenizer API for the engine, loaded from a Hugging Face directory or a GGUF file.

    tok = Tokenizer.from_pretrained("path/to/hf-dir")      # or "model.gguf"
    ids = tok.encode("Hello")                               # adds BOS only if the model wants it
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    text = tok.decode(ids)

A GGUF file carries no tokenizer.json: the vocabulary, merges, token types, special-token ids and
chat template are GGUF metadata, and a `tokenizers.Tokenizer` is rebuilt from them here (no torch;
`PreTrainedTokenizerFast` is used only as a wrapper for decoding details and chat templates).
"""

from __future__ import annotations

from jaxserve.errors import UserError
import importlib
import json
import os
import pathlib
import threading
from functools import lru_cache
from typing import Any
from collections.abc import Iterable, Sequence

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _TkTokenizer
from tokenizers.models import BPE

# llama.cpp token types (tokenizer.ggml.token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Split regexes of llama.cpp's `tokenizer.ggml.pre` types (llama-vocab.cpp); default is GPT-2's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"),
                    _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}
# Vocabularies whose pre-tokenizer splits every digit off first (llama.cpp: "\p{N}" then GPT-2's
# regex; the original HF tokenizer.json: Digits(individual_digits=True) + ByteLevel).
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact"}


def import_in_background() -> None:
    """Import transformers (the tokenizer's wrapper: ~1.5 s, mostly its lazy-import index) on a
    thread, so it overlaps jax's import and the weights' load instead of following them (the CLI
    calls this first; measured 2-5 s off a loaded machine's `generate`). Idempotent; errors are left
    to the real import."""
    if _preload:
        return

    def run():
        try:
            importlib.import_module("transformers.tokenization_utils_fast")
        except Exception:  # noqa: BLE001 - the tokenizer's own import reports it
            pass

    _preload.append(threading.Thread(target=run, name="jaxserve-import-transformers", daemon=True))
    _preload[0].start()


_preload: list = []


def _await_preload() -> None:
    """Wait for the background import: transformers' lazy module answers a name from another thread
    with ImportError while that thread is still importing it (seen under load: 'cannot import name
    AutoTokenizer')."""
    for thread in _preload:
        thread.join()


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _gguf_backend(md: dict, path: str) -> tuple[_TkTokenizer, dict[str, Any]]:
    """A `tokenizers.Tokenizer` from GGUF tokenizer metadata, plus the special-token facts."""
    kind = md.get("tokenizer.ggml.model")
    tokens: list[str] | None = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise UserError(f"{path}: GGUF file has no tokenizer (tokenizer.ggml.tokens missing)")
    types = md.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    merges_md = md.get("tokenizer.ggml.merges")

    if kind == "gpt2":
        alphabet = set(_byte_alphabet().values())
        spell = _byte_alphabet()
        vocab = {}
        for i, t in enumerate(tokens):
            key = t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))
            vocab.setdefault(key, i)
        merges = [tuple(m.split(" ", 1)) for m in merges_md or ()]
        tk = _TkTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        pre = md.get("tokenizer.ggml.pre", "default")
        if pre in _PRE_SPLITS:
            tk.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        elif pre in _DIGIT_SPLIT_PRES:
            tk.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ])
        else:
            tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
        default_add_bos = False
        keep_control = lambda t: set(t) <= alphabet  # noqa: E731 (llama.cpp mislabels; as transformers)
    elif kind == "llama":
        vocab = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        if merges_md:
            merges = [tuple(m.split(" ", 1)) for m in merges_md]
        else:
            merges = _merges_from_scores(tokens, md.get("tokenizer.ggml.scores"))
        unk_id = md.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if unk_id is not None else None
        tk = _TkTokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                              byte_fallback=True))
        prefix = md.get("tokenizer.ggml.add_space_prefix", True)
        norms = ([normalizers.Prepend("▁")] if prefix else []) + [normalizers.Replace(" ", "▁")]
        tk.normalizer = normalizers.Sequence(norms)
        decs = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            decs.append(decoders.Strip(" ", 1, 0))
        tk.decoder = decoders.Sequence(decs)
        default_add_bos = True
        keep_control = lambda t: True  # noqa: E731
    else:
        raise UserError(f"{path}: unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")

    special = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, types) if ty == _CONTROL and keep_control(t)]
    tk.add_special_tokens(special)
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
    if user:
        tk.add_tokens(user)

    def tok_of(key):
        i = md.get(f"tokenizer.ggml.{key}")
        return (i, tokens[i]) if i is not None and 0 <= i < len(tokens) else (None, None)

    bos_id, bos = tok_of("bos_token_id")
    eos_id, eos = tok_of("eos_token_id")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", default_add_bos)) and bos is not None
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
        st = {t: i for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None}
        tk.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                          special_tokens=list(st.items()))
    extra = {
        "bos_token": bos, "eos_token": eos,
        "unk_token": tok_of("unknown_token_id")[1], "pad_token": tok_of("padding_token_id")[1],
        "eos_ids": [i for i in (eos_id, md.get("tokenizer.ggml.eot_token_id"),
                                md.get("tokenizer.ggml.eom_token_id")) if i is not None],
        "chat_template": md.get("tokenizer.chat_template"),
    }
    return tk, extra


def _merges_from_scores(tokens: list[str], scores: list[float] | None) -> list[tuple[str, str]]:
    """Rebuild BPE merges for a sentencepiece vocabulary from token scores (higher merges first)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    score = (lambda t: scores[vocab[t]]) if scores else (lambda t: -vocab[t])
    found = []
    for t in tokens:
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                found.append((score(t), vocab[a], vocab[b], a, b))
    found.sort(key=lambda x: (-x[0], x[1], x[2]))
    return [(a, b) for *_, a, b in found]


class Tokenizer:
    """Thin wrapper over a `transformers.PreTrainedTokenizerFast` with the engine's API."""

    def __init__(self, hf_tokenizer, *, eos_token_ids: Iterable[int] = (), name_or_path: str = ""):
        self.hf = hf_tokenizer
        self.name_or_path = name_or_path
        eos = set(int(i) for i in eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: set[int] = eos
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.pad_token_id: int | None = hf_tokenizer.pad_token_id
        self.vocab_size: int = len(hf_tokenizer)
        self.all_special_ids: set[int] = set(
            i for i, t in hf_tokenizer.added_tokens_decoder.items() if t.special
        ) | set(hf_tokenizer.all_special_ids)
        # Decoding runs per token per request on the engine thread: call the Rust tokenizer
        # directly where transformers' wrapper would add nothing (no clean-up of spaces), which
        # halves its cost; the wrapper otherwise.
        raw = getattr(hf_tokenizer, "_tokenizer", None)
        self._raw_decode = (raw.decode if raw is not None and hasattr(raw, "decode")
                            and not getattr(hf_tokenizer, "clean_up_tokenization_spaces", False) else None)

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: os.PathLike | str) -> "Tokenizer":
        """From an HF model directory or a `.gguf` file."""
        p = pathlib.Path(path)
        if p.is_file():
            return cls.from_gguf(p)
        if p.is_dir():
            return cls.from_hf_dir(p)
        raise UserError(f"Tokenizer path not found: {p}")

    @classmethod
    def from_gguf(cls, path: os.PathLike | str, metadata: dict | None = None) -> "Tokenizer":
        _await_preload()
        from transformers import PreTrainedTokenizerFast

        path = str(path)
        if metadata is None:
            from jaxserve.model.gguf_loader import GGUFFile

            metadata = GGUFFile(path).metadata
        tk, extra = _gguf_backend(metadata, path)
        kwargs = {k: extra[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                  if extra[k] is not None}
        hf = PreTrainedTokenizerFast(tokenizer_object=tk, clean_up_tokenization_spaces=False, **kwargs)
        if extra["chat_template"]:
            hf.chat_template = extra["chat_template"]
        return cls(hf, eos_token_ids=extra["eos_ids"], name_or_path=path)

    @classmethod
    def from_hf_dir(cls, path: os.PathLike | str) -> "Tokenizer":
        _await_preload()
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        p = pathlib.Path(path)
        if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
            raise UserError(f"{p}: no tokenizer.json or tokenizer_config.json in the model directory")
        try:
            hf = AutoTokenizer.from_pretrained(str(p))
        except Exception as e:  # e.g. a tokenizer class needing sentencepiece: use tokenizer.json
            if not (p / "tokenizer.json").is_file():
                raise UserError(f"{p}: cannot load the tokenizer: {e}") from None
            cfg = _read_json(p / "tokenizer_config.json")
            kw = {k: v for k, v in cfg.items() if k in (
                "bos_token", "eos_token", "unk_token", "pad_token", "chat_template",
                "clean_up_tokenization_spaces") and isinstance(v, (str, bool))}
            hf = PreTrainedTokenizerFast(tokenizer_file=str(p / "tokenizer.json"), **kw)
        if not getattr(hf, "chat_template", None) and (p / "chat_template.jinja").is_file():
            hf.chat_template = (p / "chat_template.jinja").read_text()
        eos: list[int] = []
        gen = _read_json(p / "generation_config.json")
        src = gen if "eos_token_id" in gen else _read_json(p / "config.json")
        e = src.get("eos_token_id")
        eos += e if isinstance(e, list) else ([e] if e is not None else [])
        return cls(hf, eos_token_ids=eos, name_or_path=str(p))

    # ---- API -----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._raw_decode is not None:
            return self._raw_decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(ids))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True, **kwargs) -> list[int] | str:
        """Render `messages` with the model's chat template; token ids (default) or the text.

        The rendered text already holds any BOS the template writes, so it is encoded without
        adding special tokens (as transformers does).
        """
        if not self.has_chat_template:
            raise UserError(f"The tokenizer of {self.name_or_path or 'this model'} has no chat template")
        text = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           tokenize=False, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size})"


def _read_json(p: pathlib.Path) -> dict:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
