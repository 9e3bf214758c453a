"""The typed metadata keys we read from model files and split files, one table each, and the one check of a
key's value that every reader goes through.

A GGUF value carries its own type, and a file may hold any type under any key: an edited, damaged or foreign
file puts a string where a number is due, a short array where one entry per layer is indexed. Each key we read
is listed here with what it must hold -- the kind of value, a scalar or an array of how many items, the range
of its values -- as config.json's fields are (``json_fields.check_fields``, ``ModelSpec``); a value that breaks
its entry is refused with one error naming the file and the key, never clamped or guessed at.

``open_model_file`` checks every key of ``MODEL_KEYS`` a file holds, so that every command inherits the check,
and ``read_gpu_split`` every key of ``SPLIT_KEYS``. An array of one item per layer (neuron, token) is checked
against that count by the reader that has it confirmed by the tensors (``read_key``'s ``count``: the frequency
and threshold readers, ``check_model_tensors`` for the vocabulary), so that a wrong hyperparameter is reported as
the tensors that disagree with it. Whether a key must be present is the reader's business (a dense file has no
frequencies), and so is a string's meaning (``pitools.ffn_activation``'s kinds).
The ranges of the hyperparameters that make a ``ModelSpec``, and how they relate, are ``ModelSpec``'s: it checks
config.json's fields by the same rules.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import Keys
from powerinfer_tools.formats.constants import (
    CACHE_BYTES_KEY,
    DENSE_ON_GPU_KEY,
    EXPERT_FREQUENCY_KEY,
    EXPERT_NEURON_FREQUENCY_KEY,
    FFN_ACTIVATION_KEY,
    FFN_BUNDLE_PARTS_KEY,
    FFN_BUNDLE_STRIDE_KEY,
    FFN_BUNDLE_TYPES_KEY,
    LAYER_RAM_NEURONS_KEY,
    MODEL_FINGERPRINT_KEY,
    NEURON_FREQUENCY_KEY,
    OUTPUT_ON_GPU_KEY,
    PREDICTOR_COMPUTED_KEY,
    PREDICTOR_PRECISION_KEY,
    PREDICTOR_RECALL_KEY,
    RAM_BUDGET_KEY,
    SPARSE_THRESHOLD_KEY,
    SPARSITY_CURVE_PERPLEXITY_KEY,
    SPARSITY_CURVE_SPARSITY_KEY,
    SPARSITY_MAX_LOSS_KEY,
    SPARSITY_PERPLEXITY_KEY,
    SPARSITY_RULE_KEY,
    SPARSITY_TARGET_KEY,
    SPARSITY_THRESHOLD_KEY,
    VRAM_BUDGET_KEY,
    VRAM_CAPACITY_KEY,
)

from powerinfer_tools.errors import PitoolsError

ANY = "any"  # an array of any length


@dataclass(frozen=True)
class TypedKey:
    """What one metadata key must hold."""

    kind: type  # int, float (a finite real number: an integer too), str or bool
    # None: a scalar. Else an array: of ANY length; of another array's length (that key); or of the count a
    # hyperparameter gives (that key, "{arch}.block_count"), checked by the reader that has the count confirmed
    # (``read_key``'s ``count``, ``check_metadata``'s ``counts``) -- the tensors, checked first, tell a wrong
    # count from a wrong array.
    length: str | None = None
    least: float | None = None  # the value (each item) at least this ...
    most: float | None = None  # ... at most this ...
    below: float | None = None  # ... below this
    noun: str | None = None  # what an array's items are, for messages: "firing probabilities"
    distinct: bool = False  # no item twice, but the empty string (llama.cpp renames each empty token by its id)

    def admits(self, value: Any) -> bool:
        """Whether a scalar ``value`` is of this kind and in range."""
        return type(value) in _TYPES[self.kind] and (self.kind not in (int, float) or self._in_range(np.float64(value)))

    def admits_all(self, values: list) -> bool:
        """Whether every item of an array is in range (their kind checked first)."""
        if self.kind not in (int, float) or (self.kind is int and self._unbounded):
            return True
        return self._in_range(np.asarray(values, dtype=np.float64))

    def expected(self, count: int | None = None) -> str:
        """What the key must hold, for messages: "must be a number in [0, 1)", "must hold 2 true-or-false values"."""
        if self.length is None:
            phrase = " ".join(self._qualities() + [_KIND_WORDS[self.kind][0]]) + self._bounds_text()
            return "must be " + (phrase if self.kind is bool else _with_article(phrase))
        counted = [] if count is None else [str(count)]
        return "must hold " + " ".join(counted + self._qualities() + [self.noun or _KIND_WORDS[self.kind][1]]) \
            + self._bounds_text()

    def _qualities(self) -> list[str]:
        """Words before the noun: a number is finite, and a lower bound of 0 alone is "non-negative" (a range in
        brackets says both)."""
        if self._bounded:
            return []
        return ["finite"] * (self.kind is float) + ["non-negative"] * (self.least == 0)

    @property
    def _unbounded(self) -> bool:
        return self.least is None and self.most is None and self.below is None

    @property
    def _bounded(self) -> bool:
        """Bounded on both sides: a range in brackets says it all."""
        return self.least is not None and (self.most is not None or self.below is not None)

    def _bounds_text(self) -> str:
        if self._bounded:
            upper = f"{self.most:g}]" if self.most is not None else f"{self.below:g})"
            return f" in [{self.least:g}, {upper}"
        if self.least is not None and self.least != 0:
            return f" >= {self.least:g}"
        return ""

    def _in_range(self, values: np.ndarray) -> bool:
        return bool(np.all(np.isfinite(values))
                    and (self.least is None or np.all(values >= self.least))
                    and (self.most is None or np.all(values <= self.most))
                    and (self.below is None or np.all(values < self.below)))


# The Python types gguf-py reads each kind as (GGUF's integer types all as int, float32/64 as float).
_TYPES = {int: {int}, float: {int, float}, str: {str}, bool: {bool}}
_KIND_WORDS = {int: ("integer", "integers"), float: ("number", "numbers"), str: ("string", "strings"),
               bool: ("true or false", "true-or-false values")}
LAYERS = Keys.LLM.BLOCK_COUNT  # arrays of one item per layer

# The keys we read from a model file ({arch}: its architecture; {layer}, {expert}, {name}: any).
MODEL_KEYS: dict[str, TypedKey] = {
    # Hyperparameters (formats/gguf_spec.py): their ranges, and how they relate, are ModelSpec's.
    Keys.LLM.BLOCK_COUNT: TypedKey(int),
    Keys.LLM.EMBEDDING_LENGTH: TypedKey(int),
    Keys.LLM.FEED_FORWARD_LENGTH: TypedKey(int),
    Keys.LLM.CONTEXT_LENGTH: TypedKey(int),
    Keys.LLM.VOCAB_SIZE: TypedKey(int),
    Keys.LLM.EXPERT_COUNT: TypedKey(int),
    Keys.LLM.EXPERT_USED_COUNT: TypedKey(int),
    Keys.Attention.HEAD_COUNT: TypedKey(int),
    Keys.Attention.HEAD_COUNT_KV: TypedKey(int),
    Keys.Attention.KEY_LENGTH: TypedKey(int),
    Keys.Attention.SLIDING_WINDOW: TypedKey(int),
    Keys.Attention.LAYERNORM_EPS: TypedKey(float),
    Keys.Attention.LAYERNORM_RMS_EPS: TypedKey(float),
    Keys.Rope.FREQ_BASE: TypedKey(float),
    Keys.Rope.SCALING_TYPE: TypedKey(str),
    Keys.Rope.SCALING_FACTOR: TypedKey(float),
    FFN_ACTIVATION_KEY: TypedKey(str),
    # The tokenizer (runtime/tokenizer.py), as llama.cpp reads it: one text per id, each once.
    Keys.Tokenizer.MODEL: TypedKey(str),
    Keys.Tokenizer.PRE: TypedKey(str),
    Keys.Tokenizer.LIST: TypedKey(str, Keys.LLM.VOCAB_SIZE, noun="tokens", distinct=True),
    Keys.Tokenizer.TOKEN_TYPE: TypedKey(int, Keys.Tokenizer.LIST, noun="token types"),
    Keys.Tokenizer.SCORES: TypedKey(float, Keys.Tokenizer.LIST, noun="scores"),
    Keys.Tokenizer.MERGES: TypedKey(str, ANY, noun="merges"),
    Keys.Tokenizer.BOS_ID: TypedKey(int),
    Keys.Tokenizer.EOS_ID: TypedKey(int),
    Keys.Tokenizer.ADD_BOS: TypedKey(bool),
    Keys.Tokenizer.ADD_PREFIX: TypedKey(bool),
    Keys.Tokenizer.CHAT_TEMPLATE: TypedKey(str),
    # PowerInfer's predictors, and ours: what they were trained to, neuron frequencies, thresholds, bundles.
    SPARSE_THRESHOLD_KEY: TypedKey(float),
    PREDICTOR_RECALL_KEY: TypedKey(float, ANY, least=0, most=1, noun="shares"),
    PREDICTOR_PRECISION_KEY: TypedKey(float, ANY, least=0, most=1, noun="shares"),
    PREDICTOR_COMPUTED_KEY: TypedKey(float, ANY, least=0, most=1, noun="shares"),
    NEURON_FREQUENCY_KEY: TypedKey(float, Keys.LLM.FEED_FORWARD_LENGTH, least=0, most=1, noun="firing probabilities"),
    EXPERT_NEURON_FREQUENCY_KEY: TypedKey(float, Keys.LLM.FEED_FORWARD_LENGTH, least=0, most=1,
                                          noun="firing probabilities"),
    EXPERT_FREQUENCY_KEY: TypedKey(float, Keys.LLM.EXPERT_COUNT, least=0, most=1, noun="routing frequencies"),
    SPARSITY_RULE_KEY: TypedKey(str),
    SPARSITY_TARGET_KEY: TypedKey(float, least=0, below=1),
    SPARSITY_THRESHOLD_KEY: TypedKey(float, LAYERS, least=0, noun="thresholds"),
    SPARSITY_MAX_LOSS_KEY: TypedKey(float, least=0),
    SPARSITY_PERPLEXITY_KEY: TypedKey(float, least=1),
    SPARSITY_CURVE_SPARSITY_KEY: TypedKey(float, ANY, least=0, below=1, noun="sparsities"),
    SPARSITY_CURVE_PERPLEXITY_KEY: TypedKey(float, SPARSITY_CURVE_SPARSITY_KEY, least=1, noun="perplexities"),
    FFN_BUNDLE_PARTS_KEY: TypedKey(str, ANY, noun="tensor names"),
    FFN_BUNDLE_TYPES_KEY: TypedKey(int, FFN_BUNDLE_PARTS_KEY, noun="GGML types"),
    FFN_BUNDLE_STRIDE_KEY: TypedKey(int, least=1),
}

# The keys we read from a split file (formats/gpu_split.py). Its layer count is its tensors' (two per layer).
SPLIT_KEYS: dict[str, TypedKey] = {
    VRAM_CAPACITY_KEY: TypedKey(int, least=0),
    Keys.LLM.BLOCK_COUNT: TypedKey(int),
    VRAM_BUDGET_KEY: TypedKey(int, least=0),
    DENSE_ON_GPU_KEY: TypedKey(bool, LAYERS),
    OUTPUT_ON_GPU_KEY: TypedKey(bool),
    MODEL_FINGERPRINT_KEY: TypedKey(str),
    RAM_BUDGET_KEY: TypedKey(int, least=0),
    CACHE_BYTES_KEY: TypedKey(int, least=0),
    LAYER_RAM_NEURONS_KEY: TypedKey(int, ANY, least=0, noun="neuron ids"),
}


def check_metadata(source: Any, metadata: Mapping[str, Any], table: Mapping[str, TypedKey],
                   counts: Mapping[str, int] | None = None) -> None:
    """Refuse a value of ``metadata`` (a whole file's) that breaks its key's entry of ``table``. ``counts``: the
    confirmed count of a length key of the table (``LAYERS``: the layers), for the arrays of that many items."""
    arch = metadata.get(Keys.General.ARCHITECTURE)
    plain, patterned = _entries(table, arch if isinstance(arch, str) else "")
    for key, value in metadata.items():
        typed = _entry(plain, patterned, key)
        if typed is not None:
            check_value(source, key, typed, value, _count(metadata, arch, typed.length, counts or {}))


def read_key(get: Callable[[str], Any], key: str, source: Any, count: int | None = None,
             required: str | None = None) -> Any:
    """``key``'s value by ``get`` (a model file's, a dict's), checked against its entry of ``MODEL_KEYS``; an array
    of ``count`` items when given. None when absent, unless ``required`` says what needs it."""
    typed = _entry(*_entries(MODEL_KEYS, ""), key)
    value = get(key)
    if value is None:
        if required is not None:
            raise PitoolsError(f"{source}: {key} {typed.expected(count)} ({required}); the file has none")
        return None
    check_value(source, key, typed, value, count)
    return value


def check_value(source: Any, key: str, typed: TypedKey, value: Any, count: int | None = None) -> None:
    """Refuse ``value`` unless ``typed`` admits it (an array of ``count`` items, when given)."""
    if typed.length is None:
        if not typed.admits(value):
            raise PitoolsError(f"{source}: {key} {typed.expected()}, not {_shown(value)}")
        return
    if not isinstance(value, list) or not set(map(type, value)) <= _TYPES[typed.kind]:
        raise PitoolsError(f"{source}: {key} is not an array of {_KIND_WORDS[typed.kind][1]}: {_shown(value)}")
    if (count is not None and len(value) != count) or not typed.admits_all(value):  # without a count, its own
        raise PitoolsError(f"{source}: {key} {typed.expected(len(value) if count is None else count)}, "
                           f"not {_shown(value)}")
    if typed.distinct:
        _check_distinct(source, key, value)


def _entries(table: Mapping[str, TypedKey], arch: str) -> tuple[dict[str, TypedKey], list[tuple[re.Pattern, TypedKey]]]:
    """The table's keys spelled for ``arch``; those of any layer (expert, name) as patterns."""
    plain, patterned = {}, []
    for template, typed in table.items():
        if "{" in template.replace("{arch}", ""):
            patterned.append((re.compile(re.sub(r"\\\{\w+\\\}", r"[^.]+", re.escape(template))), typed))
        else:
            plain[template.format(arch=arch)] = typed
    return plain, patterned


def _entry(plain: dict[str, TypedKey], patterned: list[tuple[re.Pattern, TypedKey]], key: str) -> TypedKey | None:
    return plain.get(key) or next((typed for pattern, typed in patterned if pattern.fullmatch(key)), None)


def _count(metadata: Mapping[str, Any], arch: Any, length: str | None, counts: Mapping[str, int]) -> int | None:
    """How many items an array of ``length`` must hold, when that is known: a confirmed count, or the length of
    the array it shares its length with."""
    if length in counts:
        return counts[length]
    value = None if length in (None, ANY) else metadata.get(length.format(arch=arch))
    return len(value) if isinstance(value, list) else None


def _check_distinct(source: Any, key: str, values: list) -> None:
    if len(set(values)) == len(values):
        return
    first: dict[Any, int] = {}
    for i, value in enumerate(values):
        if value in first and value != "":
            raise PitoolsError(f"{source}: {key} holds {_shown(value)} twice (at {first[value]} and {i}); "
                               "each item must be distinct, as llama.cpp requires")
        first.setdefault(value, i)


def _shown(value: Any) -> str:
    """A value for a message, cut short: a file may hold a whole vocabulary where a number is due."""
    if isinstance(value, list):
        head = repr(value[:6])[:-1] + (", ...]" if len(value) > 6 else "]")
        return f"{_cut(head)} ({len(value)} item{'' if len(value) == 1 else 's'})"
    return _cut(repr(value))


def _cut(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def _with_article(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase
