"""Incremental detokenizer: UTF-8 safety, stop strings across token boundaries, deltas == final text."""

import random

import pytest

from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.model.default_model import default_model_path
from jaxserve.tokenizer import Tokenizer

TEXTS = [
    "Héllo 😀👍🏽 日本語 wörld!\n\nSTOP here 🇫🇷 end",
    "The capital of France is Paris. 👨‍👩‍👧 family",
    "中文文本。한국어 텍스트 ❤️❤️❤️ ok",
    "def f(x):\n    return x ** 2\n\n\nprint(f(3))",
    "a  b   c    d\t\te",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(default_model_path(download=False))


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.apply_chat_template([{"role": "user", "content": "Say something."}])


def run(tok, prompt, ids, **kw):
    d = IncrementalDetokenizer(tok, prompt, **kw)
    deltas = []
    for t in ids:
        deltas.append(d.add(t))
        if d.stopped:
            break
    deltas.append(d.flush())
    return d, deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_text_and_never_split_chars(tok, prompt, text):
    ids = tok.encode(text, add_special_tokens=False)
    # the test is meaningful: some single tokens are partial UTF-8 sequences
    if any(ord(c) > 0x7FF for c in text):
        assert any("\ufffd" in tok.decode([i]) for i in ids)
    d, deltas = run(tok, prompt, ids)
    assert "".join(deltas) == d.text == tok.decode(ids) == text
    assert not any("\ufffd" in x for x in deltas)
    assert not d.stopped and d.stop_str is None


def test_emoji_split_across_tokens(tok, prompt):
    ids = tok.encode("👍🏽", add_special_tokens=False)
    assert len(ids) > 2
    d = IncrementalDetokenizer(tok, prompt)
    out = [d.add(i) for i in ids]
    assert out[:-1] == [""] * (len(ids) - 1) or all("\ufffd" not in o for o in out)
    assert "".join(out) + d.flush() == "👍🏽"


def test_no_prompt_and_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nHi 😀<|im_end|>", add_special_tokens=False)
    d, deltas = run(tok, [], ids)
    assert "".join(deltas) == d.text == "assistant\nHi 😀"
    d, deltas = run(tok, [], ids, skip_special_tokens=False)
    assert "".join(deltas) == "<|im_start|>assistant\nHi 😀<|im_end|>"


def test_char_cut_at_finish_leaves_no_replacement_char(tok, prompt):
    """max_tokens cutting a multi-byte character: the text ends before it, with no U+FFFD."""
    ids = tok.encode("ok 😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    assert tok.decode(ids).endswith("\ufffd")  # the test is meaningful
    d = IncrementalDetokenizer(tok, prompt)
    got = "".join(d.add(i) for i in ids)
    got += d.flush()
    assert got == d.text == tok.decode(ids).rstrip("\ufffd") == "ok "


@pytest.mark.parametrize("stop,include,expect", [
    (["\n\nSTOP"], False, "Héllo 😀👍🏽 日本語 wörld!"),
    (["\n\nSTOP"], True, "Héllo 😀👍🏽 日本語 wörld!\n\nSTOP"),
    (["ld!\n"], False, "Héllo 😀👍🏽 日本語 wör"),
    (["日本"], False, "Héllo 😀👍🏽 "),
    (["👍🏽 日"], True, "Héllo 😀👍🏽 日"),
    (["zzz", "STOP", "here"], False, "Héllo 😀👍🏽 日本語 wörld!\n\n"),
    (["end"], False, "Héllo 😀👍🏽 日本語 wörld!\n\nSTOP here 🇫🇷 "),
    (["nomatch"], False, "Héllo 😀👍🏽 日本語 wörld!\n\nSTOP here 🇫🇷 end"),
])
def test_stop_strings(tok, prompt, stop, include, expect):
    text = TEXTS[0]
    ids = tok.encode(text, add_special_tokens=False)
    d, deltas = run(tok, prompt, ids, stop=stop, include_stop_str_in_output=include)
    assert "".join(deltas) == d.text == expect
    assert d.stopped == (stop != ["nomatch"])
    if d.stopped:
        assert d.stop_str in stop and d.add(ids[0]) == "" and d.flush() == ""


def test_stop_string_never_leaks_while_streaming(tok, prompt):
    text = "one two three FIN four"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt, stop=["three FIN"])
    streamed = ""
    for t in ids:
        streamed += d.add(t)
        assert "three" not in streamed and "FIN" not in streamed
        if d.stopped:
            break
    assert d.stopped and streamed == "one two " and d.text == "one two "


def test_random_stops_property(tok, prompt):
    rng = random.Random(0)
    for _ in range(150):
        text = rng.choice(TEXTS)
        ids = tok.encode(text, add_special_tokens=False)
        stops = []
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text))
            stops.append(text[i:i + rng.randint(1, 6)])
        include = rng.random() < 0.5
        d, deltas = run(tok, prompt, ids, stop=stops, include_stop_str_in_output=include)
        # the stop string complete first in the text wins (ties: the longer), whatever the tokens
        end, neg_len, s = min((text.find(s) + len(s), -len(s), s) for s in stops if s in text)
        assert d.stopped and d.stop_str == s
        j = end + neg_len
        expect = text[: j + (len(d.stop_str) if include else 0)]
        assert "".join(deltas) == d.text == expect
        assert not any("\ufffd" in x for x in deltas)
