"""The names and keys that are ours or PowerInfer's, in one place.

gguf-py's ``gguf.constants`` is the source for everything llama.cpp knows
(``Keys``, ``MODEL_TENSOR``, ``TENSOR_NAMES``); this module holds only what it
lacks: PowerInfer's sparse-layout tensors and keys, its split file's names, and
our own ``pitools.*`` keys. ``tensor_name`` spells either kind of tensor.
"""

from __future__ import annotations

from enum import Enum, auto

from gguf import MODEL_TENSOR, TENSOR_NAMES

# --- PowerInfer's model files ----------------------------------------------------------------------

POWERINFER_MAGIC_BYTES = b"PWRI"  # replaces "GGUF" at the start of a file meant for sparse inference
SPARSE_THRESHOLD_KEY = "powerinfer.sparse_threshold"  # the predictors' firing threshold (float32)


class PowerInferTensor(Enum):
    """Tensors of PowerInfer's layouts that llama.cpp's ``MODEL_TENSOR`` has no member for."""

    FFN_DOWN_T = auto()  # the down projection stored neuron-major, [d_ff, d_model], for the sparse axpy
    PREDICTOR_FC1 = auto()  # a layer's activation predictor: fc1 [hidden, d_model] ...
    PREDICTOR_FC2 = auto()  # ... and fc2 [d_ff, hidden], one output per FFN neuron
    GPU_IDX = auto()  # split file: int32 0/1 per neuron of a layer, 1 = on the GPU
    GPU_BUCKET = auto()  # split file: sorted int32 ids of a layer's GPU neurons
    FFN_BUNDLE = auto()  # ours, the bundled layout: a neuron's gate, up and ffn_down_t rows in one row


POWERINFER_TENSOR_NAMES: dict[PowerInferTensor, str] = {
    PowerInferTensor.FFN_DOWN_T: "blk.{bid}.ffn_down_t",
    PowerInferTensor.PREDICTOR_FC1: "blk.{bid}.fc1",
    PowerInferTensor.PREDICTOR_FC2: "blk.{bid}.fc2",
    PowerInferTensor.GPU_IDX: "blk.{bid}.gpu_idx",
    PowerInferTensor.GPU_BUCKET: "blk.{bid}.gpu_bucket",
    PowerInferTensor.FFN_BUNDLE: "blk.{bid}.ffn_bundle",
}

# --- PowerInfer's split file -----------------------------------------------------------------------

GPU_INDEX_ARCHITECTURE = "generic.gpu_index"
VRAM_CAPACITY_KEY = "split.vram_capacity"

# --- ours (PowerInfer and llama.cpp ignore them) ---------------------------------------------------

# llama.cpp infers the FFN activation from the architecture (SiLU for dense "llama"), which is wrong
# for a ReLU model written in dense mode; our runtime reads the true one here.
FFN_ACTIVATION_KEY = "pitools.ffn_activation"
# In a split file: what the solver placed beyond PowerInfer's masks, and for which model file ...
VRAM_BUDGET_KEY = "pitools.vram_budget"
DENSE_ON_GPU_KEY = "pitools.dense_on_gpu"
OUTPUT_ON_GPU_KEY = "pitools.output_on_gpu"
MODEL_FINGERPRINT_KEY = "pitools.model_fingerprint"
# ... and, for people, how it was solved and what the cost model predicts of it.
OBJECTIVE_KEY = "pitools.objective"
PREDICTED_TOKEN_MS_KEY = "pitools.predicted_token_ms"
GPU_NEURONS_KEY = "pitools.gpu_neurons"
VRAM_USED_KEY = "pitools.vram_used"
N_CTX_KEY = "pitools.n_ctx"
HARDWARE_KEY = "pitools.hardware"
# In a model file with predictors: how well each layer's predictor did on the held-out profile
# pairs when it was trained (float32 arrays, one value per layer), so that a benchmark can state
# the predictability of the model it ran on.
PREDICTOR_RECALL_KEY = "pitools.predictor.recall"
PREDICTOR_PRECISION_KEY = "pitools.predictor.precision"
PREDICTOR_COMPUTED_KEY = "pitools.predictor.computed"  # share of the neurons it selects
# The bundled FFN layout (formats/ffn_bundle.py): which tensors each ``ffn_bundle`` row holds, in order,
# their GGML types, and the row stride in bytes.
FFN_BUNDLE_PARTS_KEY = "pitools.ffn_bundle.parts"
FFN_BUNDLE_TYPES_KEY = "pitools.ffn_bundle.types"
FFN_BUNDLE_STRIDE_KEY = "pitools.ffn_bundle.stride"
# A SiLU model thresholded for training-free sparsity (formats/activation_thresholds.py): its rule (a
# ``SparsityRule`` value), the sparsity it was calibrated for (float32) and, per kind of threshold
# ({name}: a ``LayerThresholds`` field), one threshold per layer (float32 array).
SPARSITY_RULE_KEY = "pitools.sparsity.rule"
SPARSITY_TARGET_KEY = "pitools.sparsity.target"
SPARSITY_THRESHOLD_KEY = "pitools.sparsity.threshold.{name}"
# Thresholds chosen by quality (``convert --max-quality-loss``): the relative perplexity increase allowed (float32),
# the held-out perplexity of the file's thresholds (float32), and the quality-vs-sparsity curve the choice was
# made on: each point's overall sparsity (the first 0: dense) and held-out perplexity (float32 arrays, alike long).
SPARSITY_MAX_LOSS_KEY = "pitools.sparsity.max_quality_loss"
SPARSITY_PERPLEXITY_KEY = "pitools.sparsity.perplexity"
SPARSITY_CURVE_SPARSITY_KEY = "pitools.sparsity.curve.sparsity"
SPARSITY_CURVE_PERPLEXITY_KEY = "pitools.sparsity.curve.perplexity"


