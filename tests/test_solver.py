"""The placement solver: sizes, profiles, cost model, ILP against exhaustive search, split files, CLI."""

from __future__ import annotations

import dataclasses
import itertools
import json
import struct

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from powerinfer_tools.formats.gpu_split import GpuSplit, read_gpu_split, write_gpu_split
from powerinfer_tools.solver import ilp
from powerinfer_tools.solver.hardware import (
    PRESETS,
    HardwareProfile,
    load_profile,
    save_profile,
)
from powerinfer_tools.solver.problem import (
    Placement,
    PlacementProblem,
    predict,
    problem_from_stats,
)
from powerinfer_tools.solver.summary import (
    layer_granular_placement,
    summary_dict,
    summary_text,
)

from powerinfer_tools.commands.solve import probe, solve
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.units import parse_size
from solver_instances import random_stats

# GPU 10x the CPU's bandwidth, and a sync cost comparable to a small layer's time.
TEST_HW = HardwareProfile("test", gpu_bandwidth_gbs=100.0, cpu_bandwidth_gbs=10.0, pcie_bandwidth_gbs=10.0,
                          sync_latency_us=1.0)


def random_problem(rng, n_layers, n_ff, min_gpu_share=None) -> PlacementProblem:
    stats = random_stats(rng, n_layers, n_ff)
    everything = problem_from_stats(**stats, n_ctx=32, budget_bytes=0, hardware=TEST_HW, reserve_bytes=1_000)
    total = sum(l.block_bytes + l.n_neurons * l.neuron_bytes for l in everything.layers)
    budget = int(rng.uniform(0.15, 0.9) * total + everything.head_bytes) + everything.reserve_bytes
    return problem_from_stats(**stats, n_ctx=32, budget_bytes=budget, hardware=TEST_HW, reserve_bytes=1_000,
                              min_gpu_share=min_gpu_share)


# --- sizes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, nbytes", [
    ("11GB", 11 * 10**9), ("11GiB", 11 * 2**30), ("11000MB", 11 * 10**9), ("0.5TB", 5 * 10**11),
    ("1.5g", 15 * 10**8), ("1.5G", 15 * 10**8), ("2m", 2 * 10**6), ("0.3kB", 300), ("512MiB", 2**29),
    (" 2 gb ", 2 * 10**9), ("4096B", 4096),
])
def test_sizes_are_parsed_by_the_documented_rules(text, nbytes):
    """One rule: K, M, G, T alone or with B are powers of 1000; with i, of 1024."""
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["11", "11 gigs", "-1GB", "GB", "1e9B", "", "1.2.3GB", "11Gbit", "inf"])
def test_unreadable_sizes_are_rejected_with_the_accepted_forms(text):
    with pytest.raises(PitoolsError, match=r"--vram: cannot read .* 11GiB .* GiB = 2\^30"):
        parse_size(text, "--vram")


# --- hardware profiles ------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_profiles_round_trip_through_files(tmp_path, suffix):
    path = tmp_path / f"hw{suffix}"
    save_profile(PRESETS["h200"], path)
    assert load_profile(str(path)) == PRESETS["h200"]
    assert load_profile("rtx2080ti") == PRESETS["rtx2080ti"]


_REST = 'cpu_bandwidth_gbs = 1\npcie_bandwidth_gbs = 1\nsync_latency_us = 1\n'


@pytest.mark.parametrize("text, message", [
    ('gpu_bandwidth_gbs = 1\n', "no cpu_bandwidth_gbs"),
    ('gpu_bandwidth_gbs = 1\ncolour = "red"\n' + _REST, "unknown key colour"),
    ('gpu_bandwidth_gbs = "fast"\n' + _REST, "gpu_bandwidth_gbs must be a float"),
    ('gpu_bandwidth_gbs = 0\n' + _REST, "gpu_bandwidth_gbs must be positive"),
])
def test_bad_profiles_are_rejected(tmp_path, text, message):
    path = tmp_path / "hw.toml"
    path.write_text('name = "x"\n' + text)
    with pytest.raises(PitoolsError, match=message):
        load_profile(str(path))


