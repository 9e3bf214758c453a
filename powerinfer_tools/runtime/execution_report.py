"""Which path and which kernels compute each part of a loaded model (``RuntimeModel.execution_report``):
what ``pitools run --verbose`` prints, ``pitools bench`` records and ``LLM.description`` ends with the gist of.

    kernels: compiled: numba loops + ggml vec_dot ..., 2 threads
    layers 0-5: compiled decoder | attention q4_0 interleaved, ggml gemv | FFN sparse, predicted (predictor
        hidden size 16) | gate/up q4_0 rows, ggml vec_dot | down ffn_down_t q4_0, axpy of ours
    output head: q8_0, ggml vec_dot
    prompts (blocks of tokens): general path | sparse FFN: each token's own chosen neurons (kernels.batched)
        while they are under 30% of them, else their union

A layer's line tells how a decoded token runs it: by the compiled decoder (``compiled_decode``) or, when
that refuses the model, the step or this layer, by the general path (``RuntimeModel._layer``), and then
which kernel each product takes. Every fact is read from the predicates the code chooses by (the decoder's
``refusal``/``step_refusal`` and kernel choices, ``kernels.available``, ``numba_vnni.usable``,
``numba_kernels.axpy_takes``, ``isinstance(m, InterleavedQ4)``), never from a copy of their rules.
Consecutive layers alike but for their sizes (a predictor's hidden size, a calibrated threshold, a neuron
cache's share) are one line, their sizes as ranges.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field

from gguf import MODEL_TENSOR

from powerinfer_tools import kernels
from powerinfer_tools.formats.constants import PowerInferTensor, block_part
from powerinfer_tools.formats.weight_types import WEIGHT_TYPES
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.kernels.interleaved import InterleavedQ4
from powerinfer_tools.runtime.engine import OWN_NEURONS_DENSITY, computes_tokens_own_neurons
from powerinfer_tools.runtime.gate_choice import GATE_CHOOSES

REFERENCE = "NumPy reference"
DOWN, DOWN_T = block_part(MODEL_TENSOR.FFN_DOWN), block_part(PowerInferTensor.FFN_DOWN_T)


@dataclass(frozen=True)
class Phrase:
    """Words whose numbers may differ between layers otherwise alike: ``text`` has one format field per entry
    of ``numbers`` (each entry: this layer's values, several for a mixture's experts)."""

    text: str
    numbers: tuple[tuple[float, ...], ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class LayerExecution:
    """How a decoded token runs one layer; equal for layers that one line describes."""

    path: str
    attention: str
    ffn: tuple[Phrase, ...]
    gate_up: str
    down: str


def execution_report(model) -> list[str]:
    """The report's lines for ``model`` (a ``RuntimeModel``), as loaded and in its FFN mode."""
    layers = [_layer_execution(model, layer, path) for layer, path in zip(model.layers, model.layer_paths())]
    lines = [f"kernels: {kernels.describe()}"]
    first = 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or layers[i] != layers[first]:
            lines.append(_group_line(first, layers[first:i]))
            first = i
    lines.append(f"output head: {one_token_product(model.output, model.head_backend)}")
    lines.append(f"prompts (blocks of tokens): general path | {_prompt_ffn(model)}{_prompt_products(model)}")
    return lines


def _layer_execution(model, layer, path: str) -> LayerExecution:
    if path == "compiled decoder":  # compiled_decode needs numba: imported where the decoder is in use
        from powerinfer_tools.runtime import compiled_decode

        attention = compiled_decode.attention_kernel(layer.dense)
        gate_up, down = compiled_decode.ffn_kernels(layer)
    else:
        d = layer.dense
        attention = _distinct(one_token_product(m, d.backend) for m in (d.wq, d.wk, d.wv, d.wo))
        partitions = _partitions(layer)
        gate_up = _distinct(one_token_product(m, p.backend) for p in partitions for m in (p.gate, p.up)
                            if m is not None)
        down = _distinct(_down_product(p) for p in partitions)
    return LayerExecution(path, attention, _ffn_variant(model, layer), gate_up, down)


def _group_line(first: int, group: list[LayerExecution]) -> str:
    """One line for consecutive layers ``first ..`` alike but for their numbers (shown as ranges)."""
    last = first + len(group) - 1
    label = f"layer {first}" if last == first else f"layers {first}-{last}"
    e = group[0]
    ffn = ", ".join(_phrase_text([layer.ffn[k] for layer in group]) for k in range(len(e.ffn)))
    return f"{label}: {e.path} | attention {e.attention} | FFN {ffn} | gate/up {e.gate_up} | down {e.down}"


def _phrase_text(alike: list[Phrase]) -> str:
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


