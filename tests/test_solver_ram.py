"""Three-tier placement (`pitools solve --ram`): the neuron cache's miss model against a simulated LRU, the
ILP against exhaustive search, the split file's RAM tier, and the command line."""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest
from cli_checks import fails, invoke
from powerinfer_tools.formats.gpu_split import GpuSplit, read_gpu_split, write_gpu_split
from powerinfer_tools.solver import ilp
from powerinfer_tools.solver.cache_model import expected_misses
from powerinfer_tools.solver.hardware import HardwareProfile, save_profile
from powerinfer_tools.solver.problem import HeadCost, problem_from_stats
from powerinfer_tools.solver.split import tiered_split_file
from powerinfer_tools.solver.tier_ilp import least_ram_placement, solve_tiers
from powerinfer_tools.solver.tiers import (
    DEFAULT_DISK,
    TieredPlacement,
    TieredProblem,
    TierLayerCost,
    TierPrediction,
    bundle_bytes,
    predict_tiers,
    tiered_problem,
)

from powerinfer_tools.errors import PitoolsError
from solver_instances import random_stats

# GPU 10x the CPU's bandwidth; a disk read costs tens of neurons' CPU time, as on real machines.
TEST_HW = HardwareProfile("test", gpu_bandwidth_gbs=100.0, cpu_bandwidth_gbs=10.0, pcie_bandwidth_gbs=10.0,
                          sync_latency_us=1.0, disk_read_gbs=1.0, disk_latency_us=50.0, disk_iops=50_000.0)


def random_tiered(rng, n_layers: int, n_ff: int, has_gpu: bool, min_gpu_share=None) -> TieredProblem:
    """A VRAM budget between its minimum and all the model; a RAM budget that binds: between the least RAM
    any placement needs and what the two-tier optimum needs with every neuron off the GPU in RAM."""
    stats = random_stats(rng, n_layers, n_ff)
    base = problem_from_stats(**stats, n_ctx=32, budget_bytes=0, hardware=TEST_HW, reserve_bytes=1_000,
                              min_gpu_share=min_gpu_share)
    everything = sum(l.block_bytes + l.n_neurons * l.neuron_bytes for l in base.layers) + base.head_bytes
    if has_gpu:
        smallest = min(min(l.block_bytes for l in base.layers), base.head_bytes)
        base = dataclasses.replace(base, budget_bytes=int(rng.uniform(0.15, 0.7) * everything) + 1_000 + smallest)
    problem = tiered_problem(base, 0, has_gpu=has_gpu, embedding_bytes=int(rng.integers(1_000, 20_000)))
    least = predict_tiers(problem, least_ram_placement(problem, slots=1, batch=1)).ram
    two = ilp.solve(base, batch=1).placement if has_gpu else None
    gpu = two.gpu_neurons if has_gpu else (0,) * n_layers
    all_in_ram = TieredPlacement(gpu, tuple(n_ff - g for g in gpu), two.dense_on_gpu if has_gpu else (False,) * n_layers,
                                 has_gpu and two.head_on_gpu, 0)
    most = predict_tiers(problem, all_in_ram).ram
    return dataclasses.replace(problem, ram_budget=int(least + rng.uniform(0.2, 0.95) * (most - least)))


# --- the neuron cache's misses against a simulation of the runtime's cache --------------------------------