# --- cost model ------------------------------------------------------------------------------------


def test_cost_model_by_hand():
    # One layer of 4 neurons, 1000 bytes each; GPU 100 GB/s, CPU 10 GB/s.
    problem = problem_from_stats([[0.1, 0.9, 0.0, 0.5]], neuron_bytes=1000, dense_bytes=3000, predictor_bytes=1000,
                                 kv_bytes_per_token=10,
                                 head_bytes=2000, hidden_bytes=500, n_ctx=100, budget_bytes=10**6,
                                 hardware=TEST_HW, reserve_bytes=0, min_gpu_share=0)
    cost = predict(problem, Placement(gpu_neurons=(2,), dense_on_gpu=(True,), head_on_gpu=False))
    layer = cost.layers[0]
    assert layer.ffn_gpu_s == pytest.approx((0.9 + 0.5) * 1000 / 100e9)  # the two hottest neurons
    assert layer.ffn_cpu_s == pytest.approx(0.1 * 1000 / 10e9)
    assert layer.dense_s == pytest.approx((4000 + 1000 / 2) / 100e9)  # KV cache read at half fill
    assert layer.sync_s == pytest.approx(1e-6 + 2 * 500 / 10e9)
    assert cost.head.total_s == pytest.approx(2000 / 10e9)
    assert cost.token_s == pytest.approx(layer.dense_s + layer.ffn_gpu_s + layer.sync_s + cost.head.total_s)
    assert cost.vram == 4000 + 1000 + 2 * 1000
    whole = predict(problem, Placement(gpu_neurons=(4,), dense_on_gpu=(True,), head_on_gpu=True))
    assert whole.layers[0].sync_s == 0 and whole.layers[0].ffn_cpu_s == 0
    np.testing.assert_array_equal(
        Placement((2,), (True,), False).gpu_mask(problem, 0), [False, True, False, True])


# --- the ILP against exhaustive search ----------------------------------------------------------------


def exhaustive_over_prefixes(problem: PlacementProblem, objective: str) -> float:
    """The best value over every placement the ILP may choose from, with batch = 1."""
    per_layer = []
    for layer in problem.layers:
        options = [(0, False), (0, True)]
        options += [(k, True) for k in range(max(1, layer.min_gpu_neurons), layer.n_neurons + 1)]
        options.append((layer.n_neurons, True))
        per_layer.append(sorted(set(options)))
    best = None
    for choice in itertools.product(*per_layer, (False, True)):
        *layers, head = choice
        placement = Placement(tuple(k for k, _ in layers), tuple(a for _, a in layers), head)
        cost = predict(problem, placement)
        if cost.vram > problem.budget_bytes:
            continue
        value = cost.token_s if objective == "latency" else -cost.gpu_read_bytes
        best = value if best is None else min(best, value)
    return abs(best)


@pytest.mark.parametrize("objective", ilp.OBJECTIVES)
@pytest.mark.parametrize("seed", range(6))
def test_ilp_finds_the_exhaustive_optimum(objective, seed):
    rng = np.random.default_rng(seed)
    problem = random_problem(rng, n_layers=3, n_ff=5, min_gpu_share=[None, 0.0, 0.4][seed % 3])
    report = ilp.solve(problem, objective, batch=1, gap_rel=0.0)
    # 1e-5: the solvers' own tolerances are about 1e-6 of an objective scaled to about 1, and
    # near-ties between placements are that close on instances this small.
    assert report.value == pytest.approx(exhaustive_over_prefixes(problem, objective), rel=1e-5)
    assert report.prediction.vram <= problem.budget_bytes
    assert report.gap <= 1e-5


