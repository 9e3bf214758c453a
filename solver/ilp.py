"""The placement ILP, solved with PuLP (HiGHS when highspy is installed, else the bundled CBC).

Within a layer the neurons are sorted by firing probability and the GPU takes a hot prefix:
at equal memory a hotter neuron serves more firings, so for ``activations`` the best set is
always a prefix. For ``latency`` it need not be (a layer's time is the larger of its GPU and
CPU parts, and colder neurons can balance them more finely), but the best prefix is slower
than the best set by less than one hot neuron's GPU time per layer, nanoseconds on real
models (tests check both claims by exhaustive search). The prefix lengths a layer may take are
0, then multiples of ``batch`` from the layer's minimum GPU share up (PowerInfer's
communication constraint: below it splitting does not pay), then the whole layer; lengths
that take more memory than a smaller one for no gain are dropped (``_undominated``).

Variables, per layer ``l`` with allowed GPU counts ``c_0 = 0 < c_1 < ... < c_m``:

* ``a[l]`` binary: the dense block and KV cache are on the GPU;
* ``y[l][i]`` binary, ``i >= 1``: at least ``c_i`` neurons are on the GPU. Prefix constraints
  ``y[l][i] >= y[l][i+1]`` and ``a[l] >= y[l][1]`` (FFN neurons only beside their dense block);
* ``h`` binary: the output head is on the GPU.

A layer's cost depends only on ``a`` and its prefix length, so it is tabulated for every
allowed length with ``LayerCost`` (the same code that ``predict`` uses) and the objective is
``cost(off) + (cost(c_0) - cost(off)) a + sum_i (cost(c_i) - cost(c_{i-1})) y_i``: exact,
max of GPU and CPU time and the sync of split layers included, without a linearisation. Its
LP relaxation is the convex hull of each layer's options (the chain polytope is integral),
so the root bound is within about one layer's step of the optimum; the textbook form
(``t >= GPU time``, ``t >= CPU time``, a sync indicator) lets a fractional layer run "half on
each device" in parallel for free and left 1-2% gaps at the 7B benchmark's time limit.

One memory row: reserve + dense blocks + KV caches + FFN rows + head <= budget.

``latency`` minimises the predicted seconds per token; ``activations`` maximises the bytes
read per token from GPU memory, PowerInfer's objective: its activation mass, with dense
blocks counted as always active. Coefficients are scaled to O(1) (by the all-CPU time per
token, the bytes read per token and the memory available) so that the solvers' tolerances
mean the same thing on every model.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pulp
from powerinfer_tools.solver.problem import HeadCost, Layer, LayerCost, Placement, PlacementProblem, Prediction, predict

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.units import format_size

Objective = Literal["latency", "activations"]
OBJECTIVES: tuple[Objective, ...] = ("latency", "activations")
SOLVERS = ("auto", "highs", "cbc")
_LIBC = ctypes.CDLL(None) if os.name == "posix" else None


@dataclass(frozen=True)
class SolveReport:
    placement: Placement
    prediction: Prediction
    objective: Objective
    solver: str
    status: str
    seconds: float  # wall time of model building and solving
    value: float  # seconds per token (latency) or GPU bytes read per token (activations)
    bound: float  # the best value the solver proved possible
    bound_kind: str

    @property
    def gap(self) -> float:
        """Relative optimality gap: how far ``value`` may be from the true optimum."""
        return abs(self.value - self.bound) / max(abs(self.value), 1e-300)


def allowed_gpu_counts(layer: Layer, batch: int) -> np.ndarray:
    """0, then batch multiples from the layer's minimum GPU share, then all its neurons."""
    n = layer.n_neurons
    grid = np.minimum(np.arange(batch, n + batch, batch), n)
    return np.concatenate(([0], grid[grid >= layer.min_gpu_neurons]))