def simulated_hit_rate(p: np.ndarray, slots: int, tokens: int, rng) -> float:
    """One layer's cache as runtime/neuron_cache.py runs it: each token the firing neurons are asked for
    at once; hits are protected for the step; misses fill empty slots first, then those used longest ago
    (ties at random); misses beyond the free slots are loaded in chunks, each chunk a new step."""
    holder, last, slot_of = np.full(slots, -1), np.full(slots, -1), np.full(len(p), -1)
    clock, hits, asked = 0, 0, 0
    for token in range(tokens):
        fired = np.flatnonzero(rng.random(len(p)) < p)
        clock += 1
        resident = slot_of[fired] >= 0
        last[slot_of[fired[resident]]] = clock
        if token >= tokens // 5:  # after warm-up
            hits, asked = hits + resident.sum(), asked + len(fired)
        missing = fired[~resident]
        while len(missing):
            free = np.flatnonzero(last < clock)
            take, missing = missing[: len(free)], missing[len(free):]
            victims = free[np.argsort(last[free] + rng.random(len(free)) / 2)[: len(take)]]
            slot_of[holder[victims][holder[victims] >= 0]] = -1
            holder[victims], slot_of[take], last[victims] = take, victims, clock
            clock += len(missing) > 0
    return hits / asked


@pytest.mark.parametrize("kind", ["skewed", "cold", "mixed", "hot"])
@pytest.mark.parametrize("tokens_held", [1.0, 1.5, 3.0, 8.0])
def test_expected_misses_match_a_simulated_lru(kind, tokens_held):
    rng = np.random.default_rng(len(kind))
    p = {"skewed": lambda: rng.uniform(0, 1, 400) ** 3 * 0.5,
         "cold": lambda: rng.uniform(0.001, 0.05, 1500),
         "mixed": lambda: np.concatenate([rng.uniform(0, 1, 200) ** 2 * 0.4, rng.uniform(0, 0.02, 1000)]),
         "hot": lambda: rng.uniform(0, 1, 300) ** 0.5}[kind]()
    slots = min(int(tokens_held * p.sum()), len(p) - 1)  # a cache that holds about this many tokens' firings
    simulated = simulated_hit_rate(p, slots, 2500, rng)
    predicted = 1 - expected_misses(p, [0], [slots])[0, 0] / p.sum()
    assert predicted == pytest.approx(simulated, rel=0.06, abs=0.002)


def test_expected_misses_of_every_suffix_at_once():
    rng = np.random.default_rng(0)
    p = np.sort(rng.uniform(0, 1, 300) ** 3)[::-1]
    starts, slots = np.array([0, 10, 100, 250, 290, 300]), np.array([1, 16, 64, 200])
    together = expected_misses(p, starts, slots)
    for a, size in enumerate(slots):
        for b, start in enumerate(starts):
            alone = expected_misses(p[start:], [0], [size])[0, 0]
            assert together[a, b] == pytest.approx(alone, rel=1e-9, abs=1e-12)
    assert np.all(np.diff(together, axis=0) <= 1e-12)  # more slots, fewer misses
    assert together[:, -1].tolist() == [0.0] * 4  # no neuron, no miss
    assert expected_misses(p[:5], [0], [5])[0, 0] == 0.0  # a slot for every neuron: no miss after warm-up
    assert expected_misses(np.zeros(10), [0], [2])[0, 0] == 0.0


# --- the cost model ---------------------------------------------------------------------------------------


