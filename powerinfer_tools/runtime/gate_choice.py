"""Which layers of a ReLU-family model choose their neurons from the whole gate, rather than a predictor.

A ReGLU or dReLU neuron fires exactly when its gate product is positive. Reading every gate row, then the up
and ``ffn_down_t`` rows of the firing neurons only, computes the layer exactly and reads ``g + f * (u + d)``
of its FFN bytes (``g, u, d``: the three matrices' bytes, ``f``: the share that fires); the gate is read whole,
at the interleaved kernels' dense speed. A predictor reads its own bytes and ``p * (g + u + d)`` for the share
``p`` it computes, at a recall below 1. Where firing depends on context, a predictor computes half the neurons
for 95% recall (the realistic synthetic models, docs/lab/benchmarks.md) and the gate both reads less and misses
nothing; where firing is easy to predict (``p`` near ``f``) the predictor reads less.

``auto`` compares the two per layer from what the file records: the share each predictor computed on
held-out profile tokens (``PREDICTOR_COMPUTED_KEY``) and the neurons' firing probabilities. A layer runs its
gate's choice as CATS at threshold 0 on relu (``thresholded_ffn``), which every path already computes.
"""

from __future__ import annotations

import enum

from gguf import MODEL_TENSOR as T

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.activation_thresholds import LayerThresholds
from powerinfer_tools.formats.constants import PREDICTOR_COMPUTED_KEY, PowerInferTensor, predictor_names, tensor_name
from powerinfer_tools.formats.metadata_keys import read_key
from powerinfer_tools.formats.model_check import neuron_frequencies
from powerinfer_tools.formats.model_file import ModelFile
from powerinfer_tools.formats.model_spec import ModelSpec


class NeuronChoice(str, enum.Enum):
    AUTO = "auto"  # per layer, whichever reads fewer bytes (a layer without a predictor: the gate)
    PREDICTOR = "predictor"
    GATE = "gate"


GATE_CHOOSES = LayerThresholds(cats=0.0)  # relu(gate x) > 0: the neurons that fire


def gate_choices(model: ModelFile, spec: ModelSpec, choice: NeuronChoice | str,
                 ram: int | None) -> list[LayerThresholds | None]:
    """Per layer, ``GATE_CHOOSES`` where the whole gate chooses its neurons, None where a predictor does (or
    the model has no such choice: not a gated ReLU family, a mixture, no ``ffn_down_t`` rows to read
    alone, or a RAM budget, whose neuron caches read the rows a predictor names). ``gate`` on a model
    without the choice is an error naming the file."""
    choice = NeuronChoice(choice)
    refusal = _refusal(model, spec, ram)
    if refusal is not None:
        if choice is NeuronChoice.GATE:
            raise PitoolsError(f"{model.path}: the gate cannot choose the neurons to compute: {refusal}")
        return [None] * spec.n_layers
    if choice is NeuronChoice.PREDICTOR:
        return [None] * spec.n_layers
    computed = read_key(model.get, PREDICTOR_COMPUTED_KEY, model.path)
    return [GATE_CHOOSES if choice is NeuronChoice.GATE or _gate_reads_less(model, spec, i, computed) else None
            for i in range(spec.n_layers)]


def _refusal(model: ModelFile, spec: ModelSpec, ram: int | None) -> str | None:
    if not spec.ffn.relu_gated:
        return f"a {spec.ffn.value} FFN, not ReGLU or dReLU, has no exact zeros"
    if spec.moe:
        return "a mixture of experts (each expert's predictor chooses)"
    if ram is not None:
        return "under a RAM budget (--ram) the neuron caches read the rows a predictor names"
    if tensor_name(PowerInferTensor.FFN_DOWN_T, 0) not in model:
        return f"no {tensor_name(PowerInferTensor.FFN_DOWN_T, 0)} rows to read per neuron (a dense file)"
    return None


def _gate_reads_less(model: ModelFile, spec: ModelSpec, layer: int, computed: list | None) -> bool:
    """Whether the gate's choice reads fewer bytes than layer ``layer``'s predictor would, as estimated from the
    file (a layer without a predictor: the gate; one without the shares recorded: its predictor)."""
    fc1, fc2 = predictor_names(layer)
    if fc1 not in model:
        return True
    firing = neuron_frequencies(model, spec, layer)
    if computed is None or len(computed) != spec.n_layers or firing is None:
        return False
    gate, up, down = (model[tensor_name(t, layer)].nbytes for t in (T.FFN_GATE, T.FFN_UP, PowerInferTensor.FFN_DOWN_T))
    by_predictor = model[fc1].nbytes + model[fc2].nbytes + computed[layer] * (gate + up + down)
    return gate + firing.mean() * (up + down) < by_predictor