def independent_cost(problem: PlacementProblem, freqs: np.ndarray, stats: dict, subsets, dense, head):
    """Time per token and GPU bytes read for arbitrary GPU neuron sets, straight from the model's
    definition (not through ``predict``)."""
    hw, seconds, gpu_read, vram = problem.hardware, 0.0, 0.0, problem.reserve_bytes
    gpu, cpu = hw.gpu_bandwidth_gbs * 1e9, hw.cpu_bandwidth_gbs * 1e9
    for f, s, a, layer in zip(freqs, subsets, dense, problem.layers):
        nb = layer.neuron_bytes
        dense_read = layer.dense_bytes + layer.predictor_bytes + layer.kv_bytes / 2
        split = (a or s.any()) and (not a or not s.all())
        seconds += dense_read / (gpu if a else cpu) + max(f[s].sum() * nb / gpu, f[~s].sum() * nb / cpu)
        seconds += (hw.sync_latency_us * 1e-6 + 2 * stats["hidden_bytes"] / (hw.pcie_bandwidth_gbs * 1e9)) * split
        gpu_read += f[s].sum() * nb + dense_read * a
        vram += s.sum() * nb + (layer.dense_bytes + layer.predictor_bytes + layer.kv_bytes) * a
    seconds += problem.head_bytes / (gpu if head else cpu)
    return seconds, gpu_read + problem.head_bytes * head, vram + problem.head_bytes * head


@pytest.mark.parametrize("seed", range(3))
def test_a_hot_prefix_is_as_good_as_any_neuron_set(seed):
    """Over all subsets, not just prefixes: equal for activations; for latency the best prefix
    is within one hot neuron's GPU time per layer of the best set (see ilp's docstring)."""
    rng = np.random.default_rng(100 + seed)
    stats = random_stats(rng, n_layers=2, n_ff=4)
    budget = int(rng.uniform(0.3, 0.8) * 150_000)
    problem = problem_from_stats(**stats, n_ctx=32, budget_bytes=budget, hardware=TEST_HW, reserve_bytes=1_000,
                                 min_gpu_share=0.0)
    masks = [np.array(bits, dtype=bool) for bits in itertools.product((False, True), repeat=4)]
    per_layer = [[(m, a) for a in (False, True) for m in masks if a or not m.any()] for _ in range(2)]
    best_s, best_read = np.inf, 0.0
    for (s0, a0), (s1, a1), head in itertools.product(*per_layer, (False, True)):
        seconds, read, vram = independent_cost(problem, stats["freqs"], stats, [s0, s1], [a0, a1], head)
        if vram <= budget:
            best_s, best_read = min(best_s, seconds), max(best_read, read)
    latency = ilp.solve(problem, "latency", batch=1, gap_rel=0.0)
    activations = ilp.solve(problem, "activations", batch=1, gap_rel=0.0)
    assert activations.value == pytest.approx(best_read, rel=1e-5)
    slack = sum(l.freqs[0] * l.neuron_bytes / 100e9 for l in problem.layers)
    assert best_s * (1 - 1e-5) <= latency.value <= best_s * (1 + 1e-5) + slack


def test_larger_instances_respect_the_budget_and_cbc_agrees():
    rng = np.random.default_rng(7)
    for _ in range(3):
        problem = random_problem(rng, n_layers=6, n_ff=300)
        report = ilp.solve(problem, "latency", batch=16, gap_rel=1e-4)
        assert report.prediction.vram <= problem.budget_bytes
        assert report.prediction.token_s == pytest.approx(report.value)
        cbc = ilp.solve(problem, "latency", batch=16, gap_rel=1e-4, solver="cbc")
        assert cbc.value == pytest.approx(report.value, rel=3e-4)
        assert cbc.bound_kind == "LP relaxation" and cbc.bound <= cbc.value * (1 + 1e-9)


