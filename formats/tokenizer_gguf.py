"""A Hugging Face ``tokenizer.json`` as the tokenizer metadata llama.cpp reads from GGUF.

Two kinds of BPE tokenizer can be embedded so that llama.cpp tokenizes exactly
(or, for the second, as closely as its algorithm allows) like ``tokenizers``:

* Byte-level BPE: ``tokenizer.ggml.model = "gpt2"``, the vocabulary in its
  byte-to-unicode spelling and the merges in rank order. ``tokenizer.ggml.pre``
  names the regex that splits text before BPE, which llama.cpp looks up by that
  name: ``"gpt-2"`` for GPT-2's (``ByteLevel`` with its built-in regex, no
  normalizer), ``"smollm"`` for SmolLM's (every digit split off first: ``Digits``),
  ``"qwen2"`` for Qwen2's and ``"llama-bpe"`` for Llama-3's
  (a ``Split`` with that regex, then ``ByteLevel`` without one; ``"smaug-bpe"``
  for Llama-3's regex without its ``ignore_merges``). llama.cpp's own converter
  recognises the pre-tokenizer by hashing how it tokenizes a fixed text; we
  compare the ``Split`` regex with the known ones instead, and require the
  normalizer the name stands for (NFC for Qwen2, none for Llama-3): GGUF has no
  key for it, so our runtime applies the one the name implies.
* SentencePiece-style BPE (spaces spelled U+2581, ``<0xXX>`` byte fallback), as
  LLaMA and Mistral ship it: ``tokenizer.ggml.model = "llama"``. llama.cpp
  merges such a vocabulary greedily by token score rather than by merge rank,
  so each token's score is minus the rank of the merge that creates it.

Added tokens keep their literal text; special ones, and others spelled like a
control token (``<|...|>``, as llama.cpp's converter judges), are CONTROL tokens,
the rest USER_DEFINED. Vocabulary ids the tokenizer does not use, up to the
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

# The Split regexes llama.cpp has a pre-tokenizer for, spelled as in tokenizer.json: Qwen2's
# (Qwen2, Qwen2.5, Qwen3) splits digits one by one, Llama-3's in runs of up to three.
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


@dataclass(frozen=True)
class SplitPreTokenizer:
    """A tokenizer.json Split regex llama.cpp knows, and what else its ``tokenizer.ggml.pre`` implies."""

    label: str  # for messages
    regex: str
    normalizer: str | None  # the one the tokenizer must have: the name fixes it for our runtime too
    ignore_merges: bool  # a piece that is a whole token is kept whole (llama.cpp ties this to the name)


# tokenizer.ggml.pre -> pre-tokenizer. llama.cpp's "smaug-bpe" is Llama-3's regex without ignore_merges.
SPLIT_PRE_TOKENIZERS = {
    "qwen2": SplitPreTokenizer("Qwen2", QWEN2_SPLIT, "NFC", ignore_merges=False),
    "llama-bpe": SplitPreTokenizer("Llama-3", LLAMA3_SPLIT, None, ignore_merges=True),
    "smaug-bpe": SplitPreTokenizer("Llama-3", LLAMA3_SPLIT, None, ignore_merges=False),
}


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


def _gpt2_byte_level_name(tokenizer: dict) -> str | None:
    """ByteLevel with GPT-2's regex and no prefix space, and no normalizer: alone, ``gpt-2``; after every digit is
    split off (SmolLM's ``Digits(individual_digits)``), llama.cpp's ``smollm``; else None."""
    pre = tokenizer.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    digits = steps[:1] == [{"type": "Digits", "individual_digits": True}]
    byte_level = steps[len(steps) - 1] if len(steps) == 1 + digits else {}
    if (tokenizer.get("normalizer") or byte_level.get("type") != "ByteLevel" or not byte_level.get("use_regex", True)
            or byte_level.get("add_prefix_space", False)):
        return None
    return "smollm" if digits else "gpt-2"


def _split_then_byte_level(tokenizer: dict) -> dict | None:
    """The Split step of a Sequence[Split(Isolated), ByteLevel(use_regex=false)] pre-tokenizer, else None."""
    pre = tokenizer.get("pre_tokenizer") or {}
    steps = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else []
    if [step.get("type") for step in steps] != ["Split", "ByteLevel"]:
        return None
    split, byte_level = steps
    if byte_level.get("use_regex", True) or byte_level.get("add_prefix_space", False):
        return None
    if split.get("behavior") != "Isolated" or split.get("invert", False):
        return None
    return split


def _split_pre_tokenizer(tokenizer: dict, path: Path) -> str | None:
    """``tokenizer.ggml.pre`` of a byte-level BPE that splits text with a known regex first; None if the
    tokenizer is not built that way, an error if it is but with a regex or options that name cannot stand for."""
    split = _split_then_byte_level(tokenizer)
    if split is None:
        return None
    regex = (split.get("pattern") or {}).get("Regex")
    candidates = {name: pre for name, pre in SPLIT_PRE_TOKENIZERS.items() if pre.regex == regex}
    if not candidates:
        known = " and ".join(f"{label}'s" for label in sorted({pre.label for pre in SPLIT_PRE_TOKENIZERS.values()}))
        raise PitoolsError(
            f"{path}: the pre-tokenizer's Split regex {regex!r} is not one llama.cpp has a pre-tokenizer for "
            f"(supported: {known}); the tokenizer cannot be embedded"
        )
    model = tokenizer["model"]
    ignore_merges = bool(model.get("ignore_merges", False))
    name = next((n for n, pre in candidates.items() if pre.ignore_merges == ignore_merges), None)
    label = next(iter(candidates.values())).label
    problem = _unlike(tokenizer, candidates[name]) if name else f"ignore_merges {str(ignore_merges).lower()}"
    if problem:
        raise PitoolsError(
            f"{path}: {label}'s Split regex with {problem}: no llama.cpp pre-tokenizer name stands for that; "
            "the tokenizer cannot be embedded"
        )
    return name


def _unlike(tokenizer: dict, pre: SplitPreTokenizer) -> str | None:
    """What in the tokenizer differs from what ``pre``'s name implies, or None."""
    normalizer = tokenizer.get("normalizer")
    if (normalizer or {}).get("type") != pre.normalizer:
        return f"normalizer {_describe(normalizer)} ({pre.label}'s has {pre.normalizer or 'none'})"
    extras = [key for key in ("byte_fallback", "dropout", "continuing_subword_prefix", "end_of_word_suffix")
              if tokenizer["model"].get(key)]
    return f"BPE option {', '.join(extras)}" if extras else None


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


def _looks_special(text: str) -> bool:
    """An added token not marked special that llama.cpp's converter still makes a CONTROL token (its
    ``does_token_look_special``: some models leave chat markers such as ``<|im_start|>`` unmarked)."""
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))  # fullwidth bars: DeepSeek-Coder
        or (text.startswith("<unused") and text.endswith(">"))
    )


