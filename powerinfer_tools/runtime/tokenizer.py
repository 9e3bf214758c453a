"""The tokenizer embedded in a GGUF file, tokenizing as llama.cpp does.

Two vocabularies are supported, named by ``tokenizer.ggml.model``:

* ``gpt2``: byte-level BPE. Text is split by the pre-tokenizer's regex, each
  piece's bytes are mapped to printable characters (GPT-2's byte alphabet) and
  merged pair by pair in merge-rank order.
* ``llama``: SentencePiece-style BPE. Spaces become U+2581 (with one prefixed),
  symbols are merged greedily by vocabulary score, and text no token covers
  falls back to ``<0xXX>`` byte tokens.
"""

from __future__ import annotations

import functools
from typing import Iterable

import regex
from gguf import Keys

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.interfaces import Tokenizer

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes by tokenizer.ggml.pre. GPT-2's split, as tokenizers'
# ByteLevel(use_regex=True) applies it.
PRE_TOKENIZER_PATTERNS = {
    "gpt-2": r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
}
SPM_SPACE = "\u2581"


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

    def __init__(self, metadata: dict, parse_special: bool = False):
        """``parse_special``: text spelling a control token (``<|endoftext|>``, ``</s>``) encodes as that
        token, as Hugging Face tokenizers and llama.cpp's ``special=True`` do; otherwise it is plain text,
        as in llama.cpp's default (the prompts of ``pitools run``)."""
        self.parse_special = parse_special
        try:
            self.kind = metadata[Keys.Tokenizer.MODEL]
            self.tokens: list[str] = list(metadata[Keys.Tokenizer.LIST])
        except KeyError as exc:
            raise PitoolsError(f"the model file has no embedded tokenizer ({exc.args[0]} missing)") from None
        self.types = list(metadata.get(Keys.Tokenizer.TOKEN_TYPE, [NORMAL] * len(self.tokens)))
        self.bos_token_id = metadata.get(Keys.Tokenizer.BOS_ID)
        self.eos_token_id = metadata.get(Keys.Tokenizer.EOS_ID)
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        if self.kind == "gpt2":
            pre = metadata.get(Keys.Tokenizer.PRE, "gpt-2")
            if pre not in PRE_TOKENIZER_PATTERNS:
                supported = ", ".join(PRE_TOKENIZER_PATTERNS)
                raise PitoolsError(f"pre-tokenizer {pre!r} is not supported (supported: {supported})")
            self._split = regex.compile(PRE_TOKENIZER_PATTERNS[pre])
            merges = metadata.get(Keys.Tokenizer.MERGES, [])
            self._merge_rank = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
            self._byte_of = {c: b for b, c in byte_alphabet().items()}
            self.add_bos = bool(metadata.get(Keys.Tokenizer.ADD_BOS, False))
        elif self.kind == "llama":
            self.scores = list(metadata.get(Keys.Tokenizer.SCORES, [0.0] * len(self.tokens)))
            self.add_space_prefix = bool(metadata.get(Keys.Tokenizer.ADD_PREFIX, True))
            self.add_bos = bool(metadata.get(Keys.Tokenizer.ADD_BOS, True))
        else:
            raise PitoolsError(f"tokenizer model {self.kind!r} is not supported (supported: gpt2, llama)")

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids: list[int] = []
        space_prefix = True  # SentencePiece: a text fragment at the start or after a special token gets one
        for fragment in self._special_split.split(text) if self.parse_special else [text]:
            special = self.ids[fragment] if self.parse_special and fragment in self._special_texts else None
            if special is not None:
                ids.append(special)
                space_prefix = True
            elif fragment:
                ids += self._encode_gpt2(fragment) if self.kind == "gpt2" else self._encode_spm(fragment, space_prefix)
                space_prefix = False
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    @functools.cached_property
    def _special_texts(self) -> frozenset[str]:
        return frozenset(t for t, kind in zip(self.tokens, self.types) if kind == CONTROL and t)

    @functools.cached_property
    def _special_split(self) -> regex.Pattern:
        """Splits text around control tokens' spellings, longest first, keeping them as fragments."""
        spellings = sorted(self._special_texts, key=len, reverse=True)
        return regex.compile("(" + "|".join(map(regex.escape, spellings)) + ")") if spellings else regex.compile("(?!)")

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
        ids: list[int] = []
        for piece in self._split.findall(text):
            ids.extend(self._bpe("".join(alphabet[b] for b in piece.encode("utf-8"))))
        return ids

    @functools.lru_cache(maxsize=65536)
    def _bpe(self, word: str) -> tuple[int, ...]:
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
