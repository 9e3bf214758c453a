"""The runtime with its compiled kernels against the NumPy reference, on the same model file: every FFN variant
(dense; predicted sparse; CATS, TEAL, CATS+TEAL thresholds; a mixture of experts, dense and sparse; behind a
neuron cache; split on the emulated device) in every weight type it can be stored in.

Each combination is loaded twice: as the runtime runs it (compiled one-token decoder where it takes the model,
else the general path, whose products go through ``kernels``: numba loops and ggml's vec_dot, interleaved q4_0
matrices), and under ``kernels.use_reference`` (nothing interleaved, every product dequantize + matmul). Both
compute (a) a whole prompt as one block and (b) a short prompt then one token at a time (``stepwise_logits``);
their logits must agree within the weight type's bound (``TOLERANCES``), and sparse variants must compute the
same neurons (``neurons_active``; within ``NEURON_SHARE`` where x is encoded). The predictors are exact ones
made from the model's own gate rows (``_exact_predictor``), so that a choice flipped by x's encoding is of a
neuron whose activation is ~0. Each test id ends with the path its one-token steps take (a spy on
``CompiledDecoder.forward`` and ``RuntimeModel._layer`` counts them), a fact asserted, not derived:

    compiled  dense and dense-powerinfer (every type: f32 f16 q8_0 q4_0, and llama.cpp's file types for the
              dense file, ``gguf_fixtures.LLAMA_FILE_TYPES``: Q4_1 to BF16, Q4_K_M's q6_K attn_v beside q4_K
              q/k included), predicted, gate-chosen (the whole gate chooses: ``runtime.gate_choice``), cats,
              teal, cats+teal, moe-dense, moe-sparse, cache-sparse
    general   cache-dense (the decoder is built, but a dense step under a neuron cache streams every neuron
              through it in chunks: ``CompiledDecoder.usable``), moe-cache (no decoder: an expert's FFN
              behind a neuron cache), split-sparse, split-gate and split-dense (no decoder: layers on the device)
    mixed     split-one-layer (layer 0 on the device, left to the general path; the compiled decoder runs
              layer 1: ``CompiledDecoder.general``)

Combinations that cannot exist are not generated: ``pitools convert`` writes f32, f16, q8_0 and q4_0
(``formats.quantization.OUTTYPES``), and llama.cpp's quantizer, which writes the other types, takes only
dense files (its k-quants also need rows of whole 256-value super-blocks: a model of its own, ``K_QUANT``).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import numpy as np
import pytest
from gguf import MODEL_TENSOR
from gguf_fixtures import LLAMA_FILE_TYPES, TOKENS, llama_quantize, relative_error, save_predictors, stepwise_logits
from hf_models import build
from powerinfer_tools.formats.activation_thresholds import SparsityRule
from powerinfer_tools.formats.constants import tensor_name
from powerinfer_tools.formats.gpu_split import GpuSplit, write_gpu_split
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.formats.model_spec import ffn_units
from powerinfer_tools.formats.predictor_folder import PredictorFolder
from tiny_models import build_tiny_model, write_byte_tokenizer

from powerinfer_tools import kernels
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.kernels.quant import QuantMatrix
from powerinfer_tools.models import load_model_and_tokenizer
from powerinfer_tools.profiling.calibration import CalibrationSettings, calibrate
from powerinfer_tools.profiling.corpus import read_tokens, resolve_source
from powerinfer_tools.runtime.engine import RuntimeModel
from powerinfer_tools.runtime.loader import load_runtime_model

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason=f"compiled kernels unavailable: {kernels.unavailable_reason()}")

PROMPT = 4  # stepwise_logits: TOKENS[:PROMPT] as one block, then each further token alone
ONE_TOKEN_STEPS = len(TOKENS) - PROMPT

CONVERT_TYPES = ("f32", "f16", "q8_0", "q4_0")


@dataclass(frozen=True)
class Tolerance:
    """Bounds on ``relative_error`` (largest difference / largest reference logit) of one weight type: ``logits``
    where every neuron computed is chosen by the file (dense) or by a choice that flips only for neurons whose
    activation is ~0 (the exact predictors below); ``thresholded`` for CATS/TEAL, whose rules keep a value
    when it clears a threshold calibrated where values are dense: a value that x's encoding moves across it is
    as large as the threshold, so a few flipped ones move the logits far more than the encoding itself."""

    logits: float
    thresholded: float | None  # None: no thresholded file of this type exists
    why: str


# Bounds set from measurements (on a CPU without AVX-512 VNNI): the largest error over every variant and
# over block, prompt and one-token rows, with 2-5x margin. These random models amplify a product's ~5e-3 error
# layer by layer, and which values cross a threshold depends on the CPU's kernels (VNNI encodes x its own way), so
# the thresholded bounds were measured over five seeds of the SiLU model (3-7). Measured (logits / thresholded):
# f32 1.1e-6 / 8.9e-7; f16 1.1e-3 / 8.2e-2; q8_0 3.0e-2 / 0.24; q4_0 5.2e-2 / 0.29; Q4_1 6.1e-2; Q4_K_M 8.7e-2;
# Q6_K 4.9e-2; on a CPU with AVX-512 VNNI: Q5_0 3.7e-2, Q5_1 5.9e-2, Q5_K_M 8.3e-2, Q3_K_M 0.10,
# Q2_K 7.5e-2, IQ4_NL 6.1e-2, IQ4_XS 9.5e-2, IQ3_M 9.2e-2, TQ1_0 and TQ2_0 7.6e-2, BF16 1.4e-2. Logits computed
# wrongly differ by ~1 (CATS choosing from a q4_0 gate of mixed-up rows: 0.94).
TOLERANCES = {
    "f32": Tolerance(1e-5, 1e-5, "x stays float32 in every product: only the order of float32 sums differs"),
    "f16": Tolerance(5e-3, 0.25, "x encoded as f16 for f16 weights (~5e-4 relative each); q8_0 predictors"),
    "q8_0": Tolerance(0.1, 0.6, "x encoded as q8_0, the vec_dot_type (~5e-3 relative each), amplified"),
    "q4_0": Tolerance(0.15, 0.6, "x encoded as q8_0, the vec_dot_type (~5e-3 relative each), amplified"),
    "Q4_1": Tolerance(0.2, None, "x encoded as q8_1, the vec_dot_type (~5e-3 relative each), amplified"),
    "Q4_K_M": Tolerance(0.25, None, "x encoded as q8_K, the vec_dot_type of q4_K and q6_K, amplified"),
    "Q6_K": Tolerance(0.15, None, "x encoded as q8_K, the vec_dot_type, amplified"),
    "Q5_0": Tolerance(0.1, None, "x encoded as q8_0, the vec_dot_type, amplified"),
    "Q5_1": Tolerance(0.15, None, "x encoded as q8_1, the vec_dot_type, amplified"),
    "Q5_K_M": Tolerance(0.2, None, "x encoded as q8_K, the vec_dot_type of q5_K and q6_K, amplified"),
    "Q3_K_M": Tolerance(0.25, None, "x encoded as q8_K, the vec_dot_type of q3_K, q4_K and q5_K, amplified"),
    "Q2_K": Tolerance(0.2, None, "x encoded as q8_K, the vec_dot_type of q2_K and q3_K, amplified"),
    "IQ4_NL": Tolerance(0.15, None, "x encoded as q8_0, the vec_dot_type, amplified"),
    "IQ4_XS": Tolerance(0.25, None, "x encoded as q8_K, the vec_dot_type, amplified"),
    "IQ3_M": Tolerance(0.25, None, "x encoded as q8_K, the vec_dot_type of iq3_s and q4_K, amplified"),
    "TQ1_0": Tolerance(0.2, None, "x encoded as q8_K, the vec_dot_type, amplified"),
    "TQ2_0": Tolerance(0.2, None, "x encoded as q8_K, the vec_dot_type, amplified"),
    "BF16": Tolerance(0.04, None, "x rounded to bfloat16, the vec_dot_type (~4e-3 relative each), amplified"),
}
# Where x is encoded, a choice (predictor, CATS) flips when its score lies within the encoding's error of the
# threshold: the two may differ by this share of the choices made (neurons_total; measured: at most 0.5%).
NEURON_SHARE = 0.015


@dataclass(frozen=True)
class Variant:
    kind: str  # the model file (``model_files``)
    mode: FFNMode
    compiled: bool  # its one-token steps take the compiled decoder, as the runtime stands (a fact, not a rule)
    decoder: bool | None = None  # whether it has one (``compiled_decoder()``), when not the same as ``compiled``
    thresholded: bool = False  # CATS/TEAL: Tolerance.thresholded
    load: str = ""  # "cache": a RAM budget of the file less half its FFN; "split": a split on the emulated device
    # (every layer; "split-one": layer 0's only)
    general_layers: int = 0  # of a compiled one-token step: the layers it leaves to the general path
    neuron_choice: str = "auto"  # load_runtime_model's: what chooses a ReLU family's neurons


VARIANTS = {
    "dense": Variant("dense", FFNMode.DENSE, True),
    "dense-powerinfer": Variant("predicted", FFNMode.DENSE, True),
    "predicted": Variant("predicted", FFNMode.SPARSE, True),
    "gate-chosen": Variant("predicted", FFNMode.SPARSE, True, neuron_choice="gate"),
    "cats": Variant("silu-cats", FFNMode.SPARSE, True, thresholded=True),
    "teal": Variant("silu-teal", FFNMode.SPARSE, True, thresholded=True),
    "cats+teal": Variant("silu-cats+teal", FFNMode.SPARSE, True, thresholded=True),
    "moe-dense": Variant("moe-dense", FFNMode.DENSE, True),
    "moe-sparse": Variant("moe-predicted", FFNMode.SPARSE, True),
    "cache-sparse": Variant("predicted", FFNMode.SPARSE, True, load="cache"),
    # built, but a dense step behind a neuron cache streams every neuron through it: CompiledDecoder.usable
    "cache-dense": Variant("predicted", FFNMode.DENSE, False, decoder=True, load="cache"),
    "moe-cache": Variant("moe-predicted", FFNMode.SPARSE, False, load="cache"),  # experts behind caches: none
    "split-sparse": Variant("predicted", FFNMode.SPARSE, False, load="split"),  # layers on a device: none
    "split-dense": Variant("predicted", FFNMode.DENSE, False, load="split"),
    "split-gate": Variant("predicted", FFNMode.SPARSE, False, load="split", neuron_choice="gate"),
    "split-one-layer": Variant("predicted", FFNMode.SPARSE, True, load="split-one", general_layers=1),
}


def _combinations():
    """Every variant in every type its files can be stored in: convert writes f32, f16, q8_0 and q4_0; llama.cpp's
    quantizer, the other types, only dense (GGUF) files."""
    for name, variant in VARIANTS.items():
        types = CONVERT_TYPES + (LLAMA_FILE_TYPES if variant.kind == "dense" else ())
        for weight_type in types:
            path = "general" if not variant.compiled else "mixed" if variant.general_layers else "compiled"
            yield pytest.param(name, weight_type, id=f"{name}-{weight_type}-{path}")


# --- the model files ----------------------------------------------------------------------------------------

TINY = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "hidden_act": "relu", "vocab_size": 260}  # 256 byte tokens (tiny_models.write_byte_tokenizer) and 4 more
MIXTRAL = {**TINY, "hidden_size": 64, "intermediate_size": 96, "num_local_experts": 5, "num_experts_per_tok": 2,
           "sliding_window": None}
K_QUANT = {**TINY, "hidden_size": 256, "intermediate_size": 512}


def _checkpoint(folder, family: str, config: dict, seed: int):
    build(folder, family, seed=seed, config_overrides=config)
    write_byte_tokenizer(folder)
    return folder


def _exact_predictor(gate: np.ndarray, norm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fc1, fc2 whose score for neuron i is ``(gate_i * norm) . x``: its ReGLU gate's sign on the residual x (the
    FFN norm divides by a positive RMS). A choice that x's encoding flips is then one of a neuron whose activation
    is ~0, harmless to the logits (a random predictor's flips move them by up to 20% here)."""
    rows = gate * norm
    d_ff = len(rows)
    return np.concatenate([rows, -rows]), np.concatenate([np.eye(d_ff), -np.eye(d_ff)], axis=1).astype(np.float32)


