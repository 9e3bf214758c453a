"""The checkpoint's own tokenizer (``tokenizer.json``), read by Hugging Face ``tokenizers``."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.interfaces import Tokenizer


class CheckpointTokenizer(Tokenizer):
    """Text <-> token ids exactly as the model was trained, plus its BOS/EOS ids."""

    def __init__(self, folder: str | Path, bos_token_id: int | None = None, eos_token_id: int | None = None):
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise PitoolsError(f"{folder}: no tokenizer.json (the fast-tokenizer file is required)")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise PitoolsError(f"{path}: cannot read tokenizer ({exc})") from None
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        config = _tokenizer_config(Path(folder))
        # Whether prompts start with BOS: LLaMA's tokenizers say so in add_bos_token.
        self.add_bos = bool(config.get("add_bos_token", False))
        self.chat_template = _chat_template(Path(folder), config)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_bos: bool | None = None, special: bool | None = None) -> list[int]:
        """``special`` changes nothing: ``tokenizers`` always reads an added token's spelling as that token."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or ""


def _tokenizer_config(folder: Path) -> dict:
    """tokenizer_config.json (empty when the folder has none)."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise PitoolsError(f"{path}: invalid JSON") from None
    if not isinstance(config, dict):
        raise PitoolsError(f"{path}: not a JSON object")
    return config


def _chat_template(folder: Path, config: dict) -> str | None:
    """The Jinja chat template, where transformers looks for it: ``chat_template.jinja`` beside the
    tokenizer, else tokenizer_config.json's ``chat_template`` (a string, or named templates of which
    "default" is the one used)."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise PitoolsError(f"{folder / 'tokenizer_config.json'}: chat_template is not a string")
    return template
