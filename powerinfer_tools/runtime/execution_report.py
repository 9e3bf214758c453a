"""Which path and which kernels compute each part of a loaded model (``RuntimeModel.execution_report``):
what ``pitools run --verbose`` prints, ``pitools bench`` records and ``LLM.description`` ends with the gist of.

    kernels: compiled: numba loops + ggml vec_dot ..., 2 threads
    layers 0-5: compiled decoder | attention q4_0 interleaved, ggml gemv | FFN sparse, predicted (predictor
        hidden size 16) | gate/up q4_0 rows, ggml vec_dot | down ffn_down_t q4_0, axpy of ours | reads 6.25 KiB
        + 0.3516 KiB a neuron
    output head: q8_0, ggml vec_dot
    prompts (blocks of tokens): general path | sparse FFN: each token's own chosen neurons (kernels.batched)
        while they are under 30% of them, else their union | attention: compiled tiles (numba_attention)

A layer's line tells how a decoded token runs it: by the compiled decoder (``compiled_decode``) or, when
that refuses the model, the step or this layer, by the general path (``RuntimeModel._layer``), and then
what its FFN's plan for the mode computes (``ffn_plan``: the FFN column and what a token reads) and which
kernel each product takes. Every fact is read from the plan or the predicates the code chooses by (the
decoder's ``refusal``/``step_refusal`` and kernel choices, ``kernels.available``, ``numba_vnni.usable``,
``numba_kernels.axpy_takes``, ``isinstance(m, InterleavedQ4)``), never from a copy of their rules.
Consecutive layers alike but for their sizes (a predictor's hidden size, a calibrated threshold, a neuron
cache's share, the bytes read) are one line, their sizes as ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import MODEL_TENSOR

from powerinfer_tools import kernels
from powerinfer_tools.formats.constants import PowerInferTensor, block_part
from powerinfer_tools.formats.weight_types import WEIGHT_TYPES
from powerinfer_tools.kernels.interleaved import InterleavedQ4
from powerinfer_tools.runtime.engine import (EVERY_DOWN_ROW_TOKENS, OWN_NEURONS_DENSITY, computes_tokens_own_neurons,
                                             reads_every_down_row)
from powerinfer_tools.runtime.ffn_plan import Choice, Phrase, phrase_text

REFERENCE = "NumPy reference"
DOWN, DOWN_T = block_part(MODEL_TENSOR.FFN_DOWN), block_part(PowerInferTensor.FFN_DOWN_T)


@dataclass(frozen=True)
class LayerExecution:
    """How a decoded token runs one layer; equal for layers that one line describes."""

    path: str
    attention: str
    ffn: tuple[Phrase, ...]  # its plan's
    gate_up: str
    down: str
    reads: Phrase  # its plan's


def execution_report(model) -> list[str]:
    """The report's lines for ``model`` (a ``RuntimeModel``), as loaded and in its FFN mode."""
    layers = [_layer_execution(layer, plan, path)
              for layer, plan, path in zip(model.layers, model.ffn_plans[model.mode], model.layer_paths())]
    lines = [f"kernels: {kernels.describe()}"]
    first = 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or layers[i] != layers[first]:
            lines.append(_group_line(first, layers[first:i]))
            first = i
    lines.append(f"output head: {one_token_product(model.output, model.head_backend)}")
    lines.append(f"prompts (blocks of tokens): general path | {_prompt_ffn(model)}{_prompt_attention(model)}"
                 f"{_prompt_products(model)}")
    return lines


def _layer_execution(layer, plan, path: str) -> LayerExecution:
    if path == "compiled decoder":  # compiled_decode needs numba: imported where the decoder is in use
        from powerinfer_tools.runtime import compiled_decode

        attention = compiled_decode.attention_kernel(layer.dense)
        gate_up, down = compiled_decode.ffn_kernels(layer, plan)
    else:
        d = layer.dense
        attention = _distinct(one_token_product(m, d.backend) for m in (d.wq, d.wk, d.wv, d.wo))
        partitions = _partitions(layer)
        gate_up = _distinct(one_token_product(m, p.backend) for p in partitions for m in (p.gate, p.up)
                            if m is not None)
        down = _distinct(_down_product(p) for p in partitions)
    return LayerExecution(path, attention, plan.phrases(), gate_up, down, plan.reads())


