"""What a decoded token reads, by part (output head, attention, FFN), for each way a loaded model's FFN can run.

Every count is the runtime's own: the head's and attention's matrices as loaded (``RuntimeModel.static_bytes``,
which a token reads whole) and each layer's FFN plan (``ffn_plan.FFNPlan.bytes_read``) at the share of its
neurons a token computes. Those shares are what the file records (``Recorded``): the firing probabilities
profiling measured (a ReLU family's, for the whole gate's exact choice; a thresholded file's, the share its
calibration kept), the share each predictor computed on held-out profile tokens, and a mixture's routing
frequencies. A way the file does not run yet (a dense file with CATS thresholds, a ReLU-family file with the
whole gate choosing) is the plan its loaded layers would have with them (``plan_ffn`` on those layers): the
rule's bytes in the file's own weight types, at a share given.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from powerinfer_tools.formats.activation_thresholds import ActivationThresholds, LayerThresholds, read_thresholds
from powerinfer_tools.formats.constants import PREDICTOR_COMPUTED_KEY
from powerinfer_tools.formats.gguf_spec import predictor_quality
from powerinfer_tools.formats.metadata_keys import read_key
from powerinfer_tools.formats.model_check import neuron_frequencies, routing_frequencies
from powerinfer_tools.formats.model_file import ModelFile
from powerinfer_tools.formats.model_spec import ModelSpec
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.runtime.ffn_plan import Choice, FFNPlan, plan_ffn

PerUnit = tuple[tuple[float, ...], ...]  # per layer, one value per FFN unit (the layer's, or each expert's)


@dataclass(frozen=True)
class TokenBytes:
    """Weight bytes one decoded token reads (one row of the token embedding aside)."""

    head: float  # the output matrix (the embedding, when tied)
    attention: float  # the attention matrices (and a mixture's routers)
    ffn: float  # the FFNs' rows and matrices, predictors included

    @property
    def total(self) -> float:
        return self.head + self.attention + self.ffn


@dataclass(frozen=True)
class Recorded:
    """What a model file records about its FFNs' neurons (None where it records nothing)."""

    firing: PerUnit | None  # mean firing probability (a thresholded file's: the share kept in calibration)
    computed: PerUnit | None  # the share each predictor computed on held-out profile tokens
    routing: PerUnit  # how often each unit runs per token: 1 for a layer's FFN; a mixture's routing frequencies
    predictors: dict | None  # ``gguf_spec.predictor_quality``
    thresholds: ActivationThresholds | None  # a SiLU or GeGLU file's CATS/TEAL thresholds


def recorded(model: ModelFile, spec: ModelSpec) -> Recorded:
    """What ``model`` (of ``spec``) records; arrays are checked as ``formats.model_check`` reads them."""
    experts = list(range(spec.n_experts)) if spec.moe else [None]
    firing = [[neuron_frequencies(model, spec, layer, expert) for expert in experts] for layer in range(spec.n_layers)]
    computed = read_key(model.get, PREDICTOR_COMPUTED_KEY, model.path)
    if computed is not None and len(computed) == spec.n_layers * len(experts):
        computed = _per_layer(computed, len(experts))
    else:  # (a length that is not one per FFN unit: unusable, as gate_choice finds)
        computed = None
    return Recorded(
        firing=None if any(f is None for row in firing for f in row)
        else tuple(tuple(float(f.mean()) for f in row) for row in firing),
        computed=computed,
        routing=tuple(_routing(model, spec, layer) for layer in range(spec.n_layers)),
        predictors=predictor_quality(model),
        thresholds=read_thresholds(model.get, spec.n_layers, str(model.path)),
    )


def _per_layer(values: list, units: int) -> PerUnit:
    return tuple(tuple(float(v) for v in values[i : i + units]) for i in range(0, len(values), units))


def _routing(model: ModelFile, spec: ModelSpec, layer: int) -> tuple[float, ...]:
    if not spec.moe:
        return (1.0,)
    routing = routing_frequencies(model, spec, layer)
    if routing is None:  # no profile: each expert alike, the experts used of the experts
        return (spec.n_experts_used / spec.n_experts,) * spec.n_experts
    return tuple(float(r) for r in routing)


@dataclass(frozen=True)
class FFNWay:
    """One way the FFNs run: each layer's plan, and the share of each unit's neurons a token computes."""

    plans: tuple[FFNPlan, ...]
    shares: PerUnit

    def bytes(self, model, routing: PerUnit) -> TokenBytes:
        """What a token of ``model`` (the ``RuntimeModel`` the plans are of) reads, each unit weighted by how
        often it runs (``routing``)."""
        head = model.output.nbytes
        ffn = sum(weight * plan.bytes_read(round(share * plan.d_ff), round(share * plan.d_ff), unit)
                  for plan, shares, weights in zip(self.plans, self.shares, routing)
                  for unit, (share, weight) in enumerate(zip(shares, weights)))
        return TokenBytes(head=head, attention=model.static_bytes - head, ffn=float(ffn))

    @classmethod
    def of(cls, plans, share: float = 1.0) -> FFNWay:
        """``plans``, every unit computing ``share`` of its neurons."""
        plans = tuple(plans)
        return cls(plans, tuple((share,) * max(plan.experts, 1) for plan in plans))

    def at(self, share: float) -> FFNWay:
        """The same plans, every unit computing ``share`` of its neurons."""
        return FFNWay.of(self.plans, share)


def dense_way(model) -> FFNWay:
    """Every neuron of every FFN."""
    return FFNWay.of(model.ffn_plans[FFNMode.DENSE])


def priced(plans, facts: Recorded) -> FFNWay | None:
    """``plans`` at the shares the file records for what chooses each layer's neurons: a predictor's computed
    share; the firing share for the whole gate (what fires), for thresholds (what their calibration kept) and for
    a predictor whose computed share is not recorded (at least what fires); None where the file records none."""
    plans, shares = tuple(plans), []
    for index, plan in enumerate(plans):
        if plan.choice is Choice.EVERY:
            shares.append((1.0,) * max(plan.experts, 1))
        elif plan.choice is Choice.PREDICTOR and facts.computed is not None:
            shares.append(facts.computed[index])
        elif facts.firing is not None:
            shares.append(facts.firing[index])
        elif plan.choice.thresholded and facts.thresholds is not None:
            shares.append((1 - facts.thresholds.target,) * max(plan.experts, 1))
        else:
            return None
    return FFNWay(plans, tuple(shares))


def chosen_by(model, thresholds: list[LayerThresholds | None]) -> list[FFNPlan]:
    """The sparse plans ``model``'s layers would have with ``thresholds`` choosing their neurons instead of
    their predictors (a layer's None: its predictor)."""
    return [plan_ffn(dataclasses.replace(layer, dense=dataclasses.replace(layer.dense, thresholds=t)), FFNMode.SPARSE,
                     model.spec.n_experts_used) for layer, t in zip(model.layers, thresholds)]


def mean_share(way: FFNWay, routing: PerUnit) -> float:
    """The share of FFN neurons a token computes, over the units that run (weighted by ``routing``)."""
    weights = np.array([w for row in routing for w in row])
    return float(np.dot([s for row in way.shares for s in row], weights) / weights.sum())
