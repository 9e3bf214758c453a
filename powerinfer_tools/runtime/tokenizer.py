"""The tokenizer embedded in a GGUF file, tokenizing as llama.cpp does.

Two vocabularies are supported, named by ``tokenizer.ggml.model``:

* ``gpt2``: byte-level BPE. Text is split by the pre-tokenizer's regex (named by
  ``tokenizer.ggml.pre``: GPT-2's, Qwen2's, Llama-3's), each piece's bytes are
  mapped to printable characters (GPT-2's byte alphabet) and merged pair by pair
  in merge-rank order.
* ``llama``: SentencePiece-style BPE. Spaces become U+2581 (with one prefixed),
  symbols are merged greedily by vocabulary score, and text no token covers
  falls back to ``<0xXX>`` byte tokens.

Added tokens are split out of the text first, longest spelling first:
USER_DEFINED ones always, CONTROL ones (and the unknown token) only with
``parse_special``, as llama.cpp's tokenizer does.
"""

from __future__ import annotations

import functools
import unicodedata
from dataclasses import dataclass
from typing import Iterable

import regex
from gguf import Keys

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.model_check import bpe_merges
from powerinfer_tools.interfaces import Tokenizer

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPM_SPACE = "\u2581"


@dataclass(frozen=True)
class PreTokenizer:
    """How a byte-level BPE vocabulary (``tokenizer.ggml.pre``) treats text before merging."""

    pattern: str  # the regex that splits text into pieces merged separately
    # NFC-normalize text first, as Qwen2's tokenizer.json does. llama.cpp does not: on text that NFC
    # changes (decomposed accents) it differs from tokenizers, and we side with tokenizers.
    nfc: bool = False
    ignore_merges: bool = False  # a piece that is itself a token stays whole (Llama-3)
    add_bos: bool = False  # without tokenizer.ggml.add_bos_token, whether BOS starts a prompt (llama.cpp's default)
    # Every digit a piece of its own before ``pattern`` splits what lies between them (SmolLM's Digits
    # pre-tokenizer, llama.cpp's first "\p{N}" pass): one regex cannot say it, since ``pattern``'s
    # lookaheads must stop at a digit as at the end of the text.
    split_digits: bool = False