def _group_line(first: int, group: list[LayerExecution]) -> str:
    """One line for consecutive layers ``first ..`` alike but for their numbers (shown as ranges)."""
    last = first + len(group) - 1
    label = f"layer {first}" if last == first else f"layers {first}-{last}"
    e = group[0]
    ffn = ", ".join(phrase_text([layer.ffn[k] for layer in group]) for k in range(len(e.ffn)))
    reads = phrase_text([layer.reads for layer in group])
    return f"{label}: {e.path} | attention {e.attention} | FFN {ffn} | gate/up {e.gate_up} | down {e.down} | {reads}"


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

    return f"{name}, {'AVX-512 VNNI' if numba_vnni.usable(int(m.qtype), m.cols) else kernels.vec_dot_name(m.qtype)}"


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


def _prompt_ffn(model) -> str:
    """How a block of tokens computes the FFNs: every neuron, a SiLU model's thresholded block, or each token's
    own predicted neurons (``kernels.batched``) where that applies (``computes_tokens_own_neurons``) and they are
    few enough (``OWN_NEURONS_DENSITY``), else their union: as the layers' plans choose."""
    plans = model.ffn_plans[model.mode]
    if all(plan.choice is Choice.EVERY for plan in plans):
        return "FFN: every neuron"
    if all(plan.choice.thresholded for plan in plans):
        return _thresholded_prompt_ffn(model, plans)
    cpu = [p for layer in model.layers for p in _partitions(layer, every_expert=True) if not p.backend.is_device]
    taking = sum(computes_tokens_own_neurons(p) for p in cpu)
    own = (f"each token's own chosen neurons (kernels.batched) while they are under {OWN_NEURONS_DENSITY:.0%} of "
           "them, else")
    if taking == len(cpu):
        return f"{model.mode.value} FFN: {own} their union"
    if taking == 0:
        return f"{model.mode.value} FFN: the union of the tokens' chosen neurons for every token"
    return f"{model.mode.value} FFN: {own} their union, in {taking} of {len(cpu)} CPU partitions; the union elsewhere"


def _prompt_attention(model) -> str:
    """How a block of tokens attends on the host (``CpuBackend.attention``): in the compiled kernel's tiles where
    ``kernels.attention_takes`` a prompt of the model's heads, else by the NumPy reference; nothing to say where
    every layer's attention is on a device."""
    if all(layer.dense.backend.is_device for layer in model.layers):
        return ""
    compiled = kernels.attention_takes(kernels.ATTENTION_MIN_TOKENS, model.spec.head_dim)
    return f" | attention: {'compiled tiles (numba_attention)' if compiled else REFERENCE}"


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


def _thresholded_prompt_ffn(model, plans) -> str:
    """``thresholded_ffn.ffn``: every neuron's gate, the mask of the rule (or of the gate's choice), then each
    token's kept neurons from up and ``ffn_down_t`` alone where that applies (a CPU partition that
    ``computes_tokens_own_neurons`` given the gate products, no TEAL on the down projection's input) and they
    are few enough, else every neuron's up; a long block of a layer the whole gate chooses for, each token's own up
    products and every down row (``reads_every_down_row``)."""
    mask = "the gate's choice" if model.spec.ffn.sparse else "the thresholds' mask"
    cpu = [(plan, p) for layer, plan in zip(model.layers, plans) for p in _partitions(layer)
           if not p.backend.is_device]
    taking = sum(plan.thresholds.ffn_down is None and computes_tokens_own_neurons(p, gate_given=True)
                 for plan, p in cpu)
    if taking == 0:
        return f"sparse FFN: every neuron's gate and up, then {mask}"
    where = "" if taking == len(cpu) else f" (in {taking} of {len(cpu)} CPU partitions; elsewhere every neuron's up)"
    whole = sum(reads_every_down_row(plan, EVERY_DOWN_ROW_TOKENS) for plan in plans)
    blocks = "" if not whole else (f"; from {EVERY_DOWN_ROW_TOKENS} tokens each token's own up rows and every "
                                   "down row (exact)"
                                   + ("" if whole == len(plans) else f", in {whole} of {len(plans)} layers"))
    return (f"sparse FFN: every neuron's gate, {mask}, then each token's kept neurons from up and down alone "
            f"(kernels.batched) while under {OWN_NEURONS_DENSITY:.0%} of them, else every neuron's up{where}{blocks}")


def _partitions(layer, every_expert: bool = False) -> list:
    """A layer's FFN partitions: its own, or a mixture's first expert's (``every_expert``: all experts')."""
    if not layer.experts:
        return layer.partitions
    return [p for e in (layer.experts if every_expert else layer.experts[:1]) for p in e.partitions]


def _distinct(descriptions) -> str:
    """Descriptions, each once, in order: ``q4_k, ggml vec_dot / q6_k, ggml vec_dot``."""
    return " / ".join(dict.fromkeys(descriptions))
