"""A Hugging Face ``tokenizer.json`` as the tokenizer metadata llama.cpp reads from GGUF.

Two kinds of BPE tokenizer can be embedded so that llama.cpp tokenizes exactly
(or, for the second, as closely as its algorithm allows) like ``tokenizers``:

* GPT-2 byte-level BPE (``ByteLevel`` pre-tokenizer with GPT-2's regex, no
  normalizer): ``tokenizer.ggml.model = "gpt2"``, ``tokenizer.ggml.pre =
  "gpt-2"`` (llama.cpp's name for the same regex), the vocabulary in its
  byte-to-unicode spelling and the merges in rank order.
* SentencePiece-style BPE (spaces spelled U+2581, ``<0xXX>`` byte fallback), as
  LLaMA and Mistral ship it: ``tokenizer.ggml.model = "llama"``. llama.cpp
  merges such a vocabulary greedily by token score rather than by merge rank,
  so each token's score is minus the rank of the merge that creates it.

Added tokens keep their literal text; special ones are CONTROL tokens, the
others USER_DEFINED. Vocabulary ids the tokenizer does not use, up to the
model's embedding size, become ``[PAD<id>]`` UNUSED tokens. Special token ids,
``add_bos``/``add_eos`` and the chat template come from gguf-py's
``SpecialVocab``, which reads them as llama.cpp's own converter does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFWriter, SpecialVocab, TokenType

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.fileio import read_json

SPM_SPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass
class GGUFVocab:
    """Everything llama.cpp needs to rebuild the tokenizer."""

    model: str  # tokenizer.ggml.model: "gpt2" or "llama"
    pre: str | None  # tokenizer.ggml.pre, for "gpt2"
    tokens: list[str]
    token_types: list[int]
    merges: list[str] | None  # "left right" in rank order, for "gpt2"
    scores: list[float] | None  # for "llama"
    add_space_prefix: bool | None  # for "llama": whether a U+2581 is prepended to the text
    special: SpecialVocab

    def add_to(self, writer: GGUFWriter) -> None:
        writer.add_tokenizer_model(self.model)
        if self.pre is not None:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.token_types)
        if self.merges is not None:
            writer.add_token_merges(self.merges)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        self.special.add_to_gguf(writer, quiet=True)


def _load(folder: Path) -> dict:
    path = folder / "tokenizer.json"
    if not path.is_file():
        others = [name for name in ("tokenizer.model", "vocab.json") if (folder / name).is_file()]
        hint = (
            f" (it has {' and '.join(others)}; load it with transformers' AutoTokenizer and save_pretrained() "
            "to write a tokenizer.json)"
            if others
            else ""
        )
        raise PitoolsError(f"{folder}: no tokenizer.json; the tokenizer cannot be embedded{hint}")
    tokenizer = read_json(path)
    model = tokenizer.get("model") if isinstance(tokenizer, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("vocab"), dict):
        raise PitoolsError(f"{path}: not a tokenizer.json with a model vocabulary")
    return tokenizer


def _describe(part: dict | None) -> str:
    if not part:
        return "none"
    if part.get("type") == "Sequence":
        inner = part.get("pretokenizers") or part.get("normalizers") or []
        return "Sequence[" + ", ".join(_describe(p) for p in inner) + "]"
    return str(part.get("type"))


def _is_gpt2_byte_level(tokenizer: dict) -> bool:
    """ByteLevel with GPT-2's regex and no prefix space, alone, and no normalizer."""
    pre = tokenizer.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 1:
        pre = pre["pretokenizers"][0]
    return (
        not tokenizer.get("normalizer")
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
    )


def _spm_space_prefix(tokenizer: dict) -> bool | None:
    """For a SentencePiece-style BPE, whether U+2581 is prepended to the text; None if it is not one.

    Older LLaMA/Mistral exports spell spaces with a normalizer (Prepend + Replace),
    newer ones with a Metaspace pre-tokenizer.
    """
    if not tokenizer["model"].get("byte_fallback"):
        return None
    normalizer, pre = tokenizer.get("normalizer"), tokenizer.get("pre_tokenizer")
    if pre is None and normalizer:
        steps = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
        replaces_spaces = any(
            s.get("type") == "Replace" and s.get("pattern", {}).get("String") == " " and s.get("content") == SPM_SPACE
            for s in steps
        )
        if replaces_spaces and all(s.get("type") in ("Prepend", "Replace") for s in steps):
            return any(s.get("type") == "Prepend" and s.get("prepend") == SPM_SPACE for s in steps)
    if normalizer is None and pre and pre.get("type") == "Metaspace" and pre.get("replacement") == SPM_SPACE:
        if "prepend_scheme" in pre:
            return pre["prepend_scheme"] != "never"
        return bool(pre.get("add_prefix_space", True))
    return None