# GPT-2's split, as tokenizers' ByteLevel(use_regex=True) applies it.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Qwen2's Split regex with its case-insensitive contractions "(?i:'s|'t|...)" spelled out, as llama.cpp
# spells them: with (?i) the regex module would also take the long s (U+017F) for an s, which neither
# tokenizers (Oniguruma) nor llama.cpp does. Llama-3's splits digits in runs of up to three, not one by one.
QWEN2_PATTERN = (
    r"""(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
LLAMA3_PATTERN = QWEN2_PATTERN.replace(r"|\p{N}|", r"|\p{N}{1,3}|")

# Byte-level pre-tokenizers by tokenizer.ggml.pre, with the other names llama.cpp gives the same one.
_LLAMA3 = PreTokenizer(LLAMA3_PATTERN, ignore_merges=True, add_bos=True)
PRE_TOKENIZERS = {
    "gpt-2": PreTokenizer(GPT2_PATTERN),
    "qwen2": PreTokenizer(QWEN2_PATTERN, nfc=True),
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "smaug-bpe": PreTokenizer(LLAMA3_PATTERN),
    "smollm": PreTokenizer(GPT2_PATTERN, split_digits=True),  # SmolLM, SmolLM2
}
_DIGIT = regex.compile(r"(\p{N})")


@functools.lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class GGUFTokenizer(Tokenizer):
    """Encode and decode with the vocabulary stored in GGUF metadata."""

    def __init__(self, metadata: dict, parse_special: bool = False, source: str = "the model file"):
        """``parse_special``: text spelling a control token (``<|endoftext|>``, ``</s>``) encodes as that
        token, as Hugging Face tokenizers and llama.cpp's ``special=True`` do; otherwise it is plain text,
        as in llama.cpp's default (the prompts of ``pitools run``). Other added tokens (USER_DEFINED)
        encode as themselves either way. ``source``: the file the metadata came from, named by errors."""
        self.parse_special = parse_special
        try:
            self.kind = metadata[Keys.Tokenizer.MODEL]
            self.tokens: list[str] = list(metadata[Keys.Tokenizer.LIST])
        except KeyError as exc:
            raise PitoolsError(f"{source}: no embedded tokenizer ({exc.args[0]} missing)") from None
        self.types = list(metadata.get(Keys.Tokenizer.TOKEN_TYPE, [NORMAL] * len(self.tokens)))
        self.chat_template = metadata.get(Keys.Tokenizer.CHAT_TEMPLATE)
        self.bos_token_id = metadata.get(Keys.Tokenizer.BOS_ID)
        self.eos_token_id = metadata.get(Keys.Tokenizer.EOS_ID)
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        if self.kind == "gpt2":
            name = metadata.get(Keys.Tokenizer.PRE, "gpt-2")
            if name not in PRE_TOKENIZERS:
                supported = ", ".join(PRE_TOKENIZERS)
                raise PitoolsError(f"{source}: pre-tokenizer {name!r} is not supported (supported: {supported})")
            self.pre = PRE_TOKENIZERS[name]
            self._split = regex.compile(self.pre.pattern)
            merges = bpe_merges(metadata.get, source)
            self._merge_rank = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
            self._byte_of = {c: b for b, c in byte_alphabet().items()}
            self.add_bos = bool(metadata.get(Keys.Tokenizer.ADD_BOS, self.pre.add_bos))
        elif self.kind == "llama":
            self.scores = list(metadata.get(Keys.Tokenizer.SCORES, [0.0] * len(self.tokens)))
            self.add_space_prefix = bool(metadata.get(Keys.Tokenizer.ADD_PREFIX, True))
            self.add_bos = bool(metadata.get(Keys.Tokenizer.ADD_BOS, True))
        else:
            raise PitoolsError(f"{source}: tokenizer model {self.kind!r} is not supported (supported: gpt2, llama)")
        # Compiled now, not at the first text: a vocabulary's thousands of special spellings (Gemma 3's) take
        # the regex module a while to compile, which a server's first request would otherwise wait for.
        self._special_texts = self._special_spellings()
        self._special_split = {parse: self._splitter(texts) for parse, texts in self._special_texts.items()}

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_bos: bool | None = None, special: bool | None = None) -> list[int]:
        """``special`` overrides ``parse_special`` for this text (a rendered chat template spells its
        control tokens)."""
        parse_special = self.parse_special if special is None else special
        specials, split = self._special_texts[parse_special], self._special_split[parse_special]
        ids: list[int] = []
        space_prefix = True  # SentencePiece: a text fragment at the start or after a special token gets one
        for fragment in split.split(text) if specials else [text]:
            if fragment in specials:
                ids.append(self.ids[fragment])
                space_prefix = True
            elif fragment:
                ids += self._encode_gpt2(fragment) if self.kind == "gpt2" else self._encode_spm(fragment, space_prefix)
                space_prefix = False
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def _special_spellings(self) -> dict[bool, frozenset[str]]:
        """Spellings split out of the text as single tokens, by whether special tokens are parsed: added
        tokens that are not control tokens always, control (and unknown) tokens only when parsed, as
        llama.cpp does."""
        def spelled(kinds: set[int]) -> frozenset[str]:
            return frozenset(t for t, kind in zip(self.tokens, self.types) if kind in kinds and t)

        return {False: spelled({USER_DEFINED}), True: spelled({USER_DEFINED, CONTROL, UNKNOWN})}

    @staticmethod
    def _splitter(spellings: frozenset[str]) -> regex.Pattern:
        """Splits text around ``spellings``, longest first, keeping them as fragments."""
        ordered = sorted(spellings, key=len, reverse=True)
        return regex.compile("(" + "|".join(map(regex.escape, ordered)) + ")")

    def token_text(self, token_id: int) -> str:
        """How the vocabulary spells a token (a special token's literal text, as a chat template writes it)."""
        return self.tokens[token_id]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the tokens; control tokens (BOS/EOS) print as nothing, as in llama.cpp."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        kind, text = self.types[token_id], self.tokens[token_id]
        if kind == CONTROL:
            return b""
        if self.kind == "gpt2":
            if kind == USER_DEFINED:
                return text.encode()
            return bytes(self._byte_of[c] for c in text)
        if kind == BYTE:  # "<0xAB>"
            return bytes([int(text[3:5], 16)])
        return text.replace(SPM_SPACE, " ").encode()

    # -- gpt2 ---------------------------------------------------------------

    def _encode_gpt2(self, text: str) -> list[int]:
        alphabet = byte_alphabet()
        if self.pre.nfc:
            text = unicodedata.normalize("NFC", text)
        ids: list[int] = []
        for piece in self._pieces(text):
            ids.extend(self._bpe("".join(alphabet[b] for b in piece.encode("utf-8"))))
        return ids

    def _pieces(self, text: str) -> list[str]:
        """The pre-tokenizer's pieces of ``text``, each merged on its own."""
        if not self.pre.split_digits:
            return self._split.findall(text)
        # regex.split with a group keeps the digits: text, digit, text, ..., the texts possibly empty.
        parts = _DIGIT.split(text)
        return [piece for i, part in enumerate(parts) for piece in ([part] if i % 2 else self._split.findall(part))]

    @functools.lru_cache(maxsize=65536)
    def _bpe(self, word: str) -> tuple[int, ...]:
        if self.pre.ignore_merges and word in self.ids:
            return (self.ids[word],)
        symbols = list(word)
        while len(symbols) > 1:
            ranks = [self._merge_rank.get(pair, None) for pair in zip(symbols, symbols[1:])]
            best = min((r, i) for i, r in enumerate(ranks) if r is not None) if any(r is not None for r in ranks) else None
            if best is None:
                break
            i = best[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        return tuple(self.ids[s] for s in symbols)

    # -- llama (SentencePiece BPE) ----------------------------------------------

    def _encode_spm(self, text: str, space_prefix: bool = True) -> list[int]:
        if not text:
            return []
        text = text.replace(" ", SPM_SPACE)
        if self.add_space_prefix and space_prefix:
            text = SPM_SPACE + text
        symbols = list(text)
        merged_from: dict[str, tuple[str, str]] = {}
        while len(symbols) > 1:
            best_score, best_i = None, -1
            for i in range(len(symbols) - 1):
                candidate = symbols[i] + symbols[i + 1]
                token = self.ids.get(candidate)
                if token is not None and (best_score is None or self.scores[token] > best_score):
                    best_score, best_i = self.scores[token], i
            if best_i < 0:
                break
            left, right = symbols[best_i], symbols[best_i + 1]
            merged_from[left + right] = (left, right)
            symbols[best_i : best_i + 2] = [left + right]
        ids: list[int] = []
        for s in symbols:
            self._resegment(s, merged_from, ids)
        return ids

    def _resegment(self, symbol: str, merged_from: dict, out: list[int]) -> None:
        token = self.ids.get(symbol)
        if token is not None:
            out.append(token)
        elif symbol in merged_from:
            for part in merged_from[symbol]:
                self._resegment(part, merged_from, out)
        else:
            for b in symbol.encode("utf-8"):
                out.append(self.ids[f"<0x{b:02X}>"])