# A layer's profiled firing probability per neuron (float32 array, file order), which ``pitools solve`` places
# neurons by; PowerInfer ignores it. An expert's is the probability over the tokens routed to it ...
NEURON_FREQUENCY_KEY = "pitools.blk.{layer}.neuron_frequency"
EXPERT_NEURON_FREQUENCY_KEY = NEURON_FREQUENCY_KEY + ".{expert}"
# ... and a mixture's routing frequency, per expert of the layer, how often that is: the share of profiled
# tokens routed to it (float32 array; they sum to the experts used per token).
EXPERT_FREQUENCY_KEY = "pitools.blk.{layer}.expert_frequency"


def neuron_frequency_key(layer: int, expert: int | None = None) -> str:
    """``NEURON_FREQUENCY_KEY`` of a layer, or ``EXPERT_NEURON_FREQUENCY_KEY`` of one of its experts."""
    if expert is None:
        return NEURON_FREQUENCY_KEY.format(layer=layer)
    return EXPERT_NEURON_FREQUENCY_KEY.format(layer=layer, expert=expert)


def expert_frequency_key(layer: int) -> str:
    return EXPERT_FREQUENCY_KEY.format(layer=layer)


# In a split file with a RAM tier (``pitools solve --ram``): the host memory budget and the bytes of the
# neuron cache planned within it; each layer's RAM-resident neurons under ``ram_neurons_key`` ...
RAM_BUDGET_KEY = "pitools.ram_budget"
CACHE_BYTES_KEY = "pitools.cache_bytes"
# ... and, for people, what the cost model predicts of the RAM and disk tiers.
RAM_NEURONS_KEY = "pitools.ram_neurons"  # RAM-resident neurons per layer
RAM_USED_KEY = "pitools.ram_used"
DISK_BYTES_PER_TOKEN_KEY = "pitools.disk_bytes_per_token"
CACHE_HIT_RATE_KEY = "pitools.cache_hit_rate"


# Our split-file key for the sorted ids of a layer's RAM-resident neurons (int32 array), present only for a
# layer that has some. PowerInfer ignores it.
LAYER_RAM_NEURONS_KEY = "pitools.blk.{layer}.ram_neurons"


def ram_neurons_key(layer: int) -> str:
    return LAYER_RAM_NEURONS_KEY.format(layer=layer)


# --- spelling a tensor's name ----------------------------------------------------------------------

TensorKind = MODEL_TENSOR | PowerInferTensor


def tensor_base_name(tensor: TensorKind, layer: int | None = None, expert: int | None = None) -> str:
    """The GGUF name of ``tensor`` without its ``.weight``/``.bias``: ``blk.3.ffn_up``, ``token_embd``.

    With ``expert``, that expert's own tensor in a mixture's sparse layout: ``blk.3.ffn_up.5``, as
    llama.cpp named Mixtral's per-expert tensors before it stacked them, and ``blk.3.fc1.5``."""
    template = POWERINFER_TENSOR_NAMES[tensor] if isinstance(tensor, PowerInferTensor) else TENSOR_NAMES[tensor]
    if ("{bid}" in template) != (layer is not None):
        raise ValueError(f"{template}: a block tensor needs a layer, a global one takes none")
    return template.format(bid=layer) + ("" if expert is None else f".{expert}")


def block_part(tensor: TensorKind) -> str:
    """A block tensor's name within its block, for messages and suffix tests: ``ffn_down_t``."""
    return tensor_base_name(tensor, 0).split(".", 2)[2]  # blk.0.<part>


def tensor_name(tensor: TensorKind, layer: int | None = None, part: str = "weight", expert: int | None = None) -> str:
    """The GGUF name of one of ``tensor``'s parts: ``tensor_name(MODEL_TENSOR.FFN_UP, 3)`` is
    ``blk.3.ffn_up.weight``, with ``part="bias"`` its bias, with ``expert=5`` ``blk.3.ffn_up.5.weight``."""
    return f"{tensor_base_name(tensor, layer, expert)}.{part}"


def predictor_names(layer: int, expert: int | None = None) -> tuple[str, str]:
    """PowerInfer's predictor tensors of one layer (or one expert of it): fc1 [hidden, n_embd] and fc2
    [n_ff, hidden]."""
    return (tensor_name(PowerInferTensor.PREDICTOR_FC1, layer, expert=expert),
            tensor_name(PowerInferTensor.PREDICTOR_FC2, layer, expert=expert))
