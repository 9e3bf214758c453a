"""Checks for the JSON files of our folders (profile.json, predictors.json): the format tag and the
fields their readers use, each refused with one line naming the file and the key."""

from __future__ import annotations

from pathlib import Path

from powerinfer_tools.errors import PitoolsError

_JSON_NAMES = {int: "an integer", float: "a number", str: "a string", dict: "an object", list: "an array",
               bool: "true or false"}


def check_format(path: Path, content, expected: str, what: str) -> None:
    """Refuse JSON ``content`` that is not an object whose "format" is ``expected``."""
    if not isinstance(content, dict):
        raise PitoolsError(f"{path}: not {what} (a JSON {type(content).__name__}, not an object)")
    if content.get("format") != expected:
        raise PitoolsError(f"{path}: not {what} (format {content.get('format')!r:.60})")


def check_fields(path: Path, content: dict, fields: dict, prefix: str = "") -> None:
    """Refuse JSON ``content`` lacking one of ``fields`` (key -> (type, least value or None)) or
    holding it with another type; ``float`` stands for any number."""
    for key, (kind, least) in fields.items():
        value = content.get(key)
        allowed = (int, float) if kind is float else kind
        wrong_type = not isinstance(value, allowed) or (kind in (int, float) and isinstance(value, bool))
        if wrong_type or (least is not None and value < least):
            what = f"{_JSON_NAMES[kind]} >= {least}" if least is not None else _JSON_NAMES[kind]
            raise PitoolsError(f"{path}: {prefix}{key} must be {what}, not {value!r:.60}")