def one_token_product(m, backend) -> str:
    """How the general path multiplies one token by ``m`` on ``backend`` (``CpuBackend.matmul``:
    ``kernels.interleaved_matmul``, or ``kernels.matvec`` with AVX-512 VNNI for one token where usable)."""
    name = WEIGHT_TYPES[m.qtype].name
    if backend.is_device:
        return f"{name} on {backend.name}"
    if isinstance(m, InterleavedQ4):
        ggml = kernels.ggml_routines()
        return f"{name} interleaved, {'ggml gemv' if ggml is not None and ggml.interleaved else REFERENCE}"
    if not kernels.available():  # else numba is there, which numba_vnni needs
        return f"{name}, {REFERENCE}"
    from powerinfer_tools.kernels import numba_vnni

    return f"{name}, {'AVX-512 VNNI' if numba_vnni.usable(int(m.qtype), m.cols) else 'ggml vec_dot'}"


def _down_product(p) -> str:
    """How the general path computes partition ``p``'s down projection for one token: ``kernels.row_axpy``
    over ``ffn_down_t`` (our axpy where it decodes the type, else the reference), or a dense file's
    ``ffn_down`` as a product."""
    if p.down_t is None:
        return f"{DOWN} {one_token_product(p.down, p.backend)}"
    name = WEIGHT_TYPES[p.down_t.qtype].name
    if p.backend.is_device:
        return f"{DOWN_T} {name} on {p.backend.name}"
    if kernels.available():
        from powerinfer_tools.kernels import numba_kernels

        if numba_kernels.axpy_takes(p.down_t.qtype, p.down_t.cols):
            return f"{DOWN_T} {name}, axpy of ours"
    return f"{DOWN_T} {name}, {REFERENCE}"


def _ffn_variant(model, layer) -> tuple[Phrase, ...]:
    """What a layer's FFN computes in the model's mode, and where its neurons live."""
    phrases = []
    if layer.experts:
        phrases.append(Phrase(f"mixture of {len(layer.experts)} experts, top-{model.spec.n_experts_used}"))
    if model.mode is FFNMode.SPARSE:
        phrases.append(_sparsity(layer))
    elif model.mode is FFNMode.ORACLE:
        phrases.append(Phrase("oracle (every neuron computed to find those that fire)"))
    else:
        phrases.append(Phrase(model.mode.value))
    partitions = _partitions(layer, every_expert=True)
    caches = [p.cache for p in partitions if p.cache is not None]
    if caches:
        phrases.append(Phrase("behind neuron caches (--ram: {:d} neurons pinned, {:d} slots)" if len(caches) > 1
                              else "behind a neuron cache (--ram: {:d} neurons pinned, {:d} slots)",
                              ((sum(c.n_pinned for c in caches),), (sum(c.capacity for c in caches),))))
    on_device = [p for p in partitions if p.backend.is_device]
    if on_device:
        share = sum(len(p.neurons) for p in on_device) / (layer.d_ff * max(len(layer.experts), 1))
        phrases.append(Phrase(f"{{:.0%}} of the neurons on {on_device[0].backend.name}", ((share,),)))
    return tuple(phrases)


def _sparsity(layer) -> Phrase:
    """Sparse mode's choice of neurons: the whole gate's (a ReLU family's, ``gate_choice``), a SiLU model's
    thresholds (CATS, TEAL or both), or predictors."""
    t = layer.dense.thresholds
    if t is GATE_CHOOSES:
        return Phrase("sparse, the firing neurons from the whole gate (exact)")
    if t is not None:
        used = [(label, value) for label, value in (("CATS", t.cats), ("TEAL input", t.ffn_in),
                                                     ("TEAL down", t.ffn_down)) if value is not None]
        rule = "+".join(dict.fromkeys(label.split()[0] for label, _ in used))
        return Phrase(f"sparse, {rule} (" + ", ".join(f"{label} threshold {{:.3g}}" for label, _ in used) + ")",
                      tuple((value,) for _, value in used))
    predictors = [e.predictor for e in layer.experts] if layer.experts else [layer.dense.predictor]
    if any(p is None for p in predictors):
        return Phrase("sparse, but without predictors (a step fails)")
    return Phrase("sparse, predicted (predictor hidden size {:d})", (tuple(p.fc1.rows for p in predictors),))