def _expert_predictors(folder, layers: list[list[tuple[np.ndarray, np.ndarray]]]):
    """A mixture's predictor folder (formats/predictor_folder.py): ``layers[i][e]`` is expert e's (fc1, fc2)."""
    units = ffn_units(len(layers), len(layers[0]))
    entry = {"recall": 1.0, "precision": 1.0, "predicted_density": 0.5, "true_density": 0.5, "bytes": 0}
    meta = {"format": "pitools-predictors", "version": 1, "complete": True, "n_layers": len(layers),
            "experts": len(layers[0]), "ffn_params": 1, "sparse_threshold": 0.0,
            "settings": {"recall": 1.0, "budget": 1.0},
            "layers": [dict(entry, layer=u.layer, expert=u.expert, hidden=layers[u.layer][u.expert][0].shape[0])
                       for u in units]}
    predictors = PredictorFolder(meta)
    for u in units:
        predictors.set_unit(u, *layers[u.layer][u.expert])
    folder.mkdir(parents=True)
    predictors.save(folder)
    return folder


@pytest.fixture(scope="module")
def model_files(sparse_tiny, tmp_path_factory):
    """(kind, weight type) -> a model file, made when first asked for: "dense" (the sparse-firing tiny ReLU LLaMA
    ``sparse_tiny`` converted --dense; llama.cpp's types from ``K_QUANT``'s f32 file), "predicted" (it in the
    PowerInfer layout with exact predictors), "silu-RULE" (a tiny SiLU LLaMA with RULE's thresholds at 40%),
    "moe-dense" and "moe-predicted" (a tiny ReLU Mixtral, its experts with exact predictors)."""
    root = tmp_path_factory.mktemp("decode-parity")

    @functools.cache
    def relu_predictors():
        f32 = open_model_file(path("dense", "f32"))
        layers = [_exact_predictor(f32[tensor_name(MODEL_TENSOR.FFN_GATE, i)].data,
                                   f32[tensor_name(MODEL_TENSOR.FFN_NORM, i)].data) for i in range(2)]
        save_predictors(root / "relu-predictors", layers)
        return root / "relu-predictors"

    @functools.cache
    def moe_predictors():
        f32 = open_model_file(path("moe-dense", "f32"))
        layers = [[_exact_predictor(gate, f32[tensor_name(MODEL_TENSOR.FFN_NORM, i)].data)
                   for gate in f32[tensor_name(MODEL_TENSOR.FFN_GATE_EXP, i)].data] for i in range(2)]
        return _expert_predictors(root / "moe-predictors", layers)

    @functools.cache
    def silu_calibration(rule: SparsityRule):
        folder = root / "silu"
        if not folder.exists():
            build_tiny_model(folder, seed=3, hidden_act="silu")
        model, tokenizer = load_model_and_tokenizer(folder)
        tokens = read_tokens(resolve_source((), None, folder), tokenizer, 1024)
        return folder, calibrate(model, tokens, CalibrationSettings(0.4, rule, seq_len=128), progress=False)

    @functools.cache
    def k_quant_f32():
        folder = _checkpoint(root / "k-quant", "llama", K_QUANT, seed=11)
        return convert(str(folder), root / "k-quant.f32.gguf", outtype="f32", dense=True, progress=False)[0]

    moe_checkpoint = functools.cache(lambda: _checkpoint(root / "moe", "mixtral", MIXTRAL, seed=5))

    @functools.cache
    def path(kind: str, weight_type: str):
        out = root / f"{kind}.{weight_type}.gguf"
        if weight_type in LLAMA_FILE_TYPES:
            return llama_quantize(k_quant_f32(), out, weight_type)
        if kind.startswith("silu-"):
            folder, calibration = silu_calibration(SparsityRule(kind.removeprefix("silu-")))
            return convert(str(folder), out, weight_type, calibration=calibration, progress=False)[0]
        source, options = {  # each made only when asked for
            "dense": lambda: (sparse_tiny, {"dense": True}),
            "predicted": lambda: (sparse_tiny, {"predictors": relu_predictors()}),
            "moe-dense": lambda: (moe_checkpoint(), {"dense": True}),
            "moe-predicted": lambda: (moe_checkpoint(), {"predictors": moe_predictors()}),
        }[kind]()
        return convert(str(source), out, weight_type, progress=False, **options)[0]

    return path


