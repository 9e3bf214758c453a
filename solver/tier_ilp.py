"""The three-tier placement ILP (``pitools solve --ram``), solved with PuLP as ``ilp.py`` is.

Within a layer the neurons are sorted by firing probability: the GPU takes a hot prefix of ``g``
neurons, RAM the next ones up to ``s``, the disk the rest (``tiers.py``). For a given number of cache
slots per layer, a layer's time and memory depend only on ``g``, ``s`` and where its dense block is,
so they are tabulated for the allowed values (``LayerCost``, ``expected_misses``: the same code that
``predict_tiers`` uses). Variables, per layer ``l``:

* ``a[l]``, ``y[l][i]`` as in ``ilp.py`` (dense block on the GPU; ``g >= c_i`` over the allowed GPU
  counts), when there is a GPU;
* ``z[l][j]`` binary: ``s >= d_j`` over ``d = 0, batch, 2 batch, ..., n``; ``z[l][j] >= z[l][j+1]``,
  and ``z`` at ``c_i`` >= ``y[l][i]`` (RAM and disk neurons come after the GPU's);
* ``t[l]`` >= the GPU side of the FFN (a chain in ``y``) and >= its CPU side (a chain in ``y``) plus
  the disk's wait (a chain in ``z``): the layer's FFN time at the optimum. ``ilp.py`` tabulates the
  larger of the two sides over ``g`` alone; here they depend on ``g`` and ``s``, hence ``t``.

Rows: VRAM as in ``ilp.py`` (with a GPU) and RAM (``tiers.py``'s memory model). The objective is the
predicted time per token, exact at integer points.

First, the two-tier optimum (``ilp.py``) with every neuron off the GPU in RAM: when that fits the RAM
budget it is the answer, since a neuron on disk only adds time (and that ILP is much the easier).

Cache size. The slots per layer are not a variable: the ILP is solved for 16 (the runtime's minimum),
64, 256, ... (x4, below the largest layer's neuron count), then for the halves and doubles of the
best; the placement predicted fastest is kept, and the RAM it leaves unused goes to the cache (the
most slots per layer that still fit: more slots never cost time). ``time_limit`` is shared by
these solves.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass

import numpy as np
import pulp
from powerinfer_tools.solver import ilp
from powerinfer_tools.solver.cache_model import CacheCurves
from powerinfer_tools.solver.ilp import allowed_gpu_counts, check_budget, make_solver, native_stdout_silenced, solver_name
from powerinfer_tools.solver.problem import HeadCost, Layer, LayerCost, Placement, predict
from powerinfer_tools.solver.tiers import (
    MIN_CACHE_SLOTS,
    TieredPlacement,
    TieredProblem,
    TierPrediction,
    cache_ram,
    predict_tiers,
)

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.units import format_size


@dataclass(frozen=True)
class TierSolveReport:
    placement: TieredPlacement
    prediction: TierPrediction
    solver: str
    status: str
    seconds: float
    value: float  # seconds per token at the solved cache size (before the cache took the leftover RAM)
    bound: float  # the best value the solver proved possible at that cache size
    bound_kind: str
    # cache slots per layer -> predicted seconds per token (None: infeasible); empty when every neuron off
    # the GPU fits in RAM (the two-tier optimum then is the three-tier one)
    slots_tried: dict[int, float | None]

    @property
    def gap(self) -> float:
        return abs(self.value - self.bound) / max(abs(self.value), 1e-300)


@dataclass
class _Rows:
    """The objective and the two memory rows, in scaled units, gathered term by term."""

    scale: float  # seconds per objective unit
    vram_capacity: float
    ram_capacity: float
    objective: list = dataclasses.field(default_factory=list)
    vram: list = dataclasses.field(default_factory=list)
    ram: list = dataclasses.field(default_factory=list)

    def add(self, var: pulp.LpVariable, seconds: float = 0.0, vram: float = 0.0, ram: float = 0.0) -> None:
        # Python floats: a NumPy scalar on the left would try to broadcast the PuLP variable.
        self.objective.append(float(seconds) / self.scale * var)
        self.vram.append(float(vram) / self.vram_capacity * var)
        self.ram.append(float(ram) / self.ram_capacity * var)


@dataclass
class _Model:
    lp: pulp.LpProblem
    slots: int
    scale: float
    counts: list[np.ndarray]
    starts: list[np.ndarray]
    y: list[list[pulp.LpVariable]]
    z: list[list[pulp.LpVariable]]
    dense: list[pulp.LpVariable | None]
    head: pulp.LpVariable | None

    def placement(self) -> TieredPlacement:
        def chosen(var: pulp.LpVariable | None) -> bool:
            return var is not None and (var.value() or 0.0) > 0.5

        gpu = [int(c[sum(map(chosen, y))]) for c, y in zip(self.counts, self.y)]
        start = [int(d[sum(map(chosen, z))]) for d, z in zip(self.starts, self.z)]
        return TieredPlacement(tuple(gpu), tuple(s - g for s, g in zip(start, gpu)),
                               tuple(chosen(a) for a in self.dense), chosen(self.head), self.slots)


def disk_starts(layer: Layer, batch: int) -> np.ndarray:
    """Where a layer's disk neurons may start: 0, multiples of ``batch``, all its neurons."""
    return np.unique(np.minimum(np.arange(0, layer.n_neurons + batch, batch), layer.n_neurons))


