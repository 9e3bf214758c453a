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
        self.add_bos = _adds_bos(Path(folder))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def _adds_bos(folder: Path) -> bool:
    """Whether prompts start with BOS: tokenizer_config.json's add_bos_token (LLaMA's default is yes)."""
    path = folder / "tokenizer_config.json"
    if path.is_file():
        try:
            return bool(json.loads(path.read_text(encoding="utf-8")).get("add_bos_token", False))
        except json.JSONDecodeError:
            raise PitoolsError(f"{path}: invalid JSON") from None
    return False
