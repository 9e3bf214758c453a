"""From a solved placement to the split file, and the whole step for a model file at a budget.

``pitools solve`` and ``pitools run --vram`` (which solves on the fly when no split fits) share it;
``tiered_split_file`` writes the three-tier placement of ``pitools solve --ram``.
"""

from __future__ import annotations

from pathlib import Path

from powerinfer_tools.formats.constants import (
    CACHE_HIT_RATE_KEY,
    DISK_BYTES_PER_TOKEN_KEY,
    GPU_NEURONS_KEY,
    HARDWARE_KEY,
    N_CTX_KEY,
    OBJECTIVE_KEY,
    PREDICTED_TOKEN_MS_KEY,
    RAM_NEURONS_KEY,
    RAM_USED_KEY,
    VRAM_USED_KEY,
)
from powerinfer_tools.formats.fingerprint import model_fingerprint
from powerinfer_tools.formats.gpu_split import GpuSplit, read_gpu_split, write_gpu_split
from powerinfer_tools.solver import ilp
from powerinfer_tools.solver.hardware import HardwareProfile
from powerinfer_tools.solver.ilp import SolveReport
from powerinfer_tools.solver.model_stats import read_model_stats
from powerinfer_tools.solver.problem import (
    DEFAULT_RESERVE_BYTES,
    Placement,
    PlacementProblem,
    predict,
    problem_from_stats,
)
from powerinfer_tools.solver.tier_ilp import TierSolveReport, solve_tiers
from powerinfer_tools.solver.tiers import TieredPlacement, TieredProblem, predict_tiers

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.units import check_size


def split_file(problem: PlacementProblem, placement: Placement, objective: str,
               fingerprint: str | None = None) -> GpuSplit:
    """The split file of ``placement`` (solved for ``objective``, or another name for how it was chosen),
    with our own keys beside PowerInfer's; ``fingerprint`` identifies the model file it was solved for
    (``model_fingerprint``; None when solved from statistics alone)."""
    prediction = predict(problem, placement)
    return GpuSplit(
        masks=tuple(placement.gpu_mask(problem, index) for index in range(len(problem.layers))),
        # What PowerInfer's loader checks against the VRAM it has left after the dense tensors.
        vram_capacity=int(sum(layer.ffn_vram for layer in prediction.layers)),
        vram_budget=problem.budget_bytes,
        dense_on_gpu=tuple(placement.dense_on_gpu),
        output_on_gpu=placement.head_on_gpu,
        model_fingerprint=fingerprint,
        notes={
            OBJECTIVE_KEY: objective,
            PREDICTED_TOKEN_MS_KEY: prediction.token_s * 1e3,
            GPU_NEURONS_KEY: list(placement.gpu_neurons),
            VRAM_USED_KEY: prediction.vram,
            N_CTX_KEY: problem.n_ctx,
            HARDWARE_KEY: problem.hardware.name,
        },
    )


def tiered_split_file(problem: TieredProblem, placement: TieredPlacement, fingerprint: str | None = None) -> GpuSplit:
    """The split file of a three-tier placement: PowerInfer's GPU masks (all empty without a GPU), and
    the RAM tier in our keys."""
    prediction = predict_tiers(problem, placement)
    n_layers = len(problem.layers)
    notes = {
        OBJECTIVE_KEY: "latency",
        PREDICTED_TOKEN_MS_KEY: prediction.token_s * 1e3,
        GPU_NEURONS_KEY: list(placement.gpu_neurons),
        RAM_NEURONS_KEY: list(placement.ram_neurons),
        RAM_USED_KEY: prediction.ram,
        DISK_BYTES_PER_TOKEN_KEY: prediction.disk_read_bytes,
        N_CTX_KEY: problem.base.n_ctx,
        HARDWARE_KEY: problem.base.hardware.name,
    }
    if problem.has_gpu:
        notes[VRAM_USED_KEY] = prediction.vram
    if prediction.cache_hit_rate is not None:
        notes[CACHE_HIT_RATE_KEY] = prediction.cache_hit_rate
    return GpuSplit(
        masks=tuple(placement.gpu_placement.gpu_mask(problem.base, index) for index in range(n_layers)),
        vram_capacity=int(sum(layer.base.ffn_vram for layer in prediction.layers)),
        vram_budget=problem.base.budget_bytes if problem.has_gpu else None,
        dense_on_gpu=tuple(placement.dense_on_gpu),
        output_on_gpu=placement.head_on_gpu,
        model_fingerprint=fingerprint,
        notes=notes,
        ram_masks=tuple(placement.ram_mask(problem, index) for index in range(n_layers)),
        ram_budget=problem.ram_budget,
        cache_bytes=placement.cache_bytes(problem),
    )


