"""How each layer's FFN runs in each FFN mode, decided once per loaded model (``RuntimeModel.ffn_plans``).

A plan (``FFNPlan``) is built from what the loader made of the file, the split's device and the RAM budget
(the layer's partitions, predictors, thresholds and neuron caches) and the mode: how the neurons are chosen
(``Choice``), how gate/up (``GateUp``) and down (``Down``) are computed, the neuron cache's strategy
(``Cache``), the experts' routing, and what a token reads (``bytes_read``: the one count of the FFN's bytes,
which ``TokenStats`` sums and the execution report prints). Every engine dispatches on it and none decides
again per token: the general path (``RuntimeModel._ffn``; ``thresholded_ffn.ffn`` for the rules) reads its
enums, the compiled decoder (``compiled_decode``) has them as numbers in each layer's ``LayerWeights``, one set
per mode. Its text (``phrases``, ``reads``, ``gist``) is what ``pitools run --verbose``, ``pitools bench`` and
``LLM.description`` print.
"""

from __future__ import annotations

import enum
import string
from collections import Counter
from dataclasses import dataclass, field

from powerinfer_tools.formats.activation_thresholds import LayerThresholds
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.kernels.interleaved import InterleavedQ4
from powerinfer_tools.runtime.gate_choice import GATE_CHOOSES

KIB = 1024


class Choice(enum.Enum):
    """What chooses the neurons a token computes: its words, and whether the rules' code computes it
    (``thresholded``: ``thresholded_ffn``, ``thresholded_decode``)."""

    EVERY = "every neuron", False  # dense mode
    PREDICTOR = "predictor", False  # the layer's (or each routed expert's) trained predictor, on the residual
    CATS = "CATS", True  # the thresholds' rule on every gate product (with TEAL's, where the file has them)
    TEAL = "TEAL", True  # TEAL alone: every neuron, the small entries of its input (and of down's) dropped
    WHOLE_GATE = "whole gate (exact)", True  # a ReLU family's firing neurons: CATS at threshold 0 (``gate_choice``)
    ORACLE = "oracle", False  # the neurons that fire, from every neuron's activations (a measurement)

    def __init__(self, words: str, thresholded: bool):
        self.words, self.thresholded = words, thresholded  # attributes: read per step


class GateUp(enum.Enum):
    """How the gate and up products of the computed neurons are made."""

    ROWS = "rows"  # each computed neuron's gate and up rows
    GATE_WHOLE = "gate whole"  # every neuron's gate product (read to choose, or interleaved), up from rows
    WHOLE = "whole"  # every neuron's gate and up products (interleaved, in one pass)


class Down(enum.Enum):
    ROWS = "rows"  # the computed neurons' ``ffn_down_t`` rows (those TEAL keeps), added weighted
    WHOLE = "whole"  # a dense file's ``ffn_down``, every neuron


class Cache(enum.Enum):
    """Where the rows come from under a RAM budget (``neuron_cache``)."""

    NONE = "none"  # in memory (mapped or copied)
    CHOSEN = "chosen"  # the chosen neurons' rows through the layer's neuron cache, cold ones read from the file
    STREAMED = "streamed"  # every neuron streamed through the cache, range by range (dense mode)


@dataclass(frozen=True)
class Phrase:
    """Words whose numbers may differ between layers otherwise alike: ``text`` has one format field per entry
    of ``numbers`` (each entry: this layer's values, several for a mixture's experts)."""

    text: str
    numbers: tuple[tuple[float, ...], ...] = field(default=(), compare=False)


def phrase_text(alike: list[Phrase]) -> str:
    """The phrase of several layers, each number as its range over them (``16-64``) or its one value."""
    pieces, k = [], 0
    for literal, name, spec, _ in string.Formatter().parse(alike[0].text):
        pieces.append(literal)
        if name is not None:  # the k-th number
            values = [v for phrase in alike for v in phrase.numbers[k]]
            low, high = format(min(values), spec), format(max(values), spec)
            pieces.append(low if low == high else f"{low}-{high}")
            k += 1
    return "".join(pieces)


