"""Neuron placement: which FFN neurons, attention blocks and output head go on the GPU.

A ``PlacementProblem`` (built by ``problem_from_stats`` from per-layer firing probabilities
and sizes) is solved by ``solve`` as an ILP under one VRAM budget, for the ``latency`` or
``activations`` objective; ``predict`` prices any ``Placement`` with the cost model, and
``summary`` reports it beside a layer-granular (``-ngl``) offload of the same budget.
With a RAM budget, a ``TieredProblem`` (``tiers.tiered_problem``) places each neuron on the GPU,
in RAM or on disk behind its layer's neuron cache (``tier_ilp.solve_tiers``; ``cache_model``
prices the cache's misses), with or without a GPU.
"""

import importlib

# Each name's module, imported when the name is first used (PEP 562): importing the package, as every
# ``powerinfer_tools.solver.X`` import does, costs nothing then, while the ILP's modules bring in PuLP
# and HiGHS (import time that `pitools run` does not need).
_HOMES = {
    "PRESETS": "hardware", "HardwareProfile": "hardware", "load_profile": "hardware", "probe_profile": "hardware",
    "save_profile": "hardware",
    "OBJECTIVES": "ilp", "SolveReport": "ilp", "solve": "ilp",
    "Placement": "problem", "PlacementProblem": "problem", "Prediction": "problem", "predict": "problem",
    "problem_from_stats": "problem",
    "solve_tiers": "tier_ilp",
    "TieredPlacement": "tiers", "TieredProblem": "tiers", "predict_tiers": "tiers", "tiered_problem": "tiers",
}


def __getattr__(name: str):
    if name in ("format_size", "parse_size"):
        return getattr(importlib.import_module("powerinfer_tools.units"), name)
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


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