def test_a_layer_by_hand():
    # 4 neurons of 1000 bytes: 1 on the GPU, 1 in RAM, 2 on disk behind a 1-slot cache.
    base = problem_from_stats([[0.9, 0.5, 0.2, 0.1]], neuron_bytes=1000, dense_bytes=3000, predictor_bytes=1000,
                              kv_bytes_per_token=10, head_bytes=2000, hidden_bytes=500, n_ctx=100,
                              budget_bytes=10**6, hardware=TEST_HW, reserve_bytes=0, min_gpu_share=0)
    problem = tiered_problem(base, 10**6, has_gpu=True, embedding_bytes=700)
    cost = predict_tiers(problem, TieredPlacement((1,), (1,), (True,), False, cache_slots=1))
    layer = cost.layers[0]
    misses = expected_misses(problem.layers[0].freqs, [2], [1])[0, 0]
    assert 0 < misses < 0.3  # 0.2 + 0.1 fire per token; a slot saves some
    assert layer.disk_s == pytest.approx(misses * 20e-6 + (1 - np.exp(-misses)) * 50e-6)  # 4 KiB at 50k/s
    assert layer.base.ffn_cpu_s == pytest.approx((0.5 + 0.2 + 0.1) * 1000 / 10e9)
    assert layer.total_s == pytest.approx(layer.base.dense_s + max(0.9e3 / 100e9, layer.ffn_cpu_s) + layer.base.sync_s)
    assert layer.disk_read_bytes == pytest.approx(misses * 4096)
    assert (layer.ram, cost.head_ram) == (1000 + 1000, 2000)  # a RAM neuron, a slot; the head (embedding rows: read)
    tied = dataclasses.replace(problem, embedding_in_head=True)
    assert (tied.head_ram(False), tied.head_ram(True)) == (2000, 700)  # the head's matrix; the rows looked up
    assert cost.vram == 4000 + 1000 + 1000
    assert cost.cache_hit_rate == pytest.approx(1 - misses / 0.3)
    assert bundle_bytes(4096) == 4096 and bundle_bytes(4097) == 8192


def test_disk_figures_missing_from_the_profile_are_the_documented_defaults():
    problem = random_tiered(np.random.default_rng(0), 2, 4, has_gpu=False)
    assert problem.disk.defaulted == ()
    bare = dataclasses.replace(TEST_HW, disk_read_gbs=None, disk_iops=None)
    defaulted = tiered_problem(dataclasses.replace(problem.base, hardware=bare), 10**6, has_gpu=False)
    assert defaulted.disk.defaulted == ("disk_read_gbs", "disk_iops")
    assert (defaulted.disk.read_gbs, defaulted.disk.latency_us, defaulted.disk.iops) == (
        DEFAULT_DISK["disk_read_gbs"], 50.0, DEFAULT_DISK["disk_iops"])


# --- the ILP against exhaustive search ------------------------------------------------------------------------


def exhaustive_over_prefixes(problem: TieredProblem, slot_sizes) -> float:
    """The least time per token over every placement the ILP may choose from (batch 1) and ``slot_sizes``,
    each priced by the same layer costs ``predict_tiers`` sums."""
    heads = (False, True) if problem.has_gpu else (False,)
    best = np.inf
    for slots in slot_sizes:
        per_layer = []
        for layer in problem.layers:
            n = layer.n_neurons
            options = [(0, s, False) for s in range(n + 1)]
            if problem.has_gpu:
                counts = sorted({0, n} | set(range(max(1, layer.min_gpu_neurons), n + 1)))
                options += [(g, s, True) for g in counts for s in range(g, n + 1)]
            per_layer.append([TierLayerCost.of(problem, layer, g, s - g, on, slots) for g, s, on in options])
        for *layers, head in itertools.product(*per_layer, heads):
            cost = TierPrediction(tuple(layers), HeadCost.of(problem.base, head),
                                  problem.base.reserve_bytes if problem.has_gpu else 0, problem.head_ram(head),
                                  problem.ram_reserve, slots)
            fits = cost.ram <= problem.ram_budget and (not problem.has_gpu or cost.vram <= problem.base.budget_bytes)
            if fits:
                best = min(best, cost.token_s)
    return best


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("has_gpu", [True, False])
def test_tier_ilp_finds_the_exhaustive_optimum(seed, has_gpu):
    rng = np.random.default_rng(seed)
    problem = random_tiered(rng, n_layers=3, n_ff=4 if has_gpu else 5, has_gpu=has_gpu,
                            min_gpu_share=[None, 0.0, 0.5][seed % 3])
    slot_sizes = [1, 2, 3]
    report = solve_tiers(problem, batch=1, gap_rel=0.0, slots=slot_sizes, grow_cache=False)
    assert report.slots_tried  # the three-tier ILP ran: the two-tier optimum does not fit the RAM budget
    assert report.value == pytest.approx(exhaustive_over_prefixes(problem, slot_sizes), rel=1e-5)
    assert report.prediction.token_s == pytest.approx(report.value)
    assert report.prediction.ram <= problem.ram_budget
    assert not has_gpu or report.prediction.vram <= problem.base.budget_bytes
    assert has_gpu or (not any(report.placement.dense_on_gpu) and not any(report.placement.gpu_neurons))