def _prompt_ffn(model) -> str:
    """How a block of tokens computes the FFNs: every neuron, a SiLU model's thresholded block, or each token's
    own predicted neurons (``kernels.batched``) where that applies (``computes_tokens_own_neurons``) and they are
    few enough (``OWN_NEURONS_DENSITY``), else their union."""
    if model.mode is FFNMode.DENSE:
        return "FFN: every neuron"
    if model.mode is FFNMode.SPARSE and all(layer.dense.thresholds is not None for layer in model.layers):
        return _thresholded_prompt_ffn(model)
    cpu = [p for layer in model.layers for p in _partitions(layer, every_expert=True) if not p.backend.is_device]
    taking = sum(computes_tokens_own_neurons(p) for p in cpu)
    own = (f"each token's own chosen neurons (kernels.batched) while they are under {OWN_NEURONS_DENSITY:.0%} of "
           "them, else")
    if taking == len(cpu):
        return f"{model.mode.value} FFN: {own} their union"
    if taking == 0:
        return f"{model.mode.value} FFN: the union of the tokens' chosen neurons for every token"
    return f"{model.mode.value} FFN: {own} their union, in {taking} of {len(cpu)} CPU partitions; the union elsewhere"


def _prompt_products(model) -> str:
    """How a block of tokens multiplies the host's matrices kept as rows (``CpuBackend.matmul`` and ``row_sum``
    beyond the one-token kernels; interleaved ones take ggml's GEMM, as the layer lines say): a q4_0 matrix
    used whole through ggml's GEMM on an interleaved copy, other quantized rows and q4_0 ``ffn_down_t`` in
    bfloat16 products where the CPU has AVX-512 BF16 (``kernels.bf16_matmuls`` / ``bf16_row_sums``), the rest
    dequantized for BLAS; nothing to say where no matrix is kept as rows."""
    rows, down_t = [], []
    for layer in model.layers:
        d = layer.dense
        if not d.backend.is_device:
            rows += [m for m in (d.wq, d.wk, d.wv, d.wo) if not isinstance(m, InterleavedQ4)]
        for p in _partitions(layer, every_expert=True):
            if not p.backend.is_device:
                rows += [m for m in (p.gate, p.up, p.down) if m is not None and not isinstance(m, InterleavedQ4)]
                down_t += [p.down_t] if p.down_t is not None else []
    parts = []
    if rows:
        parts.append("rows " + _by_way((m, _block_way(kernels.interleaves(m), kernels.bf16_matmuls(m))) for m in rows))
    if down_t:
        parts.append(f"{DOWN_T} " + _by_way((m, _block_way(False, kernels.bf16_row_sums(m))) for m in down_t))
    return "".join(f" | {part}" for part in parts)


def _block_way(interleaves: bool, in_bf16: bool) -> str:
    if not kernels.available():
        return REFERENCE
    if interleaves:
        return "ggml GEMM on an interleaved copy"
    return "bfloat16 products (AVX-512 BF16)" if in_bf16 else "dequantized for BLAS"


def _by_way(matrices_and_ways) -> str:
    """``q5_0, q4_k: bfloat16 products / f16: dequantized for BLAS``: each way once, with its types in order."""
    types: dict[str, dict[str, None]] = {}
    for m, way in matrices_and_ways:
        types.setdefault(way, {})[WEIGHT_TYPES[m.qtype].name] = None
    return " / ".join(f"{', '.join(names)}: {way}" for way, names in types.items())


def _thresholded_prompt_ffn(model) -> str:
    """``thresholded_ffn.block``: every neuron's gate, the mask of the rule (or of the gate's choice), then each
    token's kept neurons from up and ``ffn_down_t`` alone where that applies (a CPU partition that
    ``computes_tokens_own_neurons`` given the gate products, no TEAL on the down projection's input) and they
    are few enough, else every neuron's up."""
    mask = "the gate's choice" if model.spec.ffn.sparse else "the thresholds' mask"
    cpu = [(layer, p) for layer in model.layers for p in _partitions(layer) if not p.backend.is_device]
    taking = sum(layer.dense.thresholds.ffn_down is None and computes_tokens_own_neurons(p, gate_given=True)
                 for layer, p in cpu)
    if taking == 0:
        return f"sparse FFN: every neuron's gate and up, then {mask}"
    where = "" if taking == len(cpu) else f" (in {taking} of {len(cpu)} CPU partitions; elsewhere every neuron's up)"
    return (f"sparse FFN: every neuron's gate, {mask}, then each token's kept neurons from up and down alone "
            f"(kernels.batched) while under {OWN_NEURONS_DENSITY:.0%} of them, else every neuron's up{where}")


def _partitions(layer, every_expert: bool = False) -> list:
    """A layer's FFN partitions: its own, or a mixture's first expert's (``every_expert``: all experts')."""
    if not layer.experts:
        return layer.partitions
    return [p for e in (layer.experts if every_expert else layer.experts[:1]) for p in e.partitions]


def _distinct(descriptions) -> str:
    """Descriptions, each once, in order: ``q4_k, ggml vec_dot / q6_k, ggml vec_dot``."""
    return " / ".join(dict.fromkeys(descriptions))