def _add_gpu_side(lp: pulp.LpProblem, rows: _Rows, problem: TieredProblem, index: int, batch: int,
                  z: list[pulp.LpVariable], starts: np.ndarray) -> tuple[np.ndarray, list, pulp.LpVariable, list, list]:
    """Layer ``index``'s dense-block and GPU-count variables; the terms its GPU and CPU sides gain from them."""
    layer = problem.layers[index]
    off = LayerCost.of(problem.base, layer, 0, dense_on_gpu=False)
    counts = allowed_gpu_counts(layer, batch)
    on = LayerCost.of(problem.base, layer, counts, dense_on_gpu=True)
    sync, vram = np.asarray(on.sync_s, dtype=np.float64), np.asarray(on.vram, dtype=np.float64)
    a = lp.add_variable(f"a_{index}", cat=pulp.LpBinary)
    rows.add(a, seconds=on.dense_s - off.dense_s + sync[0], vram=vram[0], ram=-layer.block_bytes)
    y = [lp.add_variable(f"y_{index}_{i}", cat=pulp.LpBinary) for i in range(1, len(counts))]
    gpu_side, cpu_side = [], []
    for i, var in enumerate(y, start=1):
        rows.add(var, seconds=sync[i] - sync[i - 1], vram=vram[i] - vram[i - 1],
                 ram=-(counts[i] - counts[i - 1]) * layer.neuron_bytes)
        gpu_side.append(float(on.ffn_gpu_s[i] - on.ffn_gpu_s[i - 1]) / rows.scale * var)
        cpu_side.append(float(on.ffn_cpu_s[i] - on.ffn_cpu_s[i - 1]) / rows.scale * var)
        lp += z[int(np.searchsorted(starts, counts[i])) - 1] >= var  # z[j - 1] is "s >= starts[j]"
    for wider, narrower in zip([a] + y, y):
        lp += wider >= narrower
    return counts, y, a, gpu_side, cpu_side


def _add_layer(lp: pulp.LpProblem, rows: _Rows, problem: TieredProblem, index: int, slots: int, batch: int,
               curves: CacheCurves):
    """One layer's variables and rows (``curves``: its cache's, over ``disk_starts``); returns (GPU counts,
    y, disk starts, z, a)."""
    layer, starts = problem.layers[index], curves.starts
    disk = problem.disk_seconds(layer, curves.misses([slots])[0])
    ram = starts * layer.neuron_bytes + cache_ram(layer, starts, slots)  # minus the GPU's share, in y
    z = [lp.add_variable(f"z_{index}_{j}", cat=pulp.LpBinary) for j in range(1, len(starts))]
    for j, var in enumerate(z, start=1):
        rows.add(var, ram=ram[j] - ram[j - 1])
    for wider, narrower in itertools.pairwise(z):
        lp += wider >= narrower
    t = lp.add_variable(f"t_{index}", lowBound=0)
    rows.objective.append(t)
    cpu_alone = LayerCost.of(problem.base, layer, 0, dense_on_gpu=False).ffn_cpu_s
    cpu_side = [float(cpu_alone + disk[0]) / rows.scale]  # a constant: fine in a row
    cpu_side += [float(disk[j] - disk[j - 1]) / rows.scale * var for j, var in enumerate(z, start=1)]
    counts, y, a = np.zeros(1, dtype=np.int64), [], None
    if problem.has_gpu:
        counts, y, a, gpu_side, more_cpu = _add_gpu_side(lp, rows, problem, index, batch, z, starts)
        cpu_side += more_cpu
        lp += t >= pulp.lpSum(gpu_side)
    lp += t >= pulp.lpSum(cpu_side)
    return counts, y, starts, z, a


