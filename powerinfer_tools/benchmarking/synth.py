"""Synthetic ReLU-family models of real architectures' shapes, for benchmarking the runtime.

``synthesize`` writes a LLaMA-layout ReGLU checkpoint (Mixtral-layout for a mixture-of-experts
shape) with random weights whose FFN neurons fire with planted frequencies, then runs our own pipeline on it: profile, train predictors, convert to a
PowerInfer GGUF, and convert the same weights to a dense GGUF that llama.cpp loads. Generation
quality is irrelevant; what matters is that a token costs what it costs in a real model of that
shape, with a realistic share and skew of active neurons.

The construction. The residual stream is, at every layer, the token's embedding: attention and FFN
outputs are scaled down (``RESIDUAL_STEP``) to about 1% of it, so the input of every FFN is
``rms_norm(embedding)`` up to a small drift, and the profile can be computed from the construction
(``PlantedActivations``) instead of by forward passes, which a 7B model in float32 would not fit in
memory for. Each embedding row has RMS 1 and three orthogonal parts,

    x = m·μ + k1·U s + k2·n

a mean direction ``μ`` shared by all tokens (half the energy), a point ``s`` on the sphere of radius
sqrt(r) of an r-dimensional latent subspace ``U`` (a quarter) and a random direction ``n``
orthogonal to both (a quarter). Gate row i is

    w_i = (c_i / m)·μ + (σ·sqrt(1-ν²) / k1)·U a_i + (σ·ν·sqrt(d') / k2)·z_i

with unit ``a_i`` in the latent space and unit ``z_i`` in the d'-dimensional complement, so
``w_i·x = c_i + σ·(sqrt(1-ν²)·a_i·s + ν·sqrt(d')·z_i·n)``: a per-neuron constant plus a roughly
standard normal term per token. With ``c_i = σ·Φ⁻¹(p_i)`` neuron i fires (gate > 0) on a fraction
p_i of tokens. The p_i follow a power law over neuron rank (``SKEW``) with mean ``density``, the
shape of the profiles measured on real ReLU models (a minority of neurons carries most firings;
``hot80`` in the report). ``ν`` (``noise``) is the share of a pre-activation that lies outside the
latent space: a predictor with 2(r+1) hidden units represents the rest exactly (fc1 = ±[μ; Uᵀ]), so
``rank`` and ``noise`` decide how large the trained predictors get.

Firing so planted is a function of the token id alone. A **context model** (``Planting.context`` > 0;
the "realistic" level) makes it depend on the earlier tokens, as a real model's does: each layer's attention
is planted as previous-token heads (``Geometry.previous_token_attention``: queries and keys read only the
mean direction, so the scores depend on the distance alone, and RoPE puts their peak one token back) whose
output adds the previous token's latent part, at full scale, to the latent space (turned by a random
rotation) and to random directions of the complement. Layer after layer the latent part and the rest grow by
the same factor, so that earlier tokens have written ``context`` of them at the last FFN and the gates of
each layer, planted for the energy its input then has (``Planting.latent_gain``), still fire with the
planted frequencies on average; a gate's part outside the latent space depends on the context too. Such a
model is profiled by forward passes of the reference engine (``LayerByLayer``, one layer's weights in memory
at a time) on Python source text (``text_profile_tokens``) rather than from the construction.

In a mixture-of-experts shape (Mixtral), each expert's gate rows are planted as a dense layer's are,
with firing probabilities of their own, and router row e is

    r_e = (b_e / m)·μ + (ROUTER_SPREAD·sqrt(d') / k2)·z_e

with orthonormal ``z_e`` in the complement, so expert e's logit is ``b_e + ROUTER_SPREAD·ζ_e``, ζ_e
sqrt(d') times a coordinate of the token's random direction ``n``: the choice depends on the token,
and the constants ``b_e`` (fitted by ``planted_routing``) set how often each expert wins. Routing
reads only the part of the embedding that no gate row's constant or latent term sees (and the gates'
own random directions only to order 1/sqrt(d')), so the tokens routed to an expert fire its neurons
with their planted probabilities.

A SiLU (SwiGLU) model (``synthesize_silu``, ``pitools synth --activation silu``) is dense: nothing
fires exactly, and training-free activation sparsity (CATS: skip the neurons whose |SiLU(gate x)| is
below a per-layer threshold; TEAL: skip the weight columns whose input is small) is calibrated on it
instead of planted. So it has no construction to profile from: its weights are only made sane, as a
trained model's are, and the reference engine runs it. Every matrix is N(0, 1/fan_in) (the attention
of the ReLU models at full scale, ``_attention_tensors``), the norms' weights 1, the embeddings N(0, 1)
with a few outlier channels (``outlier_channels``: a constant offset on one channel per 1024, as the
systematic outlier features of real LLMs), so that the residual stream grows only as the square
root of the depth, every FFN input is zero-mean and Gaussian-like, the gate and up pre-activations
standard normal, and the down projection's input, their SiLU-product, heavy-tailed: what the TEAL
paper (Liu et al., ICLR 2025) measures on LLaMA-2/3 and Mistral. ``activation_statistics`` measures
it (the summary's ``statistics``); then ``profiling.calibration.calibrate`` sets the thresholds on
uniform random token ids, and the PowerInfer file carries them, without predictors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import MODEL_TENSOR as T
from safetensors.numpy import save_file
from scipy.special import ndtri

from powerinfer_tools.benchmarking.bench import TEXT as BENCH_TEXT
from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.conversion.convert import DENSE_SUFFIX, POWERINFER_SUFFIX, convert
from powerinfer_tools.conversion.sparsify import SparsifySettings, work_folder
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.fileio import check_writable_output
from powerinfer_tools.formats.activation_thresholds import SparsityRule
from powerinfer_tools.formats.constants import neuron_frequency_key
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.formats.model_spec import FFNKind, FFNUnit, ffn_units
from powerinfer_tools.formats.profile_folder import FiringStats, pair_bytes
from powerinfer_tools.formats.profile_report import hot_fraction, write_report
from powerinfer_tools.formats.quantization import OUTTYPES
from powerinfer_tools.formats.architecture import Architecture
from powerinfer_tools.formats.weight_types import WEIGHT_TYPES
from powerinfer_tools.interfaces import FFNTracer, Tokenizer, tracing
from powerinfer_tools.models import checkpoint_spec, llama, load_model, mixtral
from powerinfer_tools.models.base import CheckpointWeights, load_block, read_weight
from powerinfer_tools.models.layers import FFNHook, FFNTrace, KVCache, activate, gate_activation, rms_norm, route
from powerinfer_tools.predictors.trainer import Candidates, TrainSettings, held_out_pairs, train_predictors
from powerinfer_tools.profiling.calibration import CalibrationSettings, calibrate
from powerinfer_tools.profiling.profiler import Profiler, ProfileSettings
from powerinfer_tools.progress import progress_bar
from powerinfer_tools.units import format_size

# Attention and FFN outputs are this fraction of an N(0, 1/fan_in) initialisation: each layer moves
# the residual stream by ~1% of its norm, so every FFN sees (almost exactly) the token's embedding.
RESIDUAL_STEP = 0.01
# Zipf exponent of firing frequency over neuron rank: 38% of neurons carry 80% of the firings, between
# the 26% (OPT-30B) and 43% (LLaMA(ReGLU)-70B) that PowerInfer's paper reports.
SKEW = 1.0
P_MAX = 0.98  # the hottest neurons fire on (almost) every token, as in real profiles
SIGMA = 1.0  # scale of the gate pre-activations
# Zipf exponent of the share of tokens routed over expert rank. Real Mixtral routing is only mildly
# skewed: its load-balancing loss evens it out in training, and the Mixtral paper's routing analysis
# (arXiv:2401.04088, section 5) finds experts' shares near uniform across domains. 0.3 gives the
# busiest of 8 experts 1.9x the tokens of the idlest (top-2: 36% against 20% of tokens), and every
# expert tokens to train its predictor on.
ROUTING_SKEW = 0.3
# Scale of the token-dependent part of the router logits (standard normal times this): it decides, with
# the constants b_e, how often each expert wins; the output's routing weights hardly matter here.
ROUTER_SPREAD = 1.0
ROUTING_SAMPLES = 20_000  # Monte Carlo tokens that fit the router constants: a share's error ~0.3 points
ROUTER_FIT_STEPS = 60  # fixed-point steps b_e += log(target/share), which leave < 0.1 points of misfit
# The mean direction lives on a few coordinates, as the "massive activations" of real models do. A
# dense one made every hidden unit of the predictors die in their first Adam steps: the update moves
# all weights along the shared direction at once.
MEAN_SUPPORT = 32
PROFILE_WINDOW = 1024  # tokens per profiling pass: bounds the activations held in memory
# Tokens profiled per FFN on average, by default: training pairs enough for "easy" predictors. A mixture's
# expert sees only n_experts_used / n_experts of the tokens; with 4096 tokens in all, a Mixtral expert's
# ~1000 pairs (for 4096 inputs) left its predictor short of 95% recall at hidden 128 after long training,
# with 4096 per expert it reaches it at hidden 12 in a small fraction of that time.
PROFILE_TOKENS_PER_FFN = 4096
# Token ids the bundled tokenizer (every synthetic model's) encodes text to: the bench's prompts and decoded
# tokens are among them, so profiling leaves them out where the vocabulary has room (``profile_tokens``).
TEXT_VOCAB = 4096
HELD_OUT_IDS = 0.2  # of the ids profiling draws from, the share that only the held-out pairs use
# Predictor training for synthetic models: the pipeline's recall target and budget, but a precision
# floor of 65% (the default 50% lets the smallest predictor compute ~1.8x the neurons that fire)
# and ~half the default optimiser steps, which the planted structure does not need: a layer and candidate size
# for TinyLlama's shape trains in a fraction of the default's time.
SYNTH_TRAINING = TrainSettings(min_precision=0.65, epochs=4, min_epoch_steps=150)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SYNTH_JSON = "synth.json"  # in the work folder, written once the checkpoint is complete
ROPE_THETA = 10000.0  # LLaMA's; the previous-token heads of a context model are planted for it
# A context model's previous-token heads: the log-ratio of the attention weight on the previous token to
# that on each of its neighbours (the token itself and the one before the previous): e^-3, ~5% each.
ATTENTION_FOCUS = 3.0
# Where a context model's profiling text comes from: the Python standard library's source files (what the
# bench's text, the bundled model's heldout.txt, is cut from too), less those in that text and the
# folders of installed packages, whose content differs between machines.
STDLIB_SKIPPED = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})
# SiLU models. The residual stream's outlier channels: one per this many of d_model (at least one), each
# a constant offset of OUTLIER_MAGNITUDE (at most sqrt(d_model)/4: a test shape's single channel stays
# modest) in every embedding, whose other entries are standard normal. Real LLMs have a handful of such
# systematic outlier features (LLM.int8(), Dettmers et al. 2022: ~6 in OPT-6.7B's 4096 dimensions).
OUTLIER_CHANNELS_PER = 1024
OUTLIER_MAGNITUDE = 6.0
DEFAULT_TARGET_SPARSITY = 0.5  # CATS's and TEAL's headline level
# Calibration tokens by default: plenty for a threshold's quantile (CATS's: of 2048 x d_ff values per layer)
# and a neuron's frequency (+-1.1 points at 50%). calibrate runs them twice; at the TinyLlama shape (~2.1
# GFLOP a token, logits included) that is ~8.5 TFLOP: minutes on two cores, not hours.
CALIBRATION_TOKENS = 2048
STATISTICS_TOKENS = 256  # one sequence's activations, whose statistics the summary gives


@dataclass(frozen=True)
class Shape:
    """The dimensions of a LLaMA-family architecture; with ``n_experts``, a Mixtral-style mixture of
    ``n_experts`` FFNs of width ``d_ff`` per layer, ``n_experts_used`` of them per token."""

    d_model: int
    d_ff: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int = 32000
    context: int = 2048
    rms_norm_eps: float = 1e-5
    n_experts: int = 0
    n_experts_used: int = 0

    @property
    def table(self) -> Architecture:
        return mixtral.ARCHITECTURE if self.n_experts else llama.ARCHITECTURE

    @property
    def n_params(self) -> int:
        head_dim = self.d_model // self.n_heads
        attention = 2 * self.d_model * self.d_model + 2 * self.d_model * self.n_kv_heads * head_dim
        ffn = max(self.n_experts, 1) * 3 * self.d_model * self.d_ff + self.n_experts * self.d_model  # and routers
        return self.n_layers * (attention + ffn) + 2 * self.vocab_size * self.d_model


SHAPES = {
    "tinyllama-1.1b": Shape(2048, 5632, 22, 32, 4),
    "llama-7b": Shape(4096, 11008, 32, 32, 32, context=4096),
    "llama-13b": Shape(5120, 13824, 40, 40, 40, context=4096),
    # 46.7B parameters, 93 GB as f16 with all 32 layers: --layers makes one of the same widths that fits.
    "mixtral-8x7b": Shape(4096, 14336, 32, 32, 8, context=32768, n_experts=8, n_experts_used=2),
    # For tests: the smallest shapes the bundled tokenizer (4096 tokens) fits.
    "test-tiny": Shape(64, 256, 2, 4, 2, vocab_size=4096, context=256),
    "test-tiny-moe": Shape(64, 256, 2, 4, 2, vocab_size=4096, context=256, n_experts=4, n_experts_used=2),
}


class Seeded:
    """Settings with a ``seed``, from which every random stream of a synthesis is drawn."""

    seed: int

    def rng(self, *stream: int) -> np.random.Generator:
        """The generator of one stream: 0 the geometry, 1 the embeddings and output, (2, layer) a layer's
        weights (2, layer, expert) an expert's, 3 the profiled or calibration tokens, 4-5 Monte Carlo."""
        return np.random.default_rng([self.seed, *stream])

    def uniform_tokens(self, vocab_size: int, n: int) -> np.ndarray:
        """``n`` uniform random token ids: what a synthetic SiLU model is calibrated on."""
        return self.rng(3).integers(0, vocab_size, n)

    def profile_tokens(self, vocab_size: int, n: int, held_out: int) -> np.ndarray:
        """``n`` uniform random token ids to profile a synthetic ReLU model on, from two disjoint pools: the
        last ``held_out`` (the pairs the trainer holds out) are ids that none of the others is, so that the
        recall it tunes and reports is on tokens no predictor trained on. Where the vocabulary has room,
        both pools leave out the ids text encodes to (``TEXT_VOCAB``): the bench's text is new to them too."""
        first = TEXT_VOCAB if vocab_size >= 2 * TEXT_VOCAB else 0
        split = first + round((vocab_size - first) * (1 - HELD_OUT_IDS))
        rng = self.rng(3)
        return np.concatenate([rng.integers(first, split, n - held_out), rng.integers(split, vocab_size, held_out)])