def test_a_budget_below_the_minimum_says_what_the_minimum_is():
    problem = random_problem(np.random.default_rng(1), n_layers=3, n_ff=5)
    unit = min(min(l.block_bytes for l in problem.layers), problem.head_bytes)
    minimum = problem.reserve_bytes + unit
    too_small = dataclasses.replace(problem, budget_bytes=minimum - 1)
    with pytest.raises(PitoolsError, match=r"below the minimum useful placement, .*reserve"):
        ilp.solve(too_small)
    just_enough = dataclasses.replace(problem, budget_bytes=minimum)
    report = ilp.solve(just_enough)
    assert report.prediction.vram == minimum


def test_layer_granular_baseline_takes_whole_layers_from_the_end():
    problem = random_problem(np.random.default_rng(3), n_layers=4, n_ff=10)
    last_two = sum(l.block_bytes + l.n_neurons * l.neuron_bytes for l in problem.layers[2:])
    fits_two = dataclasses.replace(problem, budget_bytes=problem.reserve_bytes + last_two)
    ngl = layer_granular_placement(fits_two)
    assert ngl.dense_on_gpu == (False, False, True, True) and not ngl.head_on_gpu
    assert ngl.gpu_neurons == (0, 0, 10, 10)
    summary = summary_dict(fits_two, ilp.solve(fits_two))
    assert summary["layer_granular"]["n_gpu_layers"] == 2
    # llama.cpp has no predictors: its layers are smaller, as many or more of them fit.
    assert summary["llama_cpp"]["n_gpu_layers"] >= 2
    assert "-ngl 2 (whole layers)" in summary_text(summary)


# --- split files ----------------------------------------------------------------------------------------


def test_split_file_round_trip(tmp_path):
    masks = (np.zeros(6, bool), np.array([1, 0, 1, 1, 0, 0], bool), np.ones(6, bool))
    notes = {"pitools.objective": "latency", "pitools.gpu_neurons": [0, 3, 6], "pitools.predicted_token_ms": 1.25,
             "pitools.vram_used": 123}
    extra = {**notes, "pitools.dense_on_gpu": [False, True, True], "pitools.output_on_gpu": True}
    path = tmp_path / "m.gguf.generated.gpuidx"
    write_gpu_split(path, GpuSplit(masks, vram_capacity=4096, dense_on_gpu=(False, True, True), output_on_gpu=True,
                                   notes=notes))
    assert path.read_bytes()[:8] == b"PWRI" + struct.pack("<I", 3)
    back = read_gpu_split(path)
    assert back.vram_capacity == 4096 and back.extra == extra
    for mine, theirs in zip(masks, back.masks):
        np.testing.assert_array_equal(mine, theirs)
    np.testing.assert_array_equal(back.bucket(1), [0, 2, 3])


def write_like_powerinfer(path, counts: list[np.ndarray], selected: list[int], vram_capacity: int) -> None:
    """A split file made the way PowerInfer's export_split.py makes one: top-k of per-neuron
    activation counts, tensors with explicit raw shape and I32 type, then the header patched."""
    writer = gguf.GGUFWriter(path, "generic.gpu_index")
    for layer, (activation, k) in enumerate(zip(counts, selected)):
        top = np.argsort(-activation, kind="stable")[:k]
        mask = np.zeros_like(activation)
        mask[top] = 1
        mask = mask.astype(np.int32)
        writer.add_tensor(f"blk.{layer}.gpu_idx", mask, raw_shape=mask.shape[::-1],
                          raw_dtype=gguf.GGMLQuantizationType.I32)
        bucket = np.sort(top).astype(np.int32)
        writer.add_tensor(f"blk.{layer}.gpu_bucket", bucket, raw_shape=bucket.shape[::-1],
                          raw_dtype=gguf.GGMLQuantizationType.I32)
    writer.add_block_count(len(counts))
    writer.add_uint64("split.vram_capacity", vram_capacity)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with open(path, "r+b") as f:
        f.write(struct.pack("<I", int.from_bytes(b"PWRI", "little")))
        f.write(struct.pack("<I", 3))