def test_leftover_ram_goes_to_the_cache():
    problem = random_tiered(np.random.default_rng(11), n_layers=4, n_ff=200, has_gpu=False)
    solved = solve_tiers(problem, batch=8, slots=[16], grow_cache=False)
    grown = solve_tiers(problem, batch=8, slots=[16])
    assert grown.placement.gpu_neurons == solved.placement.gpu_neurons
    assert grown.placement.ram_neurons == solved.placement.ram_neurons
    assert grown.placement.cache_slots >= solved.placement.cache_slots
    assert grown.prediction.token_s <= solved.prediction.token_s * (1 + 1e-12)
    assert grown.prediction.ram <= problem.ram_budget
    one_more = dataclasses.replace(grown.placement, cache_slots=grown.placement.cache_slots + 1)
    disk = [l.n_neurons - g - r for l, g, r in zip(problem.layers, grown.placement.gpu_neurons,
                                                   grown.placement.ram_neurons)]
    assert grown.placement.cache_slots >= max(disk) or predict_tiers(problem, one_more).ram > problem.ram_budget


def test_with_ample_ram_the_three_tiers_are_the_two():
    """Every neuron fits in RAM: the two-tier optimum, and nothing read from disk (neurons that never fire,
    or a cache that holds them all, may still be on disk: at no cost)."""
    problem = random_tiered(np.random.default_rng(4), n_layers=4, n_ff=64, has_gpu=True)
    ample = dataclasses.replace(problem, ram_budget=10**9)
    two = ilp.solve(problem.base, batch=8, gap_rel=0.0)
    three = solve_tiers(ample, batch=8, gap_rel=0.0)
    assert three.prediction.token_s == pytest.approx(two.prediction.token_s, rel=1e-6)
    assert three.prediction.disk_read_bytes == 0 and three.slots_tried == {}  # no cache size to search


def test_the_default_search_tries_cache_sizes_and_refines_around_the_best():
    problem = random_tiered(np.random.default_rng(2), n_layers=3, n_ff=600, has_gpu=False)
    report = solve_tiers(problem, batch=32)
    best = min(v for v in report.slots_tried.values() if v is not None)
    assert set(report.slots_tried) >= {16, 64, 256} and len(report.slots_tried) <= 5  # x4, then x2 around the best
    assert report.value == best


def test_a_ram_budget_below_the_minimum_says_what_the_minimum_is():
    problem = random_tiered(np.random.default_rng(1), n_layers=3, n_ff=40, has_gpu=False)
    blocks = sum(l.block_bytes for l in problem.layers)
    caches = sum(16 * l.neuron_bytes for l in problem.layers)
    minimum = blocks + caches + problem.head_ram(False)
    with pytest.raises(PitoolsError, match=r"RAM budget .* is below the minimum, .*: the output head and a "
                                           r"tied embedding .* neuron caches of 16 neurons per layer"):
        solve_tiers(dataclasses.replace(problem, ram_budget=minimum - 1), batch=8)
    report = solve_tiers(dataclasses.replace(problem, ram_budget=minimum), batch=8)
    assert report.prediction.ram == minimum and report.placement.ram_neurons == (0, 0, 0)