def text_profile_tokens(tokenizer: Tokenizer, n: int, held_out: int) -> np.ndarray:
    """``n`` tokens of Python source to profile a context model on, each file's followed by the end-of-text
    token: the first ``n - held_out`` from the standard library's files in path order, the last ``held_out``
    (the pairs the trainer holds out) from its files in reverse order, so that no file gives tokens to both,
    and neither holds a file of the bench's text (``bench.TEXT``)."""
    files = _stdlib_sources()
    first, used = _encoded(tokenizer, files, n - held_out)
    last, used_back = _encoded(tokenizer, files[::-1], held_out)
    if used + used_back > len(files):
        raise _too_little_text(files, n)
    return np.concatenate([first, last])


def _too_little_text(files: list[Path], n: int) -> PitoolsError:
    return PitoolsError(f"the Python standard library's source here ({len(files)} files) is too short for {n} "
                        "profile tokens; give fewer --profile-tokens")


def _stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files, in path order, outside ``STDLIB_SKIPPED`` folders."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not STDLIB_SKIPPED.intersection(p.relative_to(root).parts))


def _encoded(tokenizer: Tokenizer, files: list[Path], n: int) -> tuple[np.ndarray, int]:
    """The first ``n`` tokens of ``files`` (less those in the bench's text) and how many files gave them."""
    bench_text = BENCH_TEXT.read_text(encoding="utf-8")
    tokens: list[int] = []
    for used, path in enumerate(files, 1):
        if len(tokens) >= n:
            return np.asarray(tokens[:n], dtype=np.int64), used - 1
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip() and text not in bench_text:
            tokens += tokenizer.encode(text, add_bos=False) + [tokenizer.eos_token_id]
    if len(tokens) < n:
        raise _too_little_text(files, n)
    return np.asarray(tokens[:n], dtype=np.int64), len(files)


