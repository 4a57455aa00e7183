"""Admission-time bounds on everything a request can size (README "Limits").

A bad value must be refused where the request is *admitted* (a 400 naming the field), never where
it is first *used*: inside the engine step (where a too-wide row used to kill the loop for every
request) or inside a native grammar compiler (where deep recursion overflows the C stack and
kills the process). Each bound here is checked once, cheaply, before any costly or native work,
by code that does not recurse, so a hostile value cannot hurt the check itself.

Measured with llguidance 1.9.1 (a chain `r_i: r_(i+1) "a"`): 2,000 rules compile on an 8 MiB
stack, 5,000 segfault on it and compile on 64 MiB; schemas nested 5,000 deep are refused by
llguidance ("recursion limit exceeded"), 50,000 deep segfault even on 256 MiB. So: grammars and
schemas are bounded here, and the compiler's threads run on a large stack as a second fence.
"""

from __future__ import annotations

import json
import re

from jaxserve.core.errors import UserError

MAX_JSON_DEPTH = 64  # nesting of a JSON schema, tool parameters, tool-call arguments
MAX_SCHEMA_BYTES = 256 << 10  # a JSON schema's (or all tools' parameters') canonical size
MAX_GRAMMAR_BYTES = 128 << 10  # a Lark/GBNF grammar or regex
MAX_GRAMMAR_RULES = 2000  # rule definitions in a Lark/GBNF grammar
MAX_GRAMMAR_NESTING = 200  # open parentheses/brackets in a grammar or regex
MAX_CHOICES = 4096  # entries of a `choice` list
MAX_LOGIT_BIAS_KEY_DIGITS = 10  # a token id's decimal digits (int() on 5,000 digits is refused)
MAX_STOP_STRINGS = 64  # entries of `stop`
MAX_STOP_CHARS = 1024  # characters of one stop string
MAX_STOP_TOKEN_IDS = 512  # entries of `stop_token_ids` (each is a ban before min_tokens)
MAX_MESSAGES = 10_000  # messages of one chat request
MAX_CONTENT_PARTS = 10_000  # content parts of one chat request (all messages)
MAX_TOOLS = 512  # entries of `tools`

_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_.]*(?:\{[^}\n]*\})?[ \t]*(?::|::=)", re.M)


def value_depth(value) -> int:
    """The deepest nesting of dicts and lists in a parsed JSON value, iteratively."""
    top, todo = 0, [(value, 0)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            v = list(v.values())
        elif not isinstance(v, list):
            continue
        top = max(top, d + 1)
        if d + 1 > MAX_JSON_DEPTH:
            return d + 1  # deep enough to refuse: stop walking
        todo.extend((x, d + 1) for x in v)
    return top


def loads_bounded(text: str, param: str, what: str = "The JSON value"):
    """json.loads, with nesting past MAX_JSON_DEPTH a 400 (the C parser stops at Python's
    recursion limit with a RecursionError, which used to be a 500)."""
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
        deep = True
    else:
        deep = value_depth(value) > MAX_JSON_DEPTH
    if deep:
        raise UserError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels: flatten it.", param=param)
    return value


def check_json_value(value, param: str, what: str = "The JSON schema") -> None:
    if value_depth(value) > MAX_JSON_DEPTH:
        raise UserError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels: flatten it.", param=param)


def json_size_floor(value, stop: int) -> int:
    """A lower bound of `value`'s JSON size (each string with its quotes, each other scalar at
    least a byte), walked iteratively in Python so a huge schema is refused before one long
    json.dumps call holds the GIL (a 4 MB schema stalled /health 0.7 s); stops past `stop`."""
    size, todo = 0, [value]
    while todo and size <= stop:
        v = todo.pop()
        if isinstance(v, dict):
            size += 2 + len(v)  # braces and colons
            for k, x in v.items():
                size += len(k) + 2
                todo.append(x)
        elif isinstance(v, list):
            size += 2
            todo.extend(v)
        else:
            size += len(v) + 2 if isinstance(v, str) else 1
    return size


def check_schema_floor(value, param: str) -> None:
    """The MAX_SCHEMA_BYTES bound on a parsed schema, before it is serialized."""
    if json_size_floor(value, MAX_SCHEMA_BYTES) > MAX_SCHEMA_BYTES:
        raise UserError(f"The schema is more than the limit of {MAX_SCHEMA_BYTES} bytes: simplify it.",
                        param=param)


def check_schema_size(canonical: str, param: str) -> None:
    if len(canonical) > MAX_SCHEMA_BYTES:
        raise UserError(f"The schema is {len(canonical)} bytes, more than the limit of {MAX_SCHEMA_BYTES}: "
                        "simplify it.", param=param)


def check_grammar_text(text: str, param: str, kind: str = "grammar") -> None:
    """Size, rule count and bracket nesting of a grammar or regex, before any parser sees it."""
    if len(text) > MAX_GRAMMAR_BYTES:
        raise UserError(f"The {kind} has {len(text)} characters, more than the limit of "
                        f"{MAX_GRAMMAR_BYTES}: simplify it.", param=param)
    depth = top = 0
    for ch in text:  # brackets inside literals count too: a safe over-estimate
        if ch in "([{":
            depth += 1
            top = max(top, depth)
        elif ch in ")]}":
            depth = max(0, depth - 1)
    if top > MAX_GRAMMAR_NESTING:
        raise UserError(f"The {kind} nests brackets {top} deep, more than the limit of "
                        f"{MAX_GRAMMAR_NESTING}: simplify it.", param=param)
    if kind == "grammar":
        rules = len(_RULE.findall(text))
        if rules > MAX_GRAMMAR_RULES:
            raise UserError(f"The grammar has {rules} rules, more than the limit of {MAX_GRAMMAR_RULES}: "
                            "simplify it.", param=param)


def parse_token_id_key(key: str, param: str = "logit_bias") -> int:
    """A logit_bias key: ASCII digits only ('²' is a digit to str.isdigit, not to int), short."""
    if not (key.isascii() and key.isdigit()) or len(key) > MAX_LOGIT_BIAS_KEY_DIGITS:
        raise UserError(f"Invalid {param} key {key[:20]!r}: keys must be token ids (decimal digits).",
                        param=param)
    return int(key)


def worst_row_adjustments(*, bias_and_bans: int, prompt_len: int, max_tokens: int,
                          penalties: bool, repetition: bool, vocab_size: int, lookahead: int = 0) -> int:
    """The most sparse logit adjustments one sampling row of this request can ever need:
    its bias entries and bans (stop tokens, EOS before min_tokens), plus, with penalties, every
    distinct token it can generate (and with the repetition penalty, every prompt token).
    `lookahead`: tokens a verification row sees ahead of the output (speculative drafts)."""
    n = bias_and_bans
    if penalties:
        n += max_tokens + lookahead + (prompt_len if repetition else 0)
    return min(n, vocab_size)


def check_row_width(worst: int, width: int, *, penalties: bool) -> None:
    if worst > width:
        fix = ("lower 'max_tokens' or drop the penalties" if penalties else "send fewer entries")
        raise UserError(
            f"This request can need {worst} logit adjustments per sampling row (logit_bias entries, "
            f"banned stop/EOS tokens{' and penalised tokens' if penalties else ''}), more than this "
            f"engine's row width of {width}: {fix}.", param="logit_bias")