# --- the two runs -------------------------------------------------------------------------------------------


@pytest.fixture
def reference_kernels():
    """A context in which this process keeps to the NumPy reference; the choice is undone on teardown too."""
    assert not kernels.reference_chosen()

    @contextlib.contextmanager
    def chosen():
        kernels.use_reference("tests/test_decode_parity.py: the NumPy reference")
        try:
            yield
        finally:
            kernels.use_reference(None)

    yield chosen
    kernels.use_reference(None)


def _split(path, folder, layers: int):
    """A split placing 30% of the neurons of each of the first ``layers`` layers, and layer 0's dense block, on
    the (emulated) device."""
    split = folder / f"m-{layers}.gpuidx"
    if not split.exists():
        neurons = len(open_model_file(path)[tensor_name(MODEL_TENSOR.FFN_UP, 0)].data)
        rng = np.random.default_rng(0)
        masks = tuple(rng.random(neurons) < (0.3 if i < layers else 0) for i in range(TINY["num_hidden_layers"]))
        write_gpu_split(split, GpuSplit(masks, vram_capacity=10**9, dense_on_gpu=(True, False)))
    return split


def _load(variant: Variant, path, folder) -> RuntimeModel:
    options = {"neuron_choice": variant.neuron_choice}
    if variant.load == "cache":
        ffn = sum(t.nbytes for name, t in open_model_file(path).tensors.items() if ".ffn_" in name)
        options["ram"] = os.path.getsize(path) - ffn // 2
    elif variant.load.startswith("split"):
        layers = 1 if variant.load == "split-one" else TINY["num_hidden_layers"]
        options.update(split=_split(path, folder, layers), device="emulated")
    model = load_runtime_model(path, **options)
    model.mode = variant.mode
    return model