def test_powerinfer_written_split_files_are_read(tmp_path):
    rng = np.random.default_rng(0)
    counts = [rng.integers(0, 1000, 512).astype(np.float32) for _ in range(3)]
    path = tmp_path / "powerinfer.gpuidx"
    write_like_powerinfer(path, counts, selected=[256, 0, 512], vram_capacity=10**9)
    split = read_gpu_split(path)
    assert split.vram_capacity == 10**9 and split.extra == {}
    assert [int(m.sum()) for m in split.masks] == [256, 0, 512]
    hottest = np.argsort(-counts[0], kind="stable")[:256]
    assert set(split.bucket(0)) == set(hottest)


def test_inconsistent_split_files_are_rejected(tmp_path):
    path = tmp_path / "bad.gpuidx"
    writer = gguf.GGUFWriter(path, "generic.gpu_index")
    writer.add_tensor("blk.0.gpu_idx", np.array([1, 0, 1], np.int32))
    writer.add_tensor("blk.0.gpu_bucket", np.array([0, 1], np.int32))
    writer.add_uint64("split.vram_capacity", 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(PitoolsError, match="not the sorted list"):
        read_gpu_split(path)


# --- command line ----------------------------------------------------------------------------------------


def test_solve_command_writes_a_split_file_and_a_json_summary(tmp_path):
    stats = random_stats(np.random.default_rng(5), n_layers=4, n_ff=256)
    np.savez(tmp_path / "stats.npz", **stats)
    model = tmp_path / "m.powerinfer.gguf"
    hw = tmp_path / "hw.toml"
    save_profile(TEST_HW, hw)
    args = ["--stats", str(tmp_path / "stats.npz"), "--vram", "400KiB", "--reserve", "1KB", "--hardware", str(hw),
            "--ctx-size", "64"]
    result = CliRunner().invoke(solve, [str(model), *args, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    split = read_gpu_split(tmp_path / "m.powerinfer.gguf.generated.gpuidx")
    counts = [layer["gpu_neurons"] for layer in summary["placement"]["layers"]]
    assert [int(m.sum()) for m in split.masks] == counts == split.extra["pitools.gpu_neurons"]
    assert summary["placement"]["vram_bytes"]["total"] <= 400 * 1024
    assert split.vram_capacity == summary["placement"]["vram_bytes"]["ffn"]
    # The hottest neurons are the ones on the GPU.
    layer0 = stats["freqs"][0]
    assert layer0[split.masks[0]].min(initial=1) >= layer0[~split.masks[0]].max(initial=0)

    again = CliRunner().invoke(solve, [str(model), *args])
    assert again.exit_code != 0 and "--force" in str(again.exception)
    text = CliRunner().invoke(solve, [str(model), *args, "--force", "--objective", "activations"])
    assert text.exit_code == 0 and "activations objective" in text.output and "wrote" in text.output
    no_output = CliRunner().invoke(solve, args)
    assert "name the split file with -o" in str(no_output.exception)
    del stats["kv_bytes_per_token"]
    np.savez(tmp_path / "partial.npz", **stats)
    partial = CliRunner().invoke(solve, [str(model), "--stats", str(tmp_path / "partial.npz"), "--vram", "1GB", "--force"])
    assert "stats file lacks kv_bytes_per_token" in str(partial.exception)


def test_probe_writes_a_profile(tmp_path):
    out = tmp_path / "here.toml"
    result = CliRunner().invoke(probe, ["-o", str(out), "--size", "8MiB", "--repeats", "1", "--base", "rtx2080ti"])
    assert result.exit_code == 0, result.output
    profile = load_profile(str(out))
    assert profile.cpu_bandwidth_gbs > 0 and profile.pcie_bandwidth_gbs == PRESETS["rtx2080ti"].pcie_bandwidth_gbs