@dataclass(frozen=True)
class FFNPlan:
    """One layer's FFN in one mode (a mixture's: each routed expert's, alike but for their predictors)."""

    mode: FFNMode
    d_ff: int  # neurons of the FFN, or of each expert
    choice: Choice
    thresholds: LayerThresholds | None  # the rules' (CATS, TEAL, the whole gate's); None for other choices
    gate_up: GateUp
    down: Down
    cache: Cache
    experts: int  # a mixture's experts, each an FFN of ``d_ff`` neurons; 0 for one FFN
    experts_used: int  # routed to per token
    hidden: tuple[int, ...]  # the predictors' hidden sizes (a predictor choice; none where a unit has none)
    predictors_missing: bool  # a predictor choice with an FFN that has none: a step fails
    device: str | None  # the backend holding some of the neurons (a split), if any
    device_share: float  # and its share of them
    caches: int  # neuron caches (one per FFN behind one) ...
    pinned: int  # ... their pinned neurons ...
    slots: int  # ... and slots
    # What a token reads of each FFN (per unit: the layer's, or each expert's): ``bytes_read``.
    predictor_bytes: tuple[int, ...]  # per unit, its predictor, where it chooses
    whole_bytes: int  # the matrices computed whole (a gate read to choose, interleaved ones)
    neuron_bytes: int  # a computed neuron's gate/up rows read by neuron
    down_bytes: int  # a down row (``ffn_down_t``'s, or a dense ``ffn_down``'s column)

    def bytes_read(self, neurons: int, down_rows: int, unit: int = 0) -> int:
        """Bytes one call of FFN ``unit`` (0, or the routed expert) reads computing ``neurons`` neurons (for a
        block of tokens, the rows it read: their union, or all) and ``down_rows`` rows of down."""
        return self.predictor_bytes[unit] + self.whole_bytes + self.neuron_bytes * neurons + self.down_bytes * down_rows

    @property
    def choice_words(self) -> str:
        """``predictor``, ``CATS+TEAL``, ``whole gate (exact)``: what chooses, in a word or two."""
        if self.choice in (Choice.CATS, Choice.TEAL):
            t = self.thresholds
            return "+".join(rule for rule, used in (("CATS", t.cats is not None),
                                                    ("TEAL", t.ffn_in is not None or t.ffn_down is not None)) if used)
        return self.choice.words

    def phrases(self) -> tuple[Phrase, ...]:
        """What the FFN computes in its mode, and where its neurons live: the report's ``FFN`` column."""
        phrases = [Phrase(f"mixture of {self.experts} experts, top-{self.experts_used}")] if self.experts else []
        phrases.append(self._mode_phrase())
        if self.cache is not Cache.NONE:
            phrases.append(Phrase(f"behind {'neuron caches' if self.caches > 1 else 'a neuron cache'} "
                                  "(--ram: {:d} neurons pinned, {:d} slots)", ((self.pinned,), (self.slots,))))
        if self.device is not None:
            phrases.append(Phrase(f"{{:.0%}} of the neurons on {self.device}", ((self.device_share,),)))
        return tuple(phrases)

    def _mode_phrase(self) -> Phrase:
        if self.mode is FFNMode.DENSE:
            return Phrase("dense")
        if self.mode is FFNMode.ORACLE:
            return Phrase("oracle (every neuron computed to find those that fire)")
        if self.choice is Choice.WHOLE_GATE:
            return Phrase("sparse, the firing neurons from the whole gate (exact)")
        if self.choice.thresholded:
            t = self.thresholds
            used = [(label, value) for label, value in (("CATS", t.cats), ("TEAL input", t.ffn_in),
                                                         ("TEAL down", t.ffn_down)) if value is not None]
            rules = ", ".join(f"{label} threshold {{:.3g}}" for label, _ in used)
            return Phrase(f"sparse, {self.choice_words} ({rules})", tuple((value,) for _, value in used))
        if self.predictors_missing:
            return Phrase("sparse, but without predictors (a step fails)")
        return Phrase("sparse, predicted (predictor hidden size {:d})", (self.hidden,))

    def reads(self) -> Phrase:
        """``reads 2.25 KiB + 1.5 KiB a neuron``: what a token reads of the FFN (of a mixture, each routed
        expert), from ``bytes_read``."""
        fixed = tuple((predictor + self.whole_bytes) / KIB for predictor in self.predictor_bytes)
        who = "a routed expert reads" if self.experts else "reads"
        if self.choice is Choice.EVERY:  # every neuron, every row of down
            return Phrase(who + " {:.4g} KiB", (tuple(f + self.d_ff * (self.neuron_bytes + self.down_bytes) / KIB
                                                      for f in fixed),))
        if self.thresholds is not None and self.thresholds.ffn_down is not None:  # fewer down rows than neurons
            per_row = " + {:.4g} KiB a neuron + {:.4g} KiB a down row kept"
            rates = ((self.neuron_bytes / KIB,), (self.down_bytes / KIB,))
        else:
            per_row, rates = " + {:.4g} KiB a neuron", (((self.neuron_bytes + self.down_bytes) / KIB,),)
        if not any(fixed):  # nothing but rows (the oracle's count: the rows of the neurons that fire)
            return Phrase(who + per_row.removeprefix(" +"), rates)
        return Phrase(who + " {:.4g} KiB" + per_row, (fixed, *rates))