def solve_tiers_into(problem: TieredProblem, split_path: Path, fingerprint: str | None, overwrite: bool = True,
                     **ilp_options) -> TierSolveReport:
    """Solve the three-tier ``problem`` and write its split to ``split_path`` (replacing a file there only with
    ``overwrite``), naming the model by ``fingerprint``."""
    report = solve_tiers(problem, **ilp_options)
    write_gpu_split(split_path, tiered_split_file(problem, report.placement, fingerprint), overwrite)
    return report


def model_problem(model_path: Path, budget_bytes: int, hardware: HardwareProfile, *, n_ctx: int = 2048,
                  reserve_bytes: int = DEFAULT_RESERVE_BYTES, stats: dict | None = None) -> PlacementProblem:
    """The placement problem of a model file (sizes and firing frequencies read from it, or ``stats``
    as ``read_model_stats`` returned them)."""
    return problem_from_stats(**(stats or read_model_stats(model_path)), n_ctx=n_ctx, budget_bytes=budget_bytes,
                              hardware=hardware, reserve_bytes=reserve_bytes)


def serves(split: GpuSplit, fingerprint: str, budget_bytes: int) -> bool:
    """Whether a cached split may serve the model of ``fingerprint`` at ``budget_bytes``: ours when
    solved for that model file and exactly that budget (a larger budget deserves a new solve; one of
    ours without a fingerprint may be another model's of the same shape); PowerInfer's, which records
    neither, when its FFN capacity fits, as its loader decides. A CPU-only split of ours (``solve --ram``
    without ``--vram``) serves no VRAM budget."""
    if split.vram_budget is not None:
        return split.model_fingerprint == fingerprint and split.vram_budget == budget_bytes
    if split.ram_budget is not None:  # ours, solved without a GPU: it plans none
        return False
    return split.vram_capacity <= budget_bytes


def ensure_split(model_path: Path, split_path: Path, budget_bytes: int, hardware: HardwareProfile, *,
                 reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> SolveReport | None:
    """Make ``split_path`` a split of ``model_path`` for ``budget_bytes``: keep the file there when it
    is a split of this model that serves the budget (``serves``), else solve and (over)write it,
    as PowerInfer's runtime regenerates ``<model>.generated.gpuidx``. Returns the solve's report, or
    None when the cached file was kept."""
    check_size(budget_bytes, "VRAM budget")
    stats = read_model_stats(model_path)
    fingerprint = model_fingerprint(model_path)
    if split_path.is_file() and _reusable(split_path, fingerprint, [len(f) for f in stats["freqs"]], budget_bytes):
        return None
    problem = model_problem(model_path, budget_bytes, hardware, reserve_bytes=reserve_bytes, stats=stats)
    return solve_into(problem, split_path, fingerprint)


def solve_into(problem: PlacementProblem, split_path: Path, fingerprint: str | None, objective: str = "latency",
               overwrite: bool = True, **ilp_options) -> SolveReport:
    """Solve ``problem`` and write its split to ``split_path`` (replacing a file there only with ``overwrite``),
    naming the model by ``fingerprint``."""
    report = ilp.solve(problem, objective, **ilp_options)
    write_gpu_split(split_path, split_file(problem, report.placement, report.objective, fingerprint), overwrite)
    return report


def _reusable(split_path: Path, fingerprint: str, layer_sizes: list[int], budget_bytes: int) -> bool:
    try:
        split = read_gpu_split(split_path)
    except PitoolsError:  # unreadable: a cache is solved again rather than trusted
        return False
    return [len(mask) for mask in split.masks] == layer_sizes and serves(split, fingerprint, budget_bytes)