def _merges(tokenizer: dict, path: Path) -> list[tuple[str, str]]:
    """Merges in rank order; tokenizers writes them as "a b" strings or, since 0.20, as [a, b] pairs."""
    pairs = []
    for merge in tokenizer["model"].get("merges", []):
        pair = merge.split(" ", 1) if isinstance(merge, str) else merge
        if len(pair) != 2:
            raise PitoolsError(f"{path}: malformed merge {merge!r}")
        pairs.append((pair[0], pair[1]))
    return pairs


def _token_table(tokenizer: dict, n_vocab: int, path: Path, base_type) -> tuple[list[str], list[int]]:
    """Token texts and types for ids ``0 .. n_vocab-1``."""
    entries: dict[int, tuple[str, int]] = {i: (text, base_type(text)) for text, i in tokenizer["model"]["vocab"].items()}
    unk = tokenizer["model"].get("unk_token")
    for added in tokenizer.get("added_tokens", []):
        kind = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
        if added["content"] == unk:
            kind = TokenType.UNKNOWN
        entries[added["id"]] = (added["content"], kind)
    if entries and max(entries) >= n_vocab:
        raise PitoolsError(
            f"{path}: the tokenizer has token id {max(entries)}, but the model's embedding has only {n_vocab} rows"
        )
    tokens, types = [], []
    seen: dict[str, int] = {}
    for i in range(n_vocab):
        text, kind = entries.get(i, (f"[PAD{i}]", TokenType.UNUSED))
        if text in seen:  # llama.cpp maps text to id and aborts on duplicates
            raise PitoolsError(f"{path}: token {text!r} appears twice (ids {seen[text]} and {i})")
        seen[text] = i
        tokens.append(text)
        types.append(int(kind))
    return tokens, types


def read_vocab(folder: str | Path, n_vocab: int) -> GGUFVocab:
    """The GGUF tokenizer metadata of the checkpoint in ``folder``, padded to ``n_vocab`` tokens."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    tokenizer = _load(folder)
    model_type = tokenizer["model"].get("type", "BPE")  # older files omit it for BPE
    special = SpecialVocab(folder, load_merges=False, n_vocab=n_vocab)
    merges = _merges(tokenizer, path) if model_type == "BPE" else []

    if model_type == "BPE" and _is_gpt2_byte_level(tokenizer):
        tokens, types = _token_table(tokenizer, n_vocab, path, lambda text: TokenType.NORMAL)
        return GGUFVocab("gpt2", "gpt-2", tokens, types, [f"{a} {b}" for a, b in merges], None, None, special)

    prefix = _spm_space_prefix(tokenizer) if model_type == "BPE" else None
    if prefix is not None:
        tokens, types = _token_table(
            tokenizer, n_vocab, path, lambda text: TokenType.BYTE if _BYTE_TOKEN.fullmatch(text) else TokenType.NORMAL
        )
        rank: dict[str, int] = {}
        for i, (a, b) in enumerate(merges):
            rank.setdefault(a + b, i)
        # Tokens no merge creates (characters, bytes, specials) rank after every merge.
        scores = [-float(rank.get(text, len(merges))) for text in tokens]
        return GGUFVocab("llama", None, tokens, types, None, scores, prefix, special)

    raise PitoolsError(
        f"{path}: cannot embed this tokenizer in GGUF (model {model_type}, "
        f"pre-tokenizer {_describe(tokenizer.get('pre_tokenizer'))}, normalizer {_describe(tokenizer.get('normalizer'))}); "
        "supported: GPT-2 byte-level BPE and SentencePiece-style byte-fallback BPE (LLaMA, Mistral)"
    )
