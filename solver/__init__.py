"""Neuron placement: which FFN neurons, attention blocks and output head go on the GPU.

A ``PlacementProblem`` (built by ``problem_from_stats`` from per-layer firing probabilities
and sizes) is solved by ``solve`` as an ILP under one VRAM budget, for the ``latency`` or
``activations`` objective; ``predict`` prices any ``Placement`` with the cost model, and
``summary`` reports it beside a layer-granular (``-ngl``) offload of the same budget.
With a RAM budget, a ``TieredProblem`` (``tiers.tiered_problem``) places each neuron on the GPU,
in RAM or on disk behind its layer's neuron cache (``tier_ilp.solve_tiers``; ``cache_model``
prices the cache's misses), with or without a GPU.
"""

from powerinfer_tools.solver.hardware import PRESETS, HardwareProfile, load_profile, probe_profile, save_profile
from powerinfer_tools.solver.ilp import OBJECTIVES, SolveReport, solve
from powerinfer_tools.solver.problem import Placement, PlacementProblem, Prediction, predict, problem_from_stats
from powerinfer_tools.solver.tier_ilp import solve_tiers
from powerinfer_tools.solver.tiers import TieredPlacement, TieredProblem, predict_tiers, tiered_problem

from powerinfer_tools.units import format_size, parse_size

__all__ = [
    "OBJECTIVES",
    "PRESETS",
    "HardwareProfile",
    "Placement",
    "PlacementProblem",
    "Prediction",
    "SolveReport",
    "TieredPlacement",
    "TieredProblem",
    "format_size",
    "load_profile",
    "parse_size",
    "predict",
    "predict_tiers",
    "probe_profile",
    "problem_from_stats",
    "save_profile",
    "solve",
    "solve_tiers",
    "tiered_problem",
]