def _constants(problem: TieredProblem, slots: int) -> tuple[float, float]:
    """Seconds per token and RAM bytes with every variable at 0: all on the CPU, every neuron on disk."""
    seconds = sum(LayerCost.of(problem.base, layer, 0, False).dense_s for layer in problem.layers)
    seconds += HeadCost.of(problem.base, False).total_s
    ram = problem.ram_reserve + problem.head_ram(False)
    ram += sum(layer.block_bytes + int(cache_ram(layer, 0, slots)) for layer in problem.layers)
    return seconds, ram


def _build(problem: TieredProblem, slots: int, batch: int, vram_capacity: float, ram_capacity: float,
           curves: list[CacheCurves]) -> _Model:
    """The ILP at ``slots`` cache slots per layer; capacities: bytes the variables may add to each row."""
    n_layers = len(problem.layers)
    scale = predict(problem.base, Placement((0,) * n_layers, (False,) * n_layers, False)).token_s
    constant_s, _ = _constants(problem, slots)
    lp = pulp.LpProblem("tiers", pulp.LpMinimize)
    rows = _Rows(scale, max(vram_capacity, 1.0), max(problem.ram_budget, 1))
    layers = [_add_layer(lp, rows, problem, index, slots, batch, curves[index]) for index in range(n_layers)]
    head = None
    if problem.has_gpu:
        head = lp.add_variable("h", cat=pulp.LpBinary)
        rows.add(head, seconds=HeadCost.of(problem.base, True).total_s - HeadCost.of(problem.base, False).total_s,
                 vram=problem.base.head_bytes, ram=problem.head_ram(True) - problem.head_ram(False))
        lp += pulp.lpSum(rows.vram) <= vram_capacity / rows.vram_capacity, "vram"
    # PuLP drops objective constants on the way to the solvers, whose relative gap must be measured on
    # the whole time per token: the constant rides on a variable fixed at 1 (as in ilp.py).
    rows.objective.append(constant_s / scale * lp.add_variable("constant", lowBound=1, upBound=1))
    lp += pulp.lpSum(rows.objective)
    lp += pulp.lpSum(rows.ram) <= ram_capacity / rows.ram_capacity, "ram"
    counts, y, starts, z, dense = (list(column) for column in zip(*layers))
    return _Model(lp, slots, scale, counts, starts, y, z, dense, head)


def _optimise(model: _Model, name: str, gap_rel: float, time_limit: float) -> tuple[bool, float, str]:
    """Solve ``model``: whether it found a placement, and the bound on its value (seconds) and its kind."""
    bound, kind = float("nan"), ""
    with native_stdout_silenced():
        if name == "cbc":  # CBC does not report its best bound through PuLP: bound with the LP relaxation
            model.lp.solve(make_solver(name, gap_rel, time_limit, mip=False))
            if model.lp.status == pulp.LpStatusOptimal:
                bound, kind = model.scale * model.lp.objective.value(), "LP relaxation"
        model.lp.solve(make_solver(name, gap_rel, time_limit))
    found = model.lp.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if found and name == "highs":
        bound, kind = model.scale * model.lp.solverModel.getInfo().mip_dual_bound, "MIP dual bound"
    return found, bound, kind


@dataclass(frozen=True)
class _Solved:
    placement: TieredPlacement
    value: float
    bound: float
    bound_kind: str
    optimal: bool


def _solve_at(problem: TieredProblem, slots: int, name: str, batch: int, gap_rel: float, time_limit: float,
              curves: list[CacheCurves]) -> _Solved | None:
    """The best placement with ``slots`` cache slots per layer; None when none fits."""
    _, constant_ram = _constants(problem, slots)
    vram_capacity = float(problem.base.budget_bytes - problem.base.reserve_bytes)
    ram_capacity = float(problem.ram_budget - constant_ram)
    while True:
        model = _build(problem, slots, batch, vram_capacity, ram_capacity, curves)
        found, bound, kind = _optimise(model, name, gap_rel, time_limit)
        if not found:
            return None
        placement = model.placement()
        prediction = predict_tiers(problem, placement)
        # The solver works in floating point; the budgets are checked here in whole bytes.
        vram_excess = prediction.vram - problem.base.budget_bytes if problem.has_gpu else 0
        ram_excess = prediction.ram - problem.ram_budget
        if vram_excess <= 0 and ram_excess <= 0:
            break
        vram_capacity -= max(vram_excess, 0)
        ram_capacity -= max(ram_excess, 0)
    optimal = model.lp.sol_status == pulp.LpSolutionOptimal
    return _Solved(placement, prediction.token_s, bound, kind, optimal)