@dataclass(frozen=True)
class Planting(Seeded):
    density: float = 0.1  # mean fraction of FFN neurons that fire per token
    rank: int = 4  # latent dimensions that decide which neurons fire
    noise: float = 0.15  # share (std) of a gate pre-activation outside the latent space
    seed: int = 0
    routing_skew: float = ROUTING_SKEW  # a mixture's: Zipf exponent of the share of tokens over experts
    # Share of the last FFN's input (of its latent part and of the rest) that earlier tokens wrote there, through
    # planted previous-token heads (``Geometry.previous_token_attention``); 0: every FFN sees its token's embedding.
    context: float = 0.0

    def __post_init__(self):
        if not 0 < self.density < P_MAX:
            raise PitoolsError(f"--density must be in (0, {P_MAX}), got {self.density}")
        if not 0 <= self.noise < 1:
            raise PitoolsError(f"noise must be in [0, 1), got {self.noise}")
        if not self.routing_skew >= 0:
            raise PitoolsError(f"--routing-skew must be at least 0, got {self.routing_skew}")
        if not 0 <= self.context < 1:
            raise PitoolsError(f"--context must be in [0, 1), got {self.context}")

    def latent_gain(self, layer: int, n_layers: int) -> float:
        """The energy of the latent part (and of the rest) of the stream entering layer ``layer``'s FFN, over an
        embedding's: each layer's attention adds the previous token's latent part, times ``attention_step``,
        to both, so their energies grow by 1 + step² a layer, to 1 / (1 - context) at the last FFN, where
        earlier tokens wrote ``context`` of them. Layer -1: the embedding."""
        return (1 - self.context) ** (-(layer + 1) / n_layers)

    def attention_step(self, n_layers: int) -> float:
        """What each layer's attention adds of the previous token's latent part (its size, before rotation)."""
        return float(np.sqrt(self.latent_gain(0, n_layers) - 1))


@dataclass(frozen=True)
class SiluSettings(Seeded):
    """A SiLU model's: the sparsity its calibration targets, the rule that skips (CATS, TEAL or both), the seed."""

    target_sparsity: float = DEFAULT_TARGET_SPARSITY
    rule: SparsityRule = SparsityRule.CATS
    seed: int = 0

    def __post_init__(self):
        if not 0 < self.target_sparsity < 1:
            raise PitoolsError(f"--target-sparsity must be in (0, 1), got {self.target_sparsity}")
        object.__setattr__(self, "rule", SparsityRule(self.rule))


@dataclass(frozen=True)
class Hardness:
    """How hard a synthetic model's firing is to predict. The rank (``rank_share`` of d_model, at
    least 4) sets the size a predictor needs: 2(rank+1) hidden units see the latent part exactly;
    ``noise`` sets what even such a predictor cannot see, so the share of neurons it must compute to
    reach a recall target (``ideal_selection``); ``min_precision`` is the training floor that suits
    that noise; ``context`` how much of the FFN inputs earlier tokens write (``Planting.context``)."""

    rank_share: float
    noise: float
    min_precision: float
    context: float = 0.0

    def planting(self, shape: Shape, density: float, seed: int) -> Planting:
        return Planting(density=density, rank=max(4, round(self.rank_share * shape.d_model)), noise=self.noise,
                        seed=seed, context=self.context)


# The levels `pitools synth --hardness` offers. Published predictors are large: Deja Vu trains a
# hidden size of 1000 for OPT-66B/175B (d_model 9216/12288: 8-11%) on 400,000 tokens per layer
# (FMInference/DejaVu sparse_predictor/main_mlp.py), and PowerInfer's released ReluLLaMA predictors
# are hundreds to a thousand wide at d_model 4096. "hard" asks for predictors of ~1/8 of d_model
# (rank d_model/16) and, with noise 0.35, lets even an ideal predictor of that size reach 95% recall
# only by computing ~1.5x the neurons that fire; "easy" is the rank-4 model earlier benchmarks ran on.
#
# "realistic" is calibrated on a real model, not chosen. On SmolLM2-135M-Instruct (SwiGLU: its 10%
# of neurons of largest |activation| standing for firing), our trainer's predictors of hidden 128, 10% of
# the FFN weights (more than PowerInfer's 6-9%), compute REAL_MODEL_COMPUTED of the neurons, mean of three
# layers, at 95% recall on held-out text (`python examples/predictability_curve.py`; the curve is in
# docs/lab/benchmarks.md). At noise 0.85 even an ideal predictor of the latent space must compute as much
# (49.7% at the TinyLlama and 7B widths: tests/test_synth.py), so a trained one computes more. Its
# precision floor sits just below that ideal's 19%, so the search climbs to predictors near the ideal's
# 2(rank+1) units, PowerInfer's size: at 15% a TinyLlama-width layer took hidden 96 (2% of its FFN
# weights) computing 62% of its neurons.
#
# Its firing depends on context as SmolLM2's does. Over the ids that occur 4 times or more in 8192 tokens of
# held-out text, 41% of a SmolLM2 neuron's gate pre-activation varies between occurrences of the same id (its
# variance within ids over its total, mean over neurons and its 30 layers: 0.03 at layer 0, ~0.3 at layers
# 2-10, ~0.5 from layer 13; `python examples/context_dependence.py`). A context model's share at layer l is
# at most what earlier tokens wrote there, 1 - (1 - context)^((l+1)/L), less on text, whose earlier tokens
# go with the id; the same measurement of the TinyLlama shape's 22 layers gives a mean of 0.33 at context
# 0.68, 0.43 at 0.82 and 0.417 at 0.8 (`--synth tinyllama-1.1b`), "realistic"'s context.
REAL_MODEL_COMPUTED = 0.458
HARDNESS = {
    "easy": Hardness(1 / 512, 0.15, 0.65),
    "medium": Hardness(1 / 64, 0.25, 0.6),
    "hard": Hardness(1 / 16, 0.35, 0.5),
    "realistic": Hardness(1 / 16, 0.85, 0.17, context=0.8),
}


def ideal_selection(planting: Planting, shape: Shape, recall: float = 0.95, tokens: int = 256) -> dict:
    """What the best predictor that sees a model's latent part exactly must compute to reach
    ``recall``: the share of neurons it selects and its precision (Monte Carlo over ``tokens``).

    Neuron i fires when ``c_i + sqrt(1-noise²)·u + noise·v > 0``, u the latent part (visible to a
    predictor of 2(rank+1) units) and v the rest, each sqrt(n) times one coordinate of a uniform unit
    vector in n dimensions (n = rank, and the complement's dimension), as ``Geometry`` builds them;
    the ideal rule ranks (token, neuron) pairs by their probability of firing given u.

    A mixture's expert fires so on the tokens routed to it (its routing reads none of u and v): the
    first expert of the first layer stands for them all."""
    rng = planting.rng(4)
    c = ndtri(firing_frequencies(shape.d_ff, planting.density, _ffn_rng(planting, ffn_units(1, shape.n_experts)[0])))
    u = _sphere_coordinates(planting.rank, 1, (tokens, shape.d_ff), rng)[..., 0]
    v = _sphere_coordinates(shape.d_model - planting.rank - 1, 1, (tokens, shape.d_ff), rng)[..., 0]
    visible = c + np.sqrt(1 - planting.noise**2) * u
    fires = (visible + planting.noise * v > 0).ravel()
    found = np.cumsum(fires[np.argsort(-visible.ravel(), kind="stable")])  # same noise for all: rank by u's part
    selected = int(np.searchsorted(found, recall * found[-1])) + 1
    return {"computed": selected / fires.size, "precision": float(found[selected - 1]) / selected}


