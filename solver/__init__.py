"""Neuron placement: which FFN neurons, attention blocks and output head go on the GPU.

A ``PlacementProblem`` (built by ``problem_from_stats`` from per-layer firing probabilities
and sizes) is solved by ``solve`` as an ILP under one VRAM budget, for the ``latency`` or
``activations`` objective; ``predict`` prices any ``Placement`` with the cost model, and
``summary`` reports it beside a layer-granular (``-ngl``) offload of the same budget.
"""

from powerinfer_tools.solver.hardware import PRESETS, HardwareProfile, load_profile, probe_profile, save_profile
from powerinfer_tools.solver.ilp import OBJECTIVES, SolveReport, solve
from powerinfer_tools.solver.problem import Placement, PlacementProblem, Prediction, predict, problem_from_stats

from powerinfer_tools.units import format_size, parse_size

__all__ = [
    "OBJECTIVES",
    "PRESETS",
    "HardwareProfile",
    "Placement",
    "PlacementProblem",
    "Prediction",
    "SolveReport",
    "format_size",
    "load_profile",
    "parse_size",
    "predict",
    "probe_profile",
    "problem_from_stats",
    "save_profile",
    "solve",
]