def least_ram_placement(problem: TieredProblem, slots: int, batch: int, solver: str = "auto") -> TieredPlacement:
    """The placement that needs the least RAM at ``slots`` cache slots per layer: every neuron off the GPU on
    disk; with a GPU, as much on it as the VRAM budget holds (a small ILP: one option per layer and GPU count)."""
    n_layers = len(problem.layers)
    if not problem.has_gpu:
        return TieredPlacement((0,) * n_layers, (0,) * n_layers, (False,) * n_layers, False, slots)
    lp = pulp.LpProblem("least_ram", pulp.LpMinimize)
    ram, vram, options = [], [], []
    for index, layer in enumerate(problem.layers):
        choices = [(0, False)] + [(int(c), True) for c in allowed_gpu_counts(layer, batch)]
        picks = [lp.add_variable(f"x_{index}_{k}", cat=pulp.LpBinary) for k in range(len(choices))]
        lp += pulp.lpSum(picks) == 1
        for (g, on_gpu), pick in zip(choices, picks):
            ram.append(float(cache_ram(layer, g, slots) + (0 if on_gpu else layer.block_bytes)) * pick)
            vram.append(float(layer.block_bytes + g * layer.neuron_bytes if on_gpu else 0) * pick)
        options.append((choices, picks))
    head = lp.add_variable("h", cat=pulp.LpBinary)
    lp += pulp.lpSum(ram) + float(problem.head_ram(True) - problem.head_ram(False)) * head
    lp += pulp.lpSum(vram) + float(problem.base.head_bytes) * head <= problem.base.budget_bytes - problem.base.reserve_bytes
    with native_stdout_silenced():
        lp.solve(make_solver(solver_name(solver), 1e-6, 60.0))
    chosen = [choices[int(np.argmax([pick.value() or 0.0 for pick in picks]))] for choices, picks in options]
    return TieredPlacement(tuple(g for g, _ in chosen), (0,) * n_layers, tuple(on for _, on in chosen),
                           (head.value() or 0.0) > 0.5, slots)


def check_ram_budget(problem: TieredProblem, slots: int = MIN_CACHE_SLOTS, batch: int = 64, solver: str = "auto") -> None:
    """PitoolsError naming the minimum when the RAM budget cannot hold even the least-RAM placement."""
    least = predict_tiers(problem, least_ram_placement(problem, slots, batch, solver))
    if problem.ram_budget >= least.ram:
        return
    blocks = sum(layer.dense_ram + layer.kv_ram for layer in least.layers)
    caches = sum(layer.cache_ram for layer in least.layers)
    where = " of the layers not on the GPU (as many are as --vram allows)" if problem.has_gpu else ""
    reserve = f", the {format_size(least.reserve_ram)} reserve" if least.reserve_ram else ""
    raise PitoolsError(
        f"RAM budget {format_size(problem.ram_budget)} is below the minimum, {format_size(least.ram, round_up=True)}: "
        f"the output head and a tied embedding ({format_size(least.head_ram)}), attention, norms, predictors and KV "
        f"caches{where} ({format_size(blocks)}), and neuron caches of {slots} neurons per layer "
        f"({format_size(caches)}){reserve}"
    )


def _grown(problem: TieredProblem, placement: TieredPlacement) -> TieredPlacement:
    """``placement`` with the most cache slots per layer that the RAM budget holds (at least its own)."""
    disk = [layer.n_neurons - g - r for layer, g, r in zip(problem.layers, placement.gpu_neurons,
                                                            placement.ram_neurons)]
    if max(disk) == 0:
        return dataclasses.replace(placement, cache_slots=0)
    prediction = predict_tiers(problem, placement)
    room = problem.ram_budget - prediction.ram + sum(layer.cache_ram for layer in prediction.layers)

    def cache_bytes(slots: int) -> int:
        return sum(min(slots, n) * layer.neuron_bytes for layer, n in zip(problem.layers, disk))

    low, high = placement.cache_slots, max(disk)  # cache_bytes(low) fits; find the most slots that do
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if cache_bytes(middle) <= room else (low, middle - 1)
    return dataclasses.replace(placement, cache_slots=low)