def test_with_a_gpu_the_minimum_counts_what_the_gpu_takes():
    problem = random_tiered(np.random.default_rng(6), n_layers=3, n_ff=8, has_gpu=True, min_gpu_share=0.0)
    problem = dataclasses.replace(problem, embedding_in_head=True)  # its embeddings stay in RAM for the lookups
    everything = sum(l.block_bytes + l.n_neurons * l.neuron_bytes for l in problem.layers) + problem.base.head_bytes
    whole_gpu = dataclasses.replace(problem, base=dataclasses.replace(problem.base, budget_bytes=10**9),
                                    ram_budget=problem.head_ram(True))  # the embeddings alone
    report = solve_tiers(whole_gpu, batch=1)
    assert report.prediction.ram == problem.head_ram(True) and report.prediction.vram == everything + 1_000
    with pytest.raises(PitoolsError, match="below the minimum.*as many are as --vram allows"):
        solve_tiers(dataclasses.replace(whole_gpu, ram_budget=problem.head_ram(True) - 1), batch=1)


# --- the split file's RAM tier ----------------------------------------------------------------------------------


def test_split_file_round_trip_with_a_ram_tier(tmp_path):
    masks = (np.array([1, 0, 0, 1, 0], bool), np.zeros(5, bool), np.ones(5, bool))
    ram = (np.array([0, 1, 0, 0, 1], bool), np.zeros(5, bool), np.zeros(5, bool))
    path = tmp_path / "m.gguf.generated.gpuidx"
    write_gpu_split(path, GpuSplit(masks, 4096, ram_masks=ram, ram_budget=10**9, cache_bytes=123_456,
                                   notes={"pitools.ram_used": 99}))
    back = read_gpu_split(path)
    assert (back.ram_budget, back.cache_bytes, back.notes) == (10**9, 123_456, {"pitools.ram_used": 99})
    for mine, theirs in zip(ram, back.ram_masks):
        np.testing.assert_array_equal(mine, theirs)
    assert back.extra["pitools.blk.0.ram_neurons"].tolist() == [1, 4] and "pitools.blk.1.ram_neurons" not in back.extra
    write_gpu_split(path, GpuSplit(masks, 4096))
    plain = read_gpu_split(path)
    assert (plain.ram_masks, plain.ram_budget, plain.cache_bytes) == (None, None, None)


@pytest.mark.parametrize("ids, message", [
    ([3, 1], "not a sorted list of distinct neuron ids below 5"),
    ([1, 7], "not a sorted list of distinct neuron ids below 5"),
    ([0, 1], "names neurons that are also on the GPU"),
])
def test_a_bad_ram_tier_is_refused(tmp_path, ids, message):
    path = tmp_path / "bad.gpuidx"
    split = GpuSplit((np.array([1, 0, 0, 0, 0], bool),), 0, ram_budget=1, notes={"pitools.blk.0.ram_neurons": ids})
    write_gpu_split(path, split)
    with pytest.raises(PitoolsError, match=f"{path}: pitools.blk.0.ram_neurons .*{message}"):
        read_gpu_split(path)
    with pytest.raises(ValueError, match="none of its neurons"):
        GpuSplit((np.ones(2, bool),), 0, ram_masks=(np.ones(2, bool),), ram_budget=1)


def test_the_split_of_a_placement_puts_the_hottest_on_the_gpu_then_in_ram():
    problem = random_tiered(np.random.default_rng(8), n_layers=3, n_ff=50, has_gpu=True, min_gpu_share=0.0)
    report = solve_tiers(problem, batch=5)
    split = tiered_split_file(problem, report.placement, "blake2b:x")
    for layer, gpu, ram, freq in zip(problem.layers, split.masks, split.ram_masks, problem.base.layers):
        on_disk = ~(gpu | ram)
        f = np.empty(layer.n_neurons)
        f[freq.order] = freq.freqs
        assert f[gpu].min(initial=1) >= f[ram].max(initial=0) and f[ram].min(initial=1) >= f[on_disk].max(initial=0)
    assert [int(m.sum()) for m in split.ram_masks] == list(report.placement.ram_neurons)
    assert split.cache_bytes == report.placement.cache_slots * sum(l.neuron_bytes for l in problem.layers)
    assert split.vram_budget == problem.base.budget_bytes and split.ram_budget == problem.ram_budget