def _logits(model: RuntimeModel) -> tuple[np.ndarray, np.ndarray]:
    """(a) every position of TOKENS as one block; (b) TOKENS[:PROMPT] as a block, then one token at a time."""
    return model.forward(TOKENS, model.new_cache()), stepwise_logits(model, TOKENS, PROMPT)


def _whole_matrices(model: RuntimeModel) -> list:
    """Attention's matrices, every layer's, and the output head."""
    return [m for layer in model.layers for m in (layer.dense.wq, layer.dense.wk, layer.dense.wv, layer.dense.wo)
            ] + [model.output]


@pytest.mark.parametrize("name, weight_type", list(_combinations()))
def test_compiled_kernels_compute_what_the_numpy_reference_does(name, weight_type, model_files, reference_kernels,
                                                                monkeypatch, tmp_path, record_property):
    variant, tolerance = VARIANTS[name], TOLERANCES[weight_type]
    path = model_files(variant.kind, weight_type)
    # numba's: imported once the skip above has passed
    from powerinfer_tools.runtime.compiled_decode import CompiledDecoder

    calls = {"compiled": 0, "general": 0}
    compiled_forward, general_layer = CompiledDecoder.forward, RuntimeModel._layer

    def counted_forward(self, *args, **kwargs):
        calls["compiled"] += 1
        return compiled_forward(self, *args, **kwargs)

    def counted_layer(self, *args, **kwargs):
        calls["general"] += 1
        return general_layer(self, *args, **kwargs)

    monkeypatch.setattr(CompiledDecoder, "forward", counted_forward)
    monkeypatch.setattr(RuntimeModel, "_layer", counted_layer)
    ours = _load(variant, path, tmp_path)
    block, steps = _logits(ours)
    # The one-token steps took the path the test id names; the two blocks (and every general step) ran each layer,
    # a compiled step the layers it leaves to the general path.
    general_steps = 0 if variant.compiled else ONE_TOKEN_STEPS
    assert calls == {"compiled": ONE_TOKEN_STEPS - general_steps,
                     "general": (2 + general_steps) * len(ours.layers) + (ONE_TOKEN_STEPS - general_steps)
                     * variant.general_layers}
    assert sum(path != "compiled decoder" for path in ours.layer_paths()) == (
        variant.general_layers if variant.compiled else len(ours.layers))
    has_decoder = variant.compiled if variant.decoder is None else variant.decoder
    assert (ours.compiled_decoder() is not None) == has_decoder
    record_property("decode_path", ours.decode_path())
    assert (ours.decode_refusal() is None) == variant.compiled  # what run --verbose reports is what ran
    if weight_type == "Q4_K_M":  # what the compiled decoder takes here: q6_K attn_v (layer 1) beside q4_K q/k/o
        assert len({m.qtype for m in _whole_matrices(ours)[:-1]}) == 2

    with reference_kernels():
        reference = _load(variant, path, tmp_path)
        assert reference.compiled_decoder() is None and not kernels.available()
        assert all(isinstance(m, QuantMatrix) for m in _whole_matrices(reference))  # none interleaved
        reference_block, reference_steps = _logits(reference)
    assert calls["compiled"] == ONE_TOKEN_STEPS - general_steps  # none by the reference

    errors = {"block": relative_error(block, reference_block),
              "prompt": relative_error(steps[:PROMPT], reference_steps[:PROMPT]),
              "one token": relative_error(steps[PROMPT:], reference_steps[PROMPT:])}
    record_property("relative_errors", errors)
    bound = tolerance.thresholded if variant.thresholded else tolerance.logits
    assert max(errors.values()) < bound, (errors, tolerance.why)

    ours_active, reference_active, total = (ours.stats.neurons_active, reference.stats.neurons_active,
                                            reference.stats.neurons_total)
    record_property("neurons_active", (ours_active, reference_active, total))
    assert ours.stats.neurons_total == total
    if variant.mode is FFNMode.DENSE or name == "teal":  # TEAL alone computes every neuron (it drops inputs)
        assert ours_active == reference_active == total
    else:
        assert 0 < reference_active < total
        if weight_type == "f32":  # x is not encoded: the same choices
            assert ours_active == reference_active
        else:
            assert abs(ours_active - reference_active) <= NEURON_SHARE * total
    if variant.load == "cache":
        assert ours.ram is not None and ours.stats.cache_misses > 0 and reference.stats.cache_misses > 0
    if variant.load.startswith("split"):
        assert 0 < ours.stats.neurons_on_device < ours_active