def _sphere_coordinates(n: int, k: int, size: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """sqrt(n) times the first ``k`` coordinates of uniform unit vectors in n dimensions, ``size + (k,)``:
    a standard normal vector's first k coordinates over its norm, whose square beyond them is
    chi-squared with n-k degrees of freedom. Unit variance each, bounded by sqrt(n), normal as n grows."""
    w = rng.standard_normal((*size, k))
    rest = rng.chisquare(n - k, (*size, 1)) if n > k else 0.0
    return np.sqrt(n) * w / np.sqrt((w * w).sum(axis=-1, keepdims=True) + rest)


def _capped_power_law(n: int, mean: float, exponent: float, cap: float) -> np.ndarray:
    """``min(cap, a·rank^-exponent)`` over ranks 1..n, descending, with ``a`` such that the mean is ``mean``."""
    power = np.arange(1, n + 1, dtype=np.float64) ** -exponent
    lo, hi = 0.0, cap / power[-1]  # mean(min(cap, a·power)) grows with a from 0 to cap
    for _ in range(100):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if np.minimum(cap, a * power).mean() < mean else (lo, a)
    return np.minimum(cap, lo * power)


def firing_frequencies(d_ff: int, density: float, rng: np.random.Generator) -> np.ndarray:
    """Per-neuron firing probabilities, ``min(P_MAX, a·rank^-SKEW)`` with mean ``density``, shuffled."""
    return rng.permutation(_capped_power_law(d_ff, density, SKEW, P_MAX))


def _ffn_rng(planting: Planting, unit: FFNUnit) -> np.random.Generator:
    """The random stream of an FFN's weights, which draws its firing probabilities first: a layer's (its
    attention weights follow in a dense layer) or an expert's own."""
    return planting.rng(2, unit.layer, *(() if unit.expert is None else (unit.expert,)))


def planted_routing(shape: Shape, planting: Planting, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """A mixture layer's router constants ``b_e`` and the share of tokens each expert then receives.

    The target shares follow a Zipf law over experts (``planting.routing_skew``; summing to
    ``n_experts_used``, in a random order per layer); ``b`` is fitted to them on Monte Carlo logits
    ``b + ROUTER_SPREAD·ζ``, ζ distributed as ``Geometry.router`` makes it, and the shares returned
    are those the fitted constants realise on these samples."""
    n, k = shape.n_experts, shape.n_experts_used
    rng = planting.rng(5, layer)
    target = rng.permutation(_capped_power_law(n, k / n, planting.routing_skew, 1.0))
    zeta = ROUTER_SPREAD * _sphere_coordinates(shape.d_model - planting.rank - 1, n, (ROUTING_SAMPLES,), rng)
    bias = np.log(target)
    for _ in range(ROUTER_FIT_STEPS):
        share = _routed_share(bias + zeta, k)
        bias += np.log(target / np.maximum(share, 1 / ROUTING_SAMPLES))
    return bias, _routed_share(bias + zeta, k)


def _routed_share(logits: np.ndarray, k: int) -> np.ndarray:
    """The share of tokens (rows of ``logits``) that Mixtral's top-``k`` routing sends to each expert."""
    experts, _ = route(logits, k)
    return np.bincount(experts.ravel(), minlength=logits.shape[1]) / len(logits)


@dataclass(frozen=True)
class Geometry:
    """The residual stream's layout: a mean direction and a latent subspace, orthonormal."""

    mean: np.ndarray  # [d] unit
    latent: np.ndarray  # [d, r] orthonormal columns, orthogonal to mean

    @classmethod
    def random(cls, d_model: int, rank: int, rng: np.random.Generator) -> Geometry:
        mean = np.zeros(d_model)
        support = rng.choice(d_model, min(MEAN_SUPPORT, d_model), replace=False)
        mean[support] = rng.choice([-1.0, 1.0], len(support)) / np.sqrt(len(support))
        q, _ = np.linalg.qr(np.column_stack([mean, rng.standard_normal((d_model, rank))]))
        return cls(mean, q[:, 1:])

    @property
    def d_model(self) -> int:
        return len(self.mean)

    @property
    def rank(self) -> int:
        return self.latent.shape[1]

    @property
    def complement(self) -> int:
        """Dimensions orthogonal to the mean and the latent space: where an embedding's random part lies."""
        return self.d_model - self.rank - 1

    # Norms of the three parts of an embedding row: energies d/2, d/4, d/4, so its RMS is 1.
    @property
    def m(self) -> float:
        return np.sqrt(self.d_model / 2)

    @property
    def k1(self) -> float:
        return np.sqrt(self.d_model / 4 / self.rank)

    @property
    def k2(self) -> float:
        return np.sqrt(self.d_model / 4)

    def orthogonal_units(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` random unit rows orthogonal to the mean and the latent space."""
        v = rng.standard_normal((n, self.d_model))
        v -= np.outer(v @ self.mean, self.mean) + (v @ self.latent) @ self.latent.T
        return v / np.linalg.norm(v, axis=1, keepdims=True)

    def embeddings(self, n: int, rng: np.random.Generator) -> np.ndarray:
        s = rng.standard_normal((n, self.rank))
        s *= np.sqrt(self.rank) / np.linalg.norm(s, axis=1, keepdims=True)
        return self.m * self.mean + self.k1 * s @ self.latent.T + self.k2 * self.orthogonal_units(n, rng)

    @staticmethod
    def rms(gain: float) -> float:
        """The RMS of a stream whose latent part and rest have ``gain`` times an embedding's energy (an
        embedding's RMS is 1: energies d/2, d/4 and d/4), which a layer's norm divides it by."""
        return float(np.sqrt((1 + gain) / 2))

    def gate(self, p: np.ndarray, noise: float, rng: np.random.Generator, gain: float = 1.0) -> np.ndarray:
        """Gate rows that fire with probabilities ``p`` on streams of this geometry whose latent part and rest
        have ``gain`` times an embedding's energy (``Planting.latent_gain``; 1: the embeddings themselves)."""
        a = rng.standard_normal((len(p), self.rank))
        a /= np.linalg.norm(a, axis=1, keepdims=True)
        c = SIGMA * ndtri(p)
        return self.rms(gain) * (
            np.outer(c / self.m, self.mean)
            + (SIGMA * np.sqrt(1 - noise**2) / (self.k1 * np.sqrt(gain))) * a @ self.latent.T
            + (SIGMA * noise * np.sqrt(self.complement) / (self.k2 * np.sqrt(gain)))
            * self.orthogonal_units(len(p), rng))

    def previous_token_attention(self, shape: Shape, step: float, gain: float,
                                 rng: np.random.Generator) -> tuple[np.ndarray, ...]:
        """Attention weights (q, k, v, o) that write the previous token's latent part, times ``step``, into
        the stream twice: turned by a random rotation of the latent space, and into random directions of
        the rest (so a gate's part outside the latent space depends on the context too): a layer's context.
        ``gain``: the energy of the entering stream's parts, over an embedding's.

        Queries and keys read only the mean direction, which every token shares, so every head's scores
        depend on the distance alone: after RoPE, rotary pair p of the query and of the key δ tokens back
        meet at A²·cos((δ-1)θ_p) (the key is the query turned by one position), largest at δ = 1, and A sets
        the weight on the previous token ``ATTENTION_FOCUS`` (log) above that on its neighbours. Values are the
        latent coordinates, laid along the KV heads; the output reads the first query head of each KV head."""
        d, r, head_dim = self.d_model, self.rank, shape.d_model // shape.n_heads
        kv_width, group = shape.n_kv_heads * head_dim, shape.n_heads // shape.n_kv_heads
        if r > kv_width:
            raise PitoolsError(f"--context needs a latent rank of at most {kv_width} (the KV heads' width) at this "
                               f"shape, not {r}")
        theta = ROPE_THETA ** -(np.arange(0, head_dim, 2) / head_dim)
        amplitude = np.sqrt(ATTENTION_FOCUS * np.sqrt(head_dim) / np.sum(1 - np.cos(theta)))
        query = amplitude * np.concatenate([np.ones_like(theta), np.zeros_like(theta)])  # rotate-half pairs
        key = amplitude * np.concatenate([np.cos(theta), np.sin(theta)])
        read_mean = self.mean * (self.rms(gain) / self.m)  # a normed stream's mean coordinate is m / RMS
        wq = np.tile(np.outer(query, read_mean), (shape.n_heads, 1))
        wk = np.tile(np.outer(key, read_mean), (shape.n_kv_heads, 1))
        wv = np.zeros((kv_width, d))
        wv[:r] = self.latent.T
        rotation, _ = np.linalg.qr(rng.standard_normal((r, r)))
        elsewhere, _ = np.linalg.qr(self.orthogonal_units(r, rng).T)
        wo = np.zeros((d, shape.n_heads * head_dim))
        coordinate = np.arange(r)
        # The weights' spread over the neighbours shrinks what a step adds (the sum of independent latent parts
        # so weighted has sum(w²) of one's energy): the step is scaled up to make up for it.
        spread = np.sqrt(np.sum(_distance_weights(query, key, theta, head_dim) ** 2))
        wo[:, coordinate // head_dim * group * head_dim + coordinate % head_dim] = (
            step / spread * self.rms(gain) * (self.latent @ rotation + elsewhere))
        return wq, wk, wv, wo

    def router(self, bias: np.ndarray, rng: np.random.Generator, gain: float = 1.0) -> np.ndarray:
        """Router rows whose logits on embeddings of this geometry (streams of ``gain``: see ``gate``) are
        ``bias + ROUTER_SPREAD·ζ``: ζ holds
        coordinates of the token's random part ``n`` (times sqrt(d')) along orthonormal directions of the
        complement. Routing so reads nothing of the mean and latent parts and, in high dimension, next
        to nothing of the gate rows' own random directions: it leaves the experts' firing as planted."""
        basis, _ = np.linalg.qr(self.orthogonal_units(len(bias), rng).T)  # orthonormal: uncorrelated ζ_e
        return self.rms(gain) * (np.outer(bias / self.m, self.mean)
                                 + (ROUTER_SPREAD * np.sqrt(self.complement) / (self.k2 * np.sqrt(gain))) * basis.T)


def _distance_weights(query: np.ndarray, key: np.ndarray, theta: np.ndarray, head_dim: int,
                      positions: int = 64) -> np.ndarray:
    """The attention weights of a constant query on constant keys 0 .. ``positions`` - 1 tokens back, after
    RoPE (rotate-half pairs, angles ``theta``), far into a sequence."""
    half = len(theta)
    angles = np.outer(np.arange(positions), theta)  # the key's turn relative to the query's
    q_pairs, k_pairs = query[:half] + 1j * query[half:], key[:half] + 1j * key[half:]
    scores = np.real(q_pairs * np.conj(k_pairs * np.exp(-1j * angles))).sum(axis=1) / np.sqrt(head_dim)
    weights = np.exp(scores - scores.max())
    return weights / weights.sum()


def _config(shape: Shape, activation: str = "relu") -> dict:
    mixture = {"num_local_experts": shape.n_experts, "num_experts_per_tok": shape.n_experts_used,
               "sliding_window": None}  # Mixtral's own config has none either
    return {
        "architectures": [shape.table.hf_classes[0]],
        "model_type": shape.table.model_types[0],
        **(mixture if shape.n_experts else {}),
        "hidden_act": activation,
        "hidden_size": shape.d_model,
        "intermediate_size": shape.d_ff,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "max_position_embeddings": shape.context,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": ROPE_THETA,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": 0,  # the bundled tokenizer's <|endoftext|>
        "eos_token_id": 0,
        "torch_dtype": "float16",
    }


def _resume_work(work: Path, identity: dict, force: bool) -> bool:
    """Whether ``work`` holds the complete checkpoint of the synthesis ``identity`` (to resume from)."""
    stamp = work / SYNTH_JSON
    if force or not stamp.is_file():
        for part in ("checkpoint", "profile", "predictors"):  # only ours: --work may be any folder
            shutil.rmtree(work / part, ignore_errors=True)
        stamp.unlink(missing_ok=True)
        return False
    previous = json.loads(stamp.read_text())
    if previous != identity:
        changed = ", ".join(k for k in identity if previous.get(k) != identity[k])
        raise PitoolsError(f"{work} holds an interrupted synthesis with other settings (differs: {changed}); "
                           "use --force to start over, or another --work folder")
    return True


def planted_frequencies(shape: Shape, planting: Planting) -> np.ndarray:
    """The firing probabilities ``write_checkpoint`` plants, ``[FFN units, d_ff]``, without the weights."""
    return np.stack([firing_frequencies(shape.d_ff, planting.density, _ffn_rng(planting, unit))
                     for unit in ffn_units(shape.n_layers, shape.n_experts)])


def write_checkpoint(folder: Path, shape: Shape, planting: Planting) -> np.ndarray:
    """A Hugging Face checkpoint (f16 safetensors, a shard per layer and one per expert) with the bundled
    tokenizer, padded to the shape's vocabulary; returns the planted firing probabilities ``[FFN units,
    d_ff]``: per layer, or per layer and expert (``formats.model_spec.ffn_units`` order)."""
    _start_checkpoint(folder, shape, "relu")
    geometry = Geometry.random(shape.d_model, planting.rank, planting.rng(0))
    rng = planting.rng(1)
    _write_embeddings(folder, shape, geometry.embeddings(shape.vocab_size, rng), rng)
    return np.stack([p for i in range(shape.n_layers) for p in _write_layer(folder, shape, planting, geometry, i)])


def write_silu_checkpoint(folder: Path, shape: Shape, settings: SiluSettings) -> None:
    """A SiLU LLaMA checkpoint of a dense ``shape``, laid out as ``write_checkpoint``'s, with sane random
    weights: every matrix N(0, 1/fan_in), the norms' weights 1, the embeddings N(0, 1) plus the constant
    offsets of ``outlier_channels``."""
    _start_checkpoint(folder, shape, "silu")
    rng = settings.rng(1)
    embeddings = rng.standard_normal((shape.vocab_size, shape.d_model), dtype=np.float32)
    channels, offsets = outlier_channels(shape.d_model, rng)
    embeddings[:, channels] += offsets
    _write_embeddings(folder, shape, embeddings, rng)
    for layer in range(shape.n_layers):
        rng = settings.rng(2, layer)
        gate, up, down = _ffn_names(FFNUnit(layer))
        tensors = _attention_tensors(shape, layer, rng) | {
            gate: _normal(shape.d_ff, shape.d_model, rng), up: _normal(shape.d_ff, shape.d_model, rng),
            down: _normal(shape.d_model, shape.d_ff, rng)}
        save_file(tensors, str(folder / f"model-layer{layer:03d}.safetensors"))


def outlier_channels(d_model: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A SiLU model's outlier channels of the residual stream and their constant offsets (random signs):
    one per ``OUTLIER_CHANNELS_PER`` dimensions, at least one, of ``OUTLIER_MAGNITUDE`` (at most sqrt(d_model)/4)."""
    n = outlier_count(d_model)
    magnitude = min(OUTLIER_MAGNITUDE, np.sqrt(d_model) / 4)
    return rng.choice(d_model, n, replace=False), magnitude * rng.choice([-1.0, 1.0], n)


def outlier_count(d_model: int) -> int:
    return max(1, d_model // OUTLIER_CHANNELS_PER)


def _start_checkpoint(folder: Path, shape: Shape, activation: str) -> None:
    """A checkpoint folder's config.json and the bundled tokenizer's files."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(_config(shape, activation), indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(BUNDLED_MODEL / name, folder / name)


def _write_embeddings(folder: Path, shape: Shape, embeddings: np.ndarray, rng: np.random.Generator) -> None:
    """The shard of the token embeddings (as given), the output norm (ones) and a random output matrix."""
    hf = shape.table.hf_name
    save_file({hf(T.TOKEN_EMBD): embeddings.astype(np.float16),
               hf(T.OUTPUT_NORM): np.ones(shape.d_model, dtype=np.float16),
               hf(T.OUTPUT): _normal(shape.vocab_size, shape.d_model, rng)},
              str(folder / "model-embeddings.safetensors"))


def _normal(rows: int, cols: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """An f16 ``[rows, cols]`` matrix of N(0, scale²/cols) entries: ``scale`` times the usual initialisation."""
    return (rng.standard_normal((rows, cols), dtype=np.float32) * (scale / np.sqrt(cols))).astype(np.float16)


def _write_layer(folder: Path, shape: Shape, planting: Planting, geometry: Geometry, layer: int) -> list[np.ndarray]:
    """Write a layer's shard and, in a mixture, a shard per expert (which holds one expert's weights in
    memory at a time); return the layer's FFNs' planted firing probabilities."""
    rng = planting.rng(2, layer)
    units = [FFNUnit(layer, e) for e in range(shape.n_experts)] or [FFNUnit(layer)]
    streams = [_ffn_rng(planting, unit) for unit in units] if shape.n_experts else [rng]
    frequencies = [firing_frequencies(shape.d_ff, planting.density, stream) for stream in streams]
    tensors, hf = _attention_tensors(shape, layer, rng, RESIDUAL_STEP), shape.table.hf_name
    if planting.context:  # the random attention above is replaced, its draws kept: the FFNs stay the same
        planted = geometry.previous_token_attention(shape, planting.attention_step(shape.n_layers),
                                                    planting.latent_gain(layer - 1, shape.n_layers),
                                                    planting.rng(6, layer))
        names = [hf(t, layer) for t in (T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT)]
        tensors |= {name: w.astype(np.float16) for name, w in zip(names, planted)}
    gain = planting.latent_gain(layer, shape.n_layers)
    if shape.n_experts:
        bias, _ = planted_routing(shape, planting, layer)
        tensors[hf(T.FFN_GATE_INP, layer)] = geometry.router(bias, rng, gain).astype(np.float16)
        for unit, p, stream in zip(units, frequencies, streams):
            save_file(_ffn_tensors(geometry, unit, p, planting.noise, stream, gain),
                      str(folder / f"model-layer{layer:03d}-expert{unit.expert:03d}.safetensors"))
    else:
        tensors |= _ffn_tensors(geometry, units[0], frequencies[0], planting.noise, rng, gain)
    save_file(tensors, str(folder / f"model-layer{layer:03d}.safetensors"))
    return frequencies


def _attention_tensors(shape: Shape, layer: int, rng: np.random.Generator, scale: float = 1.0) -> dict[str, np.ndarray]:
    """A layer's norms (weights 1) and random attention, its output projection ``scale`` of the usual scale."""
    d, head_dim, hf = shape.d_model, shape.d_model // shape.n_heads, shape.table.hf_name
    ones, kv = np.ones(d, dtype=np.float16), shape.n_kv_heads * head_dim
    return {hf(T.ATTN_NORM, layer): ones, hf(T.ATTN_Q, layer): _normal(d, d, rng),
            hf(T.ATTN_K, layer): _normal(kv, d, rng), hf(T.ATTN_V, layer): _normal(kv, d, rng),
            hf(T.ATTN_OUT, layer): _normal(d, d, rng, scale), hf(T.FFN_NORM, layer): ones}


def _ffn_names(unit: FFNUnit) -> tuple[str, str, str]:
    """The checkpoint names of an FFN's gate, up and down weights: a layer's (LLaMA) or an expert's (Mixtral)."""
    if unit.expert is None:
        return tuple(llama.ARCHITECTURE.hf_name(t, unit.layer) for t in (T.FFN_GATE, T.FFN_UP, T.FFN_DOWN))
    return tuple(mixtral.ARCHITECTURE.hf_name(t, unit.layer, expert=unit.expert)
                 for t in (T.FFN_GATE_EXP, T.FFN_UP_EXP, T.FFN_DOWN_EXP))


def _ffn_tensors(geometry: Geometry, unit: FFNUnit, p: np.ndarray, noise: float, rng: np.random.Generator,
                 gain: float = 1.0) -> dict[str, np.ndarray]:
    """An FFN whose neurons fire with probabilities ``p`` on its input (whose latent energy is ``gain`` times an
    embedding's): planted gate rows, random up and down weights, the down projection ``RESIDUAL_STEP`` of
    the usual scale."""
    gate, up, down = _ffn_names(unit)
    d_ff, d = len(p), geometry.d_model
    return {gate: geometry.gate(p, noise, rng, gain).astype(np.float16), up: _normal(d_ff, d, rng),
            down: _normal(d, d_ff, rng, RESIDUAL_STEP)}


class PlantedActivations(FFNTracer):
    """The FFN inputs and activations of a synthetic checkpoint, from its construction.

    What ``Profiler`` needs of an engine (``FFNTracer``), without running one: ``forward`` calls
    ``ffn_hook`` with every layer's trace (in a mixture, every expert's, as ``mixture_of_experts``
    does) and returns no logits. The FFN input of every layer is ``rms_norm(embedding)``: the
    synthetic model's attention and FFN outputs are ~1% of the residual stream (``RESIDUAL_STEP``),
    whose drift this ignores.
    """

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.spec = checkpoint_spec(checkpoint)
        self.table = self.spec.architecture
        self.ffn_norms = [checkpoint.tensor(self.table.hf_name(T.FFN_NORM, i)) for i in range(self.spec.n_layers)]
        self.ffn_hook: FFNHook | None = None

    def new_cache(self) -> None:
        return None  # no attention, no cache

    def forward(self, tokens: np.ndarray, cache=None) -> None:
        s = self.spec
        h = self.checkpoint.raw(self.table.hf_name(T.TOKEN_EMBD))[np.asarray(tokens)].astype(np.float32)
        for i, ffn_norm in enumerate(self.ffn_norms):
            x = rms_norm(h, ffn_norm, s.norm_eps)
            if not s.moe:
                self._trace(FFNUnit(i), x, h)
                continue
            routed, _ = route(x @ self.checkpoint.tensor(self.table.hf_name(T.FFN_GATE_INP, i)).T, s.n_experts_used)
            for e in range(s.n_experts):
                routed_tokens = np.flatnonzero((routed == e).any(axis=1))  # ascending
                if len(routed_tokens):
                    self._trace(FFNUnit(i, e), x[routed_tokens], h[routed_tokens], routed_tokens)

    def _trace(self, unit: FFNUnit, x: np.ndarray, h: np.ndarray, tokens: np.ndarray | None = None) -> None:
        """Hand the hook one FFN's trace: a layer's on every token, or an expert's on ``tokens``, those routed to it."""
        gate, up, _ = _ffn_names(unit)
        gate_pre, up_pre = x @ self.checkpoint.tensor(gate).T, x @ self.checkpoint.tensor(up).T
        self.ffn_hook(FFNTrace(unit.layer, x, h, gate_pre, up_pre, activate(self.spec.ffn, gate_pre, up_pre),
                               expert=unit.expert, tokens=tokens))


class LayerByLayer(FFNTracer):
    """A context model's FFN inputs and activations, from forward passes of the reference engine.

    Its FFN inputs depend on the attention of every layer before, so its profile needs the model run (what
    ``Profiler`` needs of an engine, ``FFNTracer``); in float32, a 7B shape does not fit in memory whole. So
    each window goes through the layers in turn, each layer's weights read for it and dropped after."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.model = load_model(checkpoint, layers=range(0))  # the embeddings; no layer
        self.model.compute_logits = False
        self.spec = self.model.spec

    @property
    def ffn_hook(self) -> FFNHook | None:
        return self.model.ffn_hook

    @ffn_hook.setter
    def ffn_hook(self, hook: FFNHook | None) -> None:
        self.model.ffn_hook = hook

    def new_cache(self) -> KVCache:
        return self.model.new_cache()

    def forward(self, tokens: np.ndarray, cache: KVCache) -> None:
        weights = CheckpointWeights(self.checkpoint, np.float32)
        x = self.model.embed[np.asarray(tokens)]
        for layer in range(self.spec.n_layers):
            self.model.blocks[layer] = load_block(weights, self.spec, layer,
                                                  lambda tensor, i: read_weight(weights, self.spec, tensor, i))
            try:
                x = self.model.stages(tokens, cache).layers[layer](x)
            finally:
                self.model.blocks[layer] = None


def dense_companion(path: Path) -> Path:
    """Where the dense GGUF of a PowerInfer file goes: ``m.powerinfer.gguf`` -> ``m.gguf``, else ``m.dense.gguf``."""
    name = path.name
    if name.endswith(POWERINFER_SUFFIX):
        return path.with_name(name[: -len(POWERINFER_SUFFIX)] + DENSE_SUFFIX)
    return path.with_name(path.stem + ".dense.gguf")


@dataclass
class SynthFiles:
    """What a synthesis wrote: the PowerInfer file, its dense companion, and the shape's name."""

    powerinfer: Path
    dense: Path
    shape: str

    def files_summary(self, activation: str) -> dict:
        return {"powerinfer": str(self.powerinfer), "dense": str(self.dense), "shape": self.shape,
                "activation": activation}


@dataclass
class SynthResult(SynthFiles):
    """A ReLU synthesis: its planting, profile and predictors."""

    planting: Planting
    planted_density: float  # mean of the planted firing probabilities
    planted_hot80: float  # fraction of neurons carrying 80% of the planted firings (mean over FFNs)
    profiled_density: float  # share of the neurons computed that fired (a mixture: on its experts' tokens)
    profile_report: dict  # formats.profile_report.firing_report of the profiled tokens
    predictors: dict  # predictors.json
    ideal: dict  # ideal_selection of the planting: what a predictor that sees the latent part must compute
    mixture: dict = field(default_factory=dict)  # a mixture's experts and routing (_mixture_report); {} if dense

    def summary(self) -> dict:
        units = self.predictors["layers"]  # one entry per FFN: per layer, or per layer and expert
        return {
            **self.files_summary("relu"),
            **asdict(self.planting),
            "planted_density": self.planted_density,
            "planted_hot80": self.planted_hot80,
            "profiled_density": self.profiled_density,
            "profiled_hot80": self.profile_report["model"]["hot80_fraction"],
            **self.mixture,
            "predictor_hidden": [e["hidden"] for e in units],
            "predictor_recall": min(e["recall"] for e in units),
            "predictor_precision": min(e["precision"] for e in units),
            "predicted_density": float(np.mean([e["predicted_density"] for e in units])),
            "ideal_computed": self.ideal["computed"],
            "ideal_precision": self.ideal["precision"],
        }


@dataclass
class SiluSynthResult(SynthFiles):
    """A SiLU synthesis: its settings, calibration tokens, the activations' statistics and the neuron frequencies."""

    settings: SiluSettings
    calibration_tokens: int
    outliers: int  # outlier channels of the residual stream
    statistics: dict  # activation_statistics
    frequencies: dict  # calibrated_frequencies of the PowerInfer file

    def summary(self) -> dict:
        return {**self.files_summary("silu"), **asdict(self.settings), "rule": self.settings.rule.value,
                "calibration_tokens": self.calibration_tokens,
                "outlier_channels": self.outliers, **self.frequencies, "statistics": self.statistics}


# The distributions activation_statistics describes, in the FFN of every layer: its input (after the norm),
# |SiLU(gate x)| (what CATS thresholds) and the down projection's input SiLU(gate x) * (up x).
STATISTICS = ("ffn_input", "abs_silu_gate", "down_input")


def moments(values: np.ndarray) -> dict:
    """Mean, standard deviation, excess kurtosis (0 for a Gaussian, 3 for a Laplacian) and the share of
    the values within one standard deviation of the mean (68.3% for a Gaussian, 75.7% for a Laplacian)."""
    v = np.asarray(values, dtype=np.float64).ravel()
    mean, std = v.mean(), v.std()
    centred = v - mean
    kurtosis = (centred**4).mean() / std**4 - 3 if std > 0 else 0.0
    return {"mean": float(mean), "std": float(std), "excess_kurtosis": float(kurtosis),
            "within_1std": float((np.abs(centred) <= std).mean())}


def activation_statistics(model, tokens: np.ndarray, progress: bool = False) -> dict:
    """The ``moments`` of each ``STATISTICS`` distribution and the residual stream's RMS entering the FFN,
    per layer of a SiLU reference ``model`` (a ``models.DecoderModel``) run on one sequence of ``tokens``,
    and their means over the layers."""
    layers: dict[int, dict] = {}
    with progress_bar(total=model.spec.n_layers, desc="activation statistics", unit="layer",
                      enabled=progress) as bar:
        def record(trace: FFNTrace) -> None:
            values = (trace.ffn_input, np.abs(gate_activation(FFNKind.SWIGLU)(trace.gate_pre)), trace.activated)
            layers[trace.layer] = {name: moments(v) for name, v in zip(STATISTICS, values)}
            layers[trace.layer]["residual_rms"] = float(np.sqrt(np.mean(np.square(trace.residual, dtype=np.float64))))
            bar.update(1)

        with tracing(model, record):
            model.forward(np.asarray(tokens), model.new_cache())
    per_layer = [layers[i] for i in sorted(layers)]
    means = {name: {key: float(np.mean([layer[name][key] for layer in per_layer])) for key in per_layer[0][name]}
             for name in STATISTICS}
    return {"tokens": len(tokens), "mean_over_layers": means, "layers": per_layer}


def calibrated_frequencies(path: Path, n_layers: int) -> dict:
    """The mean of the neuron frequencies a calibrated PowerInfer file carries (the share of tokens on which a
    neuron is computed) and the share of neurons that carry 80% of them (mean over layers)."""
    model = open_model_file(path)
    frequencies = [np.asarray(model.get(neuron_frequency_key(i)), dtype=np.float64) for i in range(n_layers)]
    return {"calibrated_density": float(np.mean([f.mean() for f in frequencies])),
            "calibrated_hot80": float(np.mean([hot_fraction(f) for f in frequencies]))}


def _profiled_density(stats: FiringStats, d_ff: int) -> float:
    """The share of computed neurons that fired: of every layer's on every token, or in a mixture of
    each expert's on the tokens routed to it (the density its planted frequencies have)."""
    computed = stats.tokens * stats.n_layers if stats.routed is None else int(stats.routed.sum())
    return float(stats.fire_count.sum() / max(computed * d_ff, 1))


def _mixture_report(shape: Shape, planting: Planting, stats: FiringStats) -> dict:
    """A mixture's experts, per layer and expert the share of tokens routed to it (planted: what the
    router's construction gives, ``planted_routing``; profiled) and its firing density on those tokens;
    {} for a dense shape."""
    if not shape.n_experts:
        return {}
    experts = range(shape.n_experts)
    return {
        "experts": shape.n_experts,
        "experts_used": shape.n_experts_used,
        "planted_routing": [planted_routing(shape, planting, i)[1].tolist() for i in range(shape.n_layers)],
        "profiled_routing": (stats.routed / max(stats.tokens, 1)).tolist(),
        "profiled_expert_density": [[float(stats.unit_frequencies(FFNUnit(i, e), shape.d_ff).mean()) for e in experts]
                                    for i in range(shape.n_layers)],
    }


def _pairs_mib(shape: Shape, profile_tokens: int) -> int:
    """A pairs cap that keeps every profiled token's training pairs: a synthetic model is profiled
    to train its predictors, and hard ones need many samples per input dimension."""
    return -(-_pairs_bytes(shape, profile_tokens) // 2**20)


def _pairs_bytes(shape: Shape, profile_tokens: int) -> int:
    return profile_tokens * pair_bytes(shape.n_layers, shape.d_model, shape.d_ff, shape.n_experts)


def _check_disk(shape_name: str, shape: Shape, outtype: str, profile_tokens: int, folder: Path) -> None:
    """Refuse a synthesis whose f16 checkpoint, training pairs (of ``profile_tokens``, 0 for none) and two
    model files do not fit ``folder``'s disk."""
    bytes_per_param = WEIGHT_TYPES[OUTTYPES[outtype].weight_type].bytes_per_param
    needed = int(shape.n_params * (2 + 2 * bytes_per_param) * 1.1) + _pairs_bytes(shape, profile_tokens)
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise PitoolsError(f"{shape_name} at {outtype} needs about {format_size(needed)} of disk "
                           f"(f16 checkpoint and two model files), {folder} has {format_size(free)}")


def _check_memory(shape_name: str, shape: Shape) -> None:
    """Refuse a SiLU synthesis whose model the reference engine, in float32, would not fit in memory."""
    needed = int(shape.n_params * 4 * 1.2)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > total:
        raise PitoolsError(f"calibrating {shape_name} runs it in float32 on the reference engine: about "
                           f"{format_size(needed)} of memory, this machine has {format_size(total)}; "
                           "use --layers for fewer layers")


def default_profile_tokens(shape: Shape) -> int:
    """Tokens to profile so that every FFN sees ``PROFILE_TOKENS_PER_FFN`` of them on average: a mixture,
    whose experts each see n_experts_used / n_experts of the tokens, profiles that many times more."""
    if not shape.n_experts:
        return PROFILE_TOKENS_PER_FFN
    return PROFILE_TOKENS_PER_FFN * shape.n_experts // shape.n_experts_used


def _named_shape(shape: str | Shape, layers: int | None) -> tuple[str, Shape]:
    """The shape and its name for reports: a name in ``SHAPES`` or "custom", with ``layers`` layers."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise PitoolsError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
        name, shape = shape, SHAPES[shape]
    else:
        name = "custom"
    if layers is not None and layers != shape.n_layers:
        return f"{name}, {layers} layers", dataclasses.replace(shape, n_layers=layers)
    return name, shape


def synthesize(shape: str | Shape, output: Path, outtype: str = "q4_0", planting: Planting = Planting(),
               profile_tokens: int | None = None, train: TrainSettings | None = None, work: Path | None = None,
               keep_work: bool = False, force: bool = False, progress: bool = True,
               layers: int | None = None, candidates: Candidates | None = None) -> SynthResult:
    """Write the PowerInfer GGUF ``output`` (with predictors) and its dense companion (``dense_companion``)
    for ``shape``, a name in ``SHAPES`` or a ``Shape``, with ``layers`` layers instead of its own
    when given (a quicker model of the same widths). ``profile_tokens`` defaults to ``default_profile_tokens``.

    ``train`` defaults to ``SYNTH_TRAINING``; the f16 checkpoint, profile and predictors go to ``work``
    (default: beside ``output``), deleted at the end unless ``keep_work``. ``candidates`` trains the
    predictors (``train_predictors``; default: in this process).
    """
    shape_name, shape = _named_shape(shape, layers)
    profile_tokens = profile_tokens or default_profile_tokens(shape)
    output, dense, work = _outputs(shape_name, shape, output, outtype, profile_tokens, work, force)
    checkpoint_dir, profile_dir, predictor_dir = work / "checkpoint", work / "profile", work / "predictors"
    # A work folder left by an interrupted run of the same synthesis is resumed: the checkpoint is
    # reused, and profiling and predictor training continue where they stopped (they check their
    # own settings). ``force`` starts over.
    identity = {"shape": asdict(shape), "planting": asdict(planting), "profile_tokens": profile_tokens}
    resumed = _checkpoint_once(work, identity, force, lambda folder: write_checkpoint(folder, shape, planting))
    frequencies = planted_frequencies(shape, planting)
    train = train or SYNTH_TRAINING
    stats = _profile(Checkpoint(checkpoint_dir), profile_dir, shape_name, shape, planting, profile_tokens,
                     held_out_pairs(profile_tokens, train), resumed, progress)
    profile_report, _ = write_report(profile_dir)
    with contextlib.redirect_stdout(sys.stderr):  # its per-size log lines are progress, not output
        predictors = train_predictors(profile_dir, predictor_dir, train, force=not resumed,
                                      progress=progress, candidates=candidates)
    # The firing frequencies go into the file (for `pitools solve`); the neurons keep their checkpoint
    # order, so that the dense twin holds the same matrices row for row.
    convert(str(checkpoint_dir), output, outtype, predictors=predictor_dir, profile=profile_dir,
            sparsify=SparsifySettings(reorder=False), force=force, progress=progress)
    _finish(checkpoint_dir, dense, outtype, work, keep_work, force, progress)
    return SynthResult(output, dense, shape_name, planting, float(frequencies.mean()),
                       float(np.mean([hot_fraction(p) for p in frequencies])), _profiled_density(stats, shape.d_ff),
                       profile_report, predictors, ideal_selection(planting, shape),
                       _mixture_report(shape, planting, stats))


def synthesize_silu(shape: str | Shape, output: Path, outtype: str = "q4_0", settings: SiluSettings = SiluSettings(),
                    calibration_tokens: int | None = None, work: Path | None = None, keep_work: bool = False,
                    force: bool = False, progress: bool = True, layers: int | None = None) -> SiluSynthResult:
    """Write the calibrated PowerInfer GGUF ``output`` (activation thresholds, no predictors) of a SiLU model
    of the dense ``shape`` and its dense companion, as ``synthesize`` does a ReLU model's. The reference
    engine runs the checkpoint on ``calibration_tokens`` uniform random token ids (default
    ``CALIBRATION_TOKENS``), the first ``STATISTICS_TOKENS`` of them for ``activation_statistics``; the
    work folder holds the f16 checkpoint (reused when a run was interrupted after writing it)."""
    shape_name, shape = _named_shape(shape, layers)
    if shape.n_experts:
        raise PitoolsError(f"{shape_name} is a mixture of experts: SiLU synthesis (--activation silu) is for "
                           "dense shapes only")
    calibration_tokens = calibration_tokens or CALIBRATION_TOKENS
    output, dense, work = _outputs(shape_name, shape, output, outtype, 0, work, force)
    _check_memory(shape_name, shape)
    checkpoint_dir = work / "checkpoint"
    identity = {"shape": asdict(shape), "activation": "silu", "seed": settings.seed}
    _checkpoint_once(work, identity, force, lambda folder: write_silu_checkpoint(folder, shape, settings))
    model = load_model(Checkpoint(checkpoint_dir))
    tokens = settings.uniform_tokens(shape.vocab_size, calibration_tokens)
    statistics = activation_statistics(model, tokens[:STATISTICS_TOKENS], progress)
    calibration = calibrate(model, tokens, CalibrationSettings(settings.target_sparsity, settings.rule,
                                                               seed=settings.seed), progress=progress)
    del model  # its float32 weights, before the conversions
    # The neurons keep their checkpoint order, as a ReLU model's do: the dense twin's rows are the same.
    convert(str(checkpoint_dir), output, outtype, sparsify=SparsifySettings(reorder=False), calibration=calibration,
            force=force, progress=progress)
    _finish(checkpoint_dir, dense, outtype, work, keep_work, force, progress)
    return SiluSynthResult(output, dense, shape_name, settings, calibration_tokens, outlier_count(shape.d_model),
                           statistics, calibrated_frequencies(output, shape.n_layers))


def _outputs(shape_name: str, shape: Shape, output: Path, outtype: str, profile_tokens: int, work: Path | None,
             force: bool) -> tuple[Path, Path, Path]:
    """Check that the PowerInfer file ``output`` and its dense companion may be written and fit on the disk
    (``_check_disk``); return them and the work folder (``work``, default: beside ``output``)."""
    output = Path(output)
    dense = dense_companion(output)
    for path in (output, dense):
        check_writable_output(path, force)
    work = Path(work) if work is not None else work_folder(output)
    _check_disk(shape_name, shape, outtype, profile_tokens, output.parent)
    return output, dense, work


def _checkpoint_once(work: Path, identity: dict, force: bool, write: Callable[[Path], object]) -> bool:
    """Write the checkpoint of the synthesis ``identity`` into ``work``/checkpoint with ``write``, unless an
    interrupted run of it left it there complete (``_resume_work``): then return True (resumed)."""
    if _resume_work(work, identity, force):
        return True
    write(work / "checkpoint")
    (work / SYNTH_JSON).write_text(json.dumps(identity, indent=2))
    return False


def _finish(checkpoint_dir: Path, dense: Path, outtype: str, work: Path, keep_work: bool, force: bool,
            progress: bool) -> None:
    """Convert the checkpoint to the dense companion, then delete the work folder unless ``keep_work``."""
    convert(str(checkpoint_dir), dense, outtype, dense=True, force=force, progress=progress)
    if not keep_work:
        shutil.rmtree(work)


def _profile(checkpoint: Checkpoint, profile_dir: Path, shape_name: str, shape: Shape, planting: Planting,
             profile_tokens: int, held_out: int, resumed: bool, progress: bool) -> FiringStats:
    """Profile the synthetic checkpoint, keeping every token's pairs: from its construction on uniform token ids
    (``Planting.profile_tokens``: the last ``held_out`` from ids of their own) or, a context model, by running
    it on text (``text_profile_tokens``: the last ``held_out`` from files of their own)."""
    if planting.context:
        tracer = LayerByLayer(checkpoint)
        tokens = text_profile_tokens(checkpoint.tokenizer(tracer.spec), profile_tokens, held_out)
        source = (f"synthetic: {profile_tokens} tokens of the Python standard library's source, the last {held_out} "
                  "from files the others are not")
    else:
        tracer = PlantedActivations(checkpoint)
        tokens = planting.profile_tokens(shape.vocab_size, profile_tokens, held_out)
        source = (f"synthetic: {profile_tokens} uniform token ids, the last {held_out} from ids the others are not, "
                  f"seed {planting.seed}")
    profiler = Profiler(tracer, f"synthetic {shape_name}", tokens, [source], profile_dir,
                        ProfileSettings(seq_len=min(PROFILE_WINDOW, profile_tokens), seed=planting.seed,
                                        pairs_mib=_pairs_mib(shape, profile_tokens)))
    return profiler.run(force=not resumed, progress=progress)