def _undominated(counts: np.ndarray, values: np.ndarray, off_value: float, minimise: bool) -> np.ndarray:
    """The counts worth offering: the first (the dense block alone, the way to the others), then
    those that do strictly better than every smaller count and than leaving the layer on the CPU.
    The rest take more memory for no gain, as counts past the point where a layer's GPU and CPU
    times balance do; dropping them halves the latency ILP."""
    better = values if minimise else -values
    reference = off_value if minimise else -off_value
    best_smaller = np.minimum.accumulate(np.concatenate(([reference], better)))[:-1]
    keep = better < best_smaller
    keep[0] = True
    return counts[keep]


@dataclass
class _Model:
    lp: pulp.LpProblem
    counts: list[np.ndarray]
    y: list[list[pulp.LpVariable]]
    dense: list[pulp.LpVariable]
    head: pulp.LpVariable
    scale: float  # natural units per unit of the LP objective

    def placement(self) -> Placement:
        def chosen(var: pulp.LpVariable) -> bool:
            return (var.value() or 0.0) > 0.5

        return Placement(
            gpu_neurons=tuple(int(c[sum(map(chosen, y))]) for c, y in zip(self.counts, self.y)),
            dense_on_gpu=tuple(chosen(a) for a in self.dense),
            head_on_gpu=chosen(self.head),
        )


def _build(problem: PlacementProblem, objective: Objective, batch: int, capacity: int) -> _Model:
    """The ILP for ``capacity`` bytes of GPU memory beyond the reserve."""
    minimise = objective == "latency"

    def value(cost: LayerCost | HeadCost) -> np.ndarray:
        """What the objective counts: seconds, or bytes read on the GPU (arrays for arrays of counts)."""
        return np.asarray(cost.total_s if minimise else cost.gpu_read_bytes, dtype=np.float64)

    all_cpu = predict(problem, Placement((0,) * len(problem.layers), (False,) * len(problem.layers), False))
    scale = all_cpu.token_s if minimise else all_cpu.read_bytes
    constant = all_cpu.token_s if minimise else all_cpu.gpu_read_bytes  # the variables add steps to it
    lp = pulp.LpProblem("placement", pulp.LpMinimize if minimise else pulp.LpMaximize)
    objective_terms, memory_terms = [], []

    def add_step(var: pulp.LpVariable, value_step: float, vram_step: float) -> None:
        # Python floats: a NumPy scalar on the left would try to broadcast the PuLP variable.
        objective_terms.append(float(value_step) / scale * var)
        memory_terms.append(float(vram_step) / capacity * var)

    counts, ys, dense = [], [], []
    for l, layer in enumerate(problem.layers):
        off = LayerCost.of(problem, layer, 0, dense_on_gpu=False)
        c = allowed_gpu_counts(layer, batch)
        c = _undominated(c, value(LayerCost.of(problem, layer, c, dense_on_gpu=True)), value(off), minimise)
        on = LayerCost.of(problem, layer, c, dense_on_gpu=True)
        on_value, on_vram = value(on), np.asarray(on.vram)
        a = lp.add_variable(f"a_{l}", cat=pulp.LpBinary)
        add_step(a, on_value[0] - value(off), on_vram[0])
        y = [lp.add_variable(f"y_{l}_{i}", cat=pulp.LpBinary) for i in range(1, len(c))]
        for i, var in enumerate(y, start=1):
            add_step(var, on_value[i] - on_value[i - 1], on_vram[i] - on_vram[i - 1])
        for wider, narrower in zip([a] + y, y):
            lp += wider >= narrower
        counts.append(c)
        ys.append(y)
        dense.append(a)
    head = lp.add_variable("h", cat=pulp.LpBinary)
    add_step(head, value(HeadCost.of(problem, True)) - value(HeadCost.of(problem, False)), problem.head_bytes)
    if constant:
        # PuLP drops objective constants on the way to the solvers, whose relative gap must
        # be measured on the whole time per token: carry the constant as a variable fixed at 1.
        objective_terms.append(constant / scale * lp.add_variable("constant", lowBound=1, upBound=1))
    lp += pulp.lpSum(objective_terms)
    lp += pulp.lpSum(memory_terms) <= 1.0, "memory"
    return _Model(lp, counts, ys, dense, head, scale)