def gist(plans: list[FFNPlan]) -> str:
    """``neurons: predictor in 20 layers, whole gate (exact) in 2``: what chooses the neurons, in how many layers
    (``LLM.description``)."""
    counts = Counter(plan.choice_words for plan in plans)
    if len(counts) == 1:
        return f"neurons: {next(iter(counts))} in every layer"
    return "neurons: " + ", ".join(f"{words} in {n} layer{'s' * (n > 1)}" for words, n in counts.items())


def plan_ffn(layer, mode: FFNMode, experts_used: int) -> FFNPlan:
    """The plan of ``layer`` (a ``RuntimeLayer``, as loaded) in ``mode``; ``experts_used``: the model's top-k."""
    units = [(e.partitions, e.predictor) for e in layer.experts] or [(layer.partitions, layer.dense.predictor)]
    partitions = [p for unit, _ in units for p in unit]
    choice = _choice(mode, layer.dense.thresholds)
    first = partitions[0]  # the experts' matrices, and a layer's partitions', are of one type each
    # CATS and the whole gate read every gate row to choose; the loader interleaves what is only ever computed
    # whole (loader.whole_matrix: a dense file's, a CATS gate, up beside it where it pays)
    gate_whole = first.gate is not None and (choice in (Choice.CATS, Choice.WHOLE_GATE)
                                             or any(isinstance(p.gate, InterleavedQ4) for p in partitions))
    up_whole = any(isinstance(p.up, InterleavedQ4) for p in partitions)
    gate = first.gate.row_bytes if first.gate is not None else 0
    down = first.down_t.row_bytes if first.down_t is not None else first.down.nbytes // first.down.cols
    caches = [p.cache for p in partitions if p.cache is not None]
    on_device = [p for p in partitions if p.backend.is_device]
    predictors = [predictor for _, predictor in units]
    return FFNPlan(
        mode=mode, d_ff=layer.d_ff, choice=choice,
        thresholds=layer.dense.thresholds if choice.thresholded else None,
        gate_up=GateUp.WHOLE if up_whole else GateUp.GATE_WHOLE if gate_whole else GateUp.ROWS,
        down=Down.ROWS if first.down_t is not None else Down.WHOLE,
        cache=Cache.NONE if not caches else Cache.CHOSEN if choice is Choice.PREDICTOR else Cache.STREAMED,
        experts=len(layer.experts), experts_used=experts_used if layer.experts else 0,
        hidden=tuple(p.fc1.rows for p in predictors if p is not None),
        predictors_missing=choice is Choice.PREDICTOR and any(p is None for p in predictors),
        device=on_device[0].backend.name if on_device else None,
        device_share=sum(len(p.neurons) for p in on_device) / (layer.d_ff * len(units)),
        caches=len(caches), pinned=sum(c.n_pinned for c in caches), slots=sum(c.capacity for c in caches),
        predictor_bytes=tuple(p.nbytes if p is not None and choice is Choice.PREDICTOR else 0 for p in predictors),
        whole_bytes=layer.d_ff * (gate * gate_whole + first.up.row_bytes * up_whole),
        neuron_bytes=gate * (not gate_whole) + first.up.row_bytes * (not up_whole),
        down_bytes=down,
    )


def _choice(mode: FFNMode, thresholds: LayerThresholds | None) -> Choice:
    if mode is FFNMode.DENSE:
        return Choice.EVERY
    if mode is FFNMode.ORACLE:
        return Choice.ORACLE
    if thresholds is GATE_CHOOSES:
        return Choice.WHOLE_GATE
    if thresholds is not None:
        return Choice.TEAL if thresholds.cats is None else Choice.CATS
    return Choice.PREDICTOR