def _token_table(tokenizer: dict, n_vocab: int, path: Path, base_type) -> tuple[list[str], list[int]]:
    """Token texts and types for ids ``0 .. n_vocab-1``."""
    entries: dict[int, tuple[str, int]] = {i: (text, base_type(text)) for text, i in tokenizer["model"]["vocab"].items()}
    unk = tokenizer["model"].get("unk_token")
    for added in tokenizer.get("added_tokens", []):
        kind = TokenType.CONTROL if added.get("special") or _looks_special(added["content"]) else TokenType.USER_DEFINED
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

    pre = None
    if model_type == "BPE":
        pre = _gpt2_byte_level_name(tokenizer) or _split_pre_tokenizer(tokenizer, path)
    if pre is not None:
        if not merges:  # GGUF keeps no empty array: llama.cpp and our runtime would find no merges and refuse
            raise PitoolsError(f"{path}: a byte-level BPE tokenizer without merges cannot be embedded (llama.cpp "
                               "refuses a gpt2 vocabulary without tokenizer.ggml.merges)")
        tokens, types = _token_table(tokenizer, n_vocab, path, lambda text: TokenType.NORMAL)
        return GGUFVocab("gpt2", pre, tokens, types, [f"{a} {b}" for a, b in merges], None, None, special)

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
        "supported: byte-level BPE (GPT-2's, SmolLM's, or Qwen2's or Llama-3's Split regex first) and "
        "SentencePiece-style byte-fallback BPE (LLaMA, Mistral)"
    )
