"""A request body read as JSON within bounds, so that no body a client can send costs the server more
than reading it: Python's parser recurses once per nesting level (a body nested 10,000 deep raises
RecursionError) and turns an integer literal into a number in time quadratic in its digits (past 4,300
digits it refuses with ValueError). Both bounds are checked before any value is built, and every way a
body can be wrong is a ProtocolError (400) that names what is wrong.
"""

from __future__ import annotations

import itertools
import json
import math
import re

from powerinfer_tools.serving.protocol import ProtocolError

MAX_DEPTH = 64  # arrays and objects inside one another; OpenAI's bodies need 5
MAX_NUMBER_CHARS = 100  # a number literal's characters; a seed (< 2^64) has 20, a float's shortest form 24

# A string literal (one left open runs to the end of the text, so every character is looked at once), or
# a run of anything that is neither a bracket nor a quote: what is left after removing both is the brackets
# outside strings, in order.
_NOT_A_BRACKET = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"?|[^\[\]{}"]++', re.DOTALL)
_DEPTH_CHANGE = {"[": 1, "{": 1, "]": -1, "}": -1}


def read_json_object(raw: bytes) -> dict:
    """The body as a JSON object, or ProtocolError: not UTF-8, not JSON (NaN and Infinity are not), nested
    past MAX_DEPTH, a number literal past MAX_NUMBER_CHARS or out of a float's range, not an object, or
    text with an unpaired surrogate."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(400, f"the request body is not valid UTF-8: {exc}") from None
    if _nesting_depth(text) > MAX_DEPTH:
        raise ProtocolError(400, f"the request body is nested more than {MAX_DEPTH} deep (arrays and objects "
                                 "inside one another)")
    try:
        data = json.loads(text, parse_int=_integer, parse_float=_float, parse_constant=_not_json)
    except json.JSONDecodeError as exc:
        raise ProtocolError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError(400, "the request body must be a JSON object")
    _refuse_unpaired_surrogates(data)
    return data


def _nesting_depth(text: str) -> int:
    """How deep arrays and objects nest in ``text`` (JSON, or the prefix of it that the parser would read):
    the deepest running count of brackets outside string literals."""
    brackets = _NOT_A_BRACKET.sub("", text)
    return max(itertools.accumulate(map(_DEPTH_CHANGE.__getitem__, brackets)), default=0)


def _checked_length(literal: str) -> str:
    if len(literal) > MAX_NUMBER_CHARS:
        raise ProtocolError(400, f"the request body has a number longer than {MAX_NUMBER_CHARS} characters "
                                 f"({literal[:20]}...)")
    return literal


def _integer(literal: str) -> int:
    return int(_checked_length(literal))


def _float(literal: str) -> float:
    value = float(_checked_length(literal))
    if not math.isfinite(value):
        raise ProtocolError(400, f"the request body has a number out of range ({literal})")
    return value


def _not_json(literal: str):
    raise ProtocolError(400, f"the request body is not valid JSON: {literal} is not a JSON number "
                             "(NaN and Infinity are JavaScript's, not JSON's)")


def _refuse_unpaired_surrogates(data: dict) -> None:
    """Text with an unpaired surrogate (``"\\ud800"``) is JSON but not Unicode: no tokenizer can read it."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ProtocolError(400, "the request contains text that is not valid Unicode (an unpaired "
                                 "surrogate)") from None