def solver_name(requested: str) -> str:
    if requested == "auto":
        return "highs" if pulp.HiGHS().available() else "cbc"
    if requested == "highs" and not pulp.HiGHS().available():
        raise PitoolsError("--solver highs: highspy is not installed (pip install highspy)")
    return requested


def make_solver(name: str, gap_rel: float, time_limit: float, mip: bool = True) -> pulp.LpSolver:
    if name == "highs":
        # Presolve reduces nothing in chain rows, yet with it HiGHS spent most of a 70B instance's solve
        # before its first node; without it the same solve took a fraction of the time.
        return pulp.HiGHS(msg=False, mip=mip, gapRel=gap_rel, timeLimit=time_limit, presolve="off")
    return pulp.PULP_CBC_CMD(msg=False, mip=mip, gapRel=gap_rel, timeLimit=time_limit)


@contextlib.contextmanager
def native_stdout_silenced() -> Iterator[None]:
    """highspy prints a banner from C++ on stdout the first time it is used, whatever its
    options say; stdout belongs to our report (``--json`` must stay parseable)."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        yield
    finally:
        if _LIBC:
            _LIBC.fflush(None)  # C stdio may still hold the banner in its buffer
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _run(model: _Model, solver: pulp.LpSolver) -> None:
    with native_stdout_silenced():
        model.lp.solve(solver)
    if model.lp.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        status = pulp.LpStatus[model.lp.status]
        raise PitoolsError(f"placement ILP: {solver.name} found no solution (status {status}); raise --time-limit")


def check_budget(problem: PlacementProblem) -> None:
    """PitoolsError when the budget cannot hold even the smallest useful placement."""
    what, nbytes = problem.smallest_gpu_unit()
    minimum = problem.reserve_bytes + nbytes
    if problem.budget_bytes < minimum:
        raise PitoolsError(
            f"VRAM budget {format_size(problem.budget_bytes)} is below the minimum useful placement, "
            f"{format_size(minimum, round_up=True)}: the {format_size(problem.reserve_bytes)} reserve for the CUDA "
            f"context and scratch plus {what} ({format_size(nbytes)})"
        )


def solve(
    problem: PlacementProblem,
    objective: Objective = "latency",
    *,
    batch: int = 64,
    solver: str = "auto",
    gap_rel: float = 0.005,
    time_limit: float = 60.0,
) -> SolveReport:
    """Place neurons, dense blocks and the head to optimise ``objective`` within the budget."""
    check_budget(problem)
    name = solver_name(solver)
    start = time.perf_counter()
    capacity = problem.budget_bytes - problem.reserve_bytes
    while True:
        model = _build(problem, objective, batch, capacity)
        if name == "cbc":
            # CBC does not report its best bound through PuLP: bound with the LP relaxation.
            _run(model, make_solver(name, gap_rel, time_limit, mip=False))
            bound, bound_kind = model.scale * model.lp.objective.value(), "LP relaxation"
        _run(model, make_solver(name, gap_rel, time_limit))
        placement = model.placement()
        prediction = predict(problem, placement)
        # The solver works in floating point; the budget is checked here in whole bytes.
        excess = prediction.vram - problem.budget_bytes
        if excess <= 0:
            break
        capacity -= excess
    if name == "highs":
        sign = 1.0 if objective == "latency" else -1.0  # PuLP hands HiGHS a maximisation negated
        bound = model.scale * sign * model.lp.solverModel.getInfo().mip_dual_bound
        bound_kind = "MIP dual bound"
    optimal = model.lp.sol_status == pulp.LpSolutionOptimal
    return SolveReport(
        placement=placement,
        prediction=prediction,
        objective=objective,
        solver=name,
        status="optimal within gap" if optimal else "stopped at time limit",
        seconds=time.perf_counter() - start,
        value=prediction.token_s if objective == "latency" else prediction.gpu_read_bytes,
        bound=bound,
        bound_kind=bound_kind,
    )