def slot_grid(problem: TieredProblem) -> list[int]:
    """The cache sizes tried first: MIN_CACHE_SLOTS, then x4, below the largest layer's neuron count."""
    largest = max(layer.n_neurons for layer in problem.layers)
    grid = [MIN_CACHE_SLOTS]
    while grid[-1] * 4 < largest:
        grid.append(grid[-1] * 4)
    return grid


def _all_in_ram(problem: TieredProblem, name: str, batch: int, gap_rel: float, time_limit: float) -> _Solved | None:
    """The two-tier optimum (``ilp.solve``; without a GPU, everything on the CPU) with every neuron off the GPU
    resident in RAM, when that fits the RAM budget: then it is the three-tier optimum too, since a neuron on
    disk only adds time. None when it does not fit."""
    n_layers = len(problem.layers)
    gpu, bound, kind, optimal = Placement((0,) * n_layers, (False,) * n_layers, False), None, "", True
    if problem.has_gpu:
        report = ilp.solve(problem.base, "latency", batch=batch, solver=name, gap_rel=gap_rel, time_limit=time_limit)
        gpu, bound, kind = report.placement, report.bound, report.bound_kind
        optimal = report.status == "optimal within gap"
    ram = tuple(layer.n_neurons - g for layer, g in zip(problem.layers, gpu.gpu_neurons))
    placement = TieredPlacement(gpu.gpu_neurons, ram, gpu.dense_on_gpu, gpu.head_on_gpu, 0)
    prediction = predict_tiers(problem, placement)
    if prediction.ram > problem.ram_budget:
        return None
    if bound is None:  # nothing is faster without a GPU than everything in RAM
        bound, kind = prediction.token_s, "everything in RAM"
    return _Solved(placement, prediction.token_s, bound, kind, optimal)


def _search_cache_sizes(problem: TieredProblem, grid: list[int], refine: bool, name: str, batch: int,
                        gap_rel: float, share: float) -> tuple[_Solved | None, dict[int, _Solved | None]]:
    """The best placement over the cache sizes of ``grid`` (then the halves and doubles of the best, if
    ``refine``), each solved in ``share`` seconds at most."""
    curves = [CacheCurves(layer.freqs, disk_starts(layer, batch)) for layer in problem.layers]
    tried: dict[int, _Solved | None] = {}
    for size in grid:
        tried[size] = _solve_at(problem, size, name, batch, gap_rel, share, curves)
    best = _best(tried)
    if refine and best is not None:
        largest = max(layer.n_neurons for layer in problem.layers)
        for size in (best.placement.cache_slots // 2, best.placement.cache_slots * 2):
            if MIN_CACHE_SLOTS <= size <= largest and size not in tried:
                tried[size] = _solve_at(problem, size, name, batch, gap_rel, share, curves)
        best = _best(tried)
    return best, tried


def solve_tiers(problem: TieredProblem, *, batch: int = 64, solver: str = "auto", gap_rel: float = 0.005,
                time_limit: float = 60.0, slots: list[int] | None = None, grow_cache: bool = True) -> TierSolveReport:
    """Place every neuron on the GPU, in RAM or on disk, to minimise the predicted time per token within both
    budgets. ``slots``: the cache sizes to try (per layer) instead of the default search (see above)."""
    if problem.has_gpu:
        check_budget(problem.base)
    name = solver_name(solver)
    grid = list(slots) if slots else slot_grid(problem)
    check_ram_budget(problem, min(grid), batch, name)
    start = time.perf_counter()
    share = time_limit / (len(grid) + (0 if slots else 2) + problem.has_gpu)
    best, tried = _all_in_ram(problem, name, batch, gap_rel, share), {}
    if best is None:
        best, tried = _search_cache_sizes(problem, grid, not slots, name, batch, gap_rel, share)
    if best is None:
        raise PitoolsError(f"three-tier placement: {name} found no placement within the budgets in "
                           f"{time_limit:g} s; raise --time-limit")
    placement = _grown(problem, best.placement) if grow_cache else best.placement
    return TierSolveReport(
        placement=placement,
        prediction=predict_tiers(problem, placement),
        solver=name,
        status="optimal within gap" if best.optimal else "stopped at time limit",
        seconds=time.perf_counter() - start,
        value=best.value,
        bound=best.bound,
        bound_kind=best.bound_kind,
        slots_tried={size: None if solved is None else solved.value for size, solved in sorted(tried.items())},
    )


def _best(tried: dict[int, _Solved | None]) -> _Solved | None:
    found = [solved for solved in tried.values() if solved is not None]
    return min(found, key=lambda solved: solved.value) if found else None
