"""What the solver predicts for a model file under a VRAM or RAM budget, for ``pitools advise``.

Nothing is written: the placement is solved in memory, as ``pitools solve`` would solve it, and priced by the
solver's cost model (``solver/problem.py``, ``solver/tiers.py``): bandwidths of a hardware preset or profile,
not a measurement here. Where the solver cannot place the file (a dense file, a budget below the least
placement), the answer says why instead.
"""

from __future__ import annotations

from pathlib import Path

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.solver.hardware import load_profile
from powerinfer_tools.solver.problem import Placement, PlacementProblem, predict

SOLVE_SECONDS = 20.0  # each placement solved here stops by then (the solver's default is a minute)


def gpu_prediction(path: Path, vram: int, hardware: str, ctx_size: int | None = None) -> dict:
    """The placement of ``path``'s neurons, dense blocks and head within ``vram`` bytes and its predicted speed,
    beside the CPU alone and llama.cpp's dense layer offload of the same budget (``solver.summary``); or
    ``{"refused": why}``."""
    from powerinfer_tools.solver import ilp
    from powerinfer_tools.solver.split import model_problem
    from powerinfer_tools.solver.summary import summary_dict

    profile = load_profile(hardware)
    try:
        problem = model_problem(path, vram, profile, **_context(ctx_size))
        report = ilp.solve(problem, "latency", time_limit=SOLVE_SECONDS)
    except PitoolsError as exc:
        return {"refused": str(exc)}
    summary = summary_dict(problem, report)
    placement = report.placement
    return {
        "hardware": profile.name,
        "budget_bytes": vram,
        "tokens_per_s": summary["placement"]["tokens_per_s"],
        "cpu_tokens_per_s": 1 / _cpu_alone(problem).token_s,
        "llama_cpp_tokens_per_s": summary["llama_cpp"]["tokens_per_s"],
        "llama_cpp_n_gpu_layers": summary["llama_cpp"]["n_gpu_layers"],
        "vram_bytes": summary["placement"]["vram_bytes"],
        "gpu_neuron_share": sum(placement.gpu_neurons) / sum(layer.n_neurons for layer in problem.layers),
        "layers_on_gpu": sum(placement.dense_on_gpu),
        "layers": len(problem.layers),
        "head_on_gpu": placement.head_on_gpu,
    }


def _context(ctx_size: int | None) -> dict:
    """The KV caches' positions for the solver: ``ctx_size``, or the solver's own default."""
    return {} if ctx_size is None else {"n_ctx": ctx_size}


def _cpu_alone(problem: PlacementProblem):
    n = len(problem.layers)
    return predict(problem, Placement(gpu_neurons=(0,) * n, dense_on_gpu=(False,) * n, head_on_gpu=False))


def ram_prediction(path: Path, ram: int, vram: int | None, hardware: str, ctx_size: int | None = None) -> dict:
    """Within ``ram`` bytes (and ``vram``, when given): which neurons stay in RAM and what a token reads from disk,
    sparse (the file's firing frequencies) and dense (every neuron, as ``--mode dense`` streams them), each with
    its predicted speed (``solver.tiers``); or ``{"refused": why}``."""
    from powerinfer_tools.solver.model_stats import read_embedding_stats
    from powerinfer_tools.solver.split import model_problem
    from powerinfer_tools.solver.tier_ilp import solve_tiers
    from powerinfer_tools.solver.tier_summary import tier_summary_dict
    from powerinfer_tools.solver.tiers import tiered_problem

    profile = load_profile(hardware)
    summaries = {}
    try:
        problem = model_problem(path, vram or 0, profile, **_context(ctx_size))
        embedding = read_embedding_stats(path)
        for mode, base in (("sparse", problem), ("dense", problem.as_dense_model())):
            tiered = tiered_problem(base, ram, has_gpu=vram is not None, **embedding)
            summaries[mode] = tier_summary_dict(tiered, solve_tiers(tiered, time_limit=SOLVE_SECONDS))
    except PitoolsError as exc:
        return {"refused": str(exc)}
    sparse, dense = summaries["sparse"]["placement"], summaries["dense"]["placement"]
    return {
        "hardware": profile.name,
        "ram_budget_bytes": ram,
        "disk_defaulted": summaries["sparse"]["disk"]["defaulted"],
        "tokens_per_s": sparse["tokens_per_s"],
        "dense_tokens_per_s": dense["tokens_per_s"],
        "disk_bytes_per_token": sparse["disk_bytes_per_token"],
        "dense_disk_bytes_per_token": dense["disk_bytes_per_token"],
        "cache_hit_rate": sparse["cache_hit_rate"],
        "ram_bytes": sparse["ram_bytes"],
    }