# --- command line -------------------------------------------------------------------------------------------------


def test_solve_needs_a_budget():
    result = invoke("solve", "m.powerinfer.gguf")
    assert result.exit_code == 2 and "give a budget: --vram SIZE (GPU memory), --ram SIZE" in result.stderr


@pytest.fixture
def stats_file(tmp_path):
    stats = random_stats(np.random.default_rng(5), n_layers=4, n_ff=256)
    np.savez(tmp_path / "stats.npz", **stats, embedding_bytes=50_000, embedding_in_head=0)
    hw = tmp_path / "hw.toml"
    save_profile(TEST_HW, hw)
    return tmp_path / "stats.npz", hw


def test_solve_ram_with_and_without_vram_from_stats(stats_file, tmp_path):
    stats, hw = stats_file
    out = tmp_path / "m.gpuidx"
    common = ["solve", "--stats", stats, "-o", out, "--hardware", hw, "--ctx-size", "64", "--force", "--batch", "16"]
    result = invoke(*common, "--ram", "4MiB", "--vram", "600KiB", "--reserve", "1KB", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)["placement"]
    assert summary["vram_bytes"]["total"] <= 600 * 1024 and summary["ram_bytes"]["total"] <= 4 * 2**20
    assert set(summary["ram_bytes"]) == {"reserve", "embeddings_and_head", "dense", "kv_cache", "ffn", "cache", "total"}
    split = read_gpu_split(out)
    assert split.ram_budget == 4 * 2**20 and split.vram_budget == 600 * 1024
    assert [int(m.sum()) for m in split.ram_masks] == [layer["ram_neurons"] for layer in summary["layers"]]
    cpu_only = invoke(*common, "--ram", "4MiB")
    assert cpu_only.exit_code == 0, cpu_only.stderr
    assert "three tiers" in cpu_only.stdout and "read from disk per token" in cpu_only.stdout
    assert "cache hit rate" in cpu_only.stdout and "hardware profile has no" not in cpu_only.stdout
    split = read_gpu_split(out)
    assert split.vram_budget is None and not any(m.any() for m in split.masks) and split.vram_capacity == 0


def test_solve_ram_refusals(stats_file, tmp_path):
    stats, _ = stats_file
    out = tmp_path / "m.gpuidx"
    fails("solve", "--stats", stats, "-o", out, "--ram", "100KB", match="RAM budget 97.66 KiB is below the minimum")
    fails("solve", "--stats", stats, "-o", out, "--ram", "1GB", "--objective", "activations",
          match="--objective activations places the GPU alone; with --ram the objective is latency")
    fails("solve", "--stats", stats, "-o", out, "--ram", "0GB", match="--ram: 0 bytes is too small")
    assert not out.exists()


def test_solve_ram_alone_on_a_model_file(small_powerinfer_file, tmp_path):
    model = tmp_path / "m.powerinfer.gguf"
    model.symlink_to(small_powerinfer_file)
    result = invoke("solve", model, "--ram", "1GiB", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["budget_bytes"] is None and summary["disk"]["defaulted"]  # rtx4090 has no disk figures
    placement = summary["placement"]
    assert placement["tokens_per_s"] > 0 and placement["disk_bytes_per_token"] == 0  # everything fits in RAM
    assert placement["ram_bytes"]["embeddings_and_head"] > 0
    split = read_gpu_split(model.with_name(model.name + ".generated.gpuidx"))
    assert split.ram_budget == 2**30 and all(m.all() for m in split.ram_masks) and not any(m.any() for m in split.masks)
    tight = invoke("solve", model, "--ram", f"{placement['ram_bytes']['total'] - placement['ram_bytes']['ffn'] + 20_000}B",
                   "--force")
    assert tight.exit_code == 0, tight.stderr
    assert "slow SSD" in tight.stdout and "read from disk per token" in tight.stdout
