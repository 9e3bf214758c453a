"""Which path decodes a token, and which kernels compute what (issue 31): ``RuntimeModel.decode_refusal``,
``RuntimeModel.execution_report``, ``LLM.description`` and ``pitools run --verbose`` say it, and say what runs."""

from __future__ import annotations

import re

import numpy as np
import pytest
from cli_checks import invoke
from gguf import MODEL_TENSOR
from powerinfer_tools.formats.constants import PowerInferTensor, predictor_names, tensor_name
from powerinfer_tools.formats.gpu_split import GpuSplit, write_gpu_split
from powerinfer_tools.formats.model_file import open_model_file

from powerinfer_tools import kernels
from powerinfer_tools.benchmarking.bench import (
    SPARSE,
    BenchSettings,
    format_report,
    report,
    run_bench,
)
from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.runtime.compiled_decode import CompiledDecoder
from powerinfer_tools.runtime.engine import RuntimeModel
from powerinfer_tools.runtime.llm import LLM
from powerinfer_tools.runtime.loader import load_runtime_model

HIDDEN = 16  # the predictors' hidden size
FFN_DOWN_T = PowerInferTensor.FFN_DOWN_T
RAM = 9 * 2**19  # --ram 4.5 MiB for the 5.1 MiB of ``sparse_bundled``: neuron caches pinning every neuron (fast)


@pytest.fixture(scope="module")
def sparse_bundled(tmp_path_factory):
    """The bundled model in q4_0 with random predictors of hidden size ``HIDDEN``: a sparse PowerInfer file."""
    from gguf_fixtures import random_predictors, save_predictors

    root = tmp_path_factory.mktemp("sparse-bundled")
    save_predictors(root / "pred", random_predictors(6, 256, 1024, hidden=HIDDEN, seed=1))
    return convert(str(BUNDLED_MODEL), root / "m.powerinfer.gguf", outtype="q4_0", predictors=root / "pred",
                   progress=False)[0]


def layer_lines(model) -> list[str]:
    return [line for line in model.execution_report() if line.startswith("layer")]


def test_the_sparse_bundled_model_decodes_every_layer_on_the_compiled_decoder(sparse_bundled):
    model = load_runtime_model(sparse_bundled)
    model.mode = FFNMode.SPARSE
    assert model.decode_refusal() is None
    [line] = layer_lines(model)  # six alike layers: one line
    assert line.startswith("layers 0-5: compiled decoder | attention q4_0 interleaved, ")
    assert f"| FFN sparse, predicted (predictor hidden size {HIDDEN}) |" in line
    assert re.search(r"\| gate/up q4_0 rows, (ggml vec_dot|AVX-512 VNNI) \| down ffn_down_t q4_0, axpy of ours \| ",
                     line)
    file = open_model_file(sparse_bundled)  # a token reads each layer's predictor, and each computed neuron's rows
    predictor = sum(file[name].nbytes for name in predictor_names(0))
    neuron = sum(file[tensor_name(t, 0)].nbytes for t in (MODEL_TENSOR.FFN_GATE, MODEL_TENSOR.FFN_UP, FFN_DOWN_T))
    assert line.endswith(f" | reads {predictor / 1024:.4g} KiB + {neuron / model.spec.d_ff / 1024:.4g} KiB a neuron")
    report = model.execution_report()
    assert report[0] == f"kernels: {kernels.describe()}"
    from powerinfer_tools.kernels import numba_bf16

    down = "bfloat16 products (AVX-512 BF16)" if numba_bf16.available() else "dequantized for BLAS"
    rows = "ggml GEMM on an interleaved copy" if kernels.ggml_routines().interleaved else down  # x86 with AVX2
    assert report[-1] == ("prompts (blocks of tokens): general path | sparse FFN: each token's own chosen neurons "
                          f"(kernels.batched) while they are under 30% of them, else their union | attention: "
                          f"compiled tiles (numba_attention) | rows q4_0: {rows} | ffn_down_t q4_0: {down}")
    description = LLM.load(sparse_bundled, mode="sparse").description
    assert description.startswith("runtime, sparse FFN, neurons: predictor in every layer, ")
    assert description.endswith(", tokens decoded by the compiled decoder")


def test_a_layer_the_compiled_decoder_refuses_is_left_to_the_general_path(sparse_bundled):
    model = load_runtime_model(sparse_bundled)
    model.mode = FFNMode.SPARSE
    model.layers[2].dense.biases["down"] = np.zeros(model.spec.d_model, np.float32)  # the general path adds it
    assert model.decode_refusal() is None
    why = "down bias (the compiled decoder adds q/k/v's only)"
    assert model.decode_path() == f"compiled decoder, but layer 2 by the general path ({why})"
    lines = layer_lines(model)
    assert [line.split(":")[0] for line in lines] == ["layers 0-1", "layer 2", "layers 3-5"]
    assert lines[0].startswith("layers 0-1: compiled decoder | ") and lines[2].startswith("layers 3-5: compiled decoder")
    assert lines[1].startswith(f"layer 2: general path ({why}) | ")
    assert re.search(r"\| gate/up q4_0, (ggml vec_dot|AVX-512 VNNI) \| down ffn_down_t q4_0, axpy of ours \| reads ",
                     lines[1])


def test_every_layer_refused_sends_the_token_to_the_general_path(sparse_bundled):
    model = load_runtime_model(sparse_bundled)
    for layer in model.layers:
        layer.dense.biases["down"] = np.zeros(model.spec.d_model, np.float32)
    assert model.compiled_decoder() is None
    assert model.decode_refusal() == "no layer it computes (layer 0: down bias (the compiled decoder adds q/k/v's only))"
    [line] = layer_lines(model)
    assert line.startswith("layers 0-5: general path (no layer it computes (layer 0: down bias ")


def test_neurons_on_an_emulated_device_take_the_general_path_and_are_grouped_apart(sparse_bundled, tmp_path):
    spec = load_runtime_model(sparse_bundled).spec
    masks = [np.zeros(spec.d_ff, bool) for _ in range(spec.n_layers)]
    masks[1][: spec.d_ff // 4] = True  # a quarter of layer 1's neurons; its attention stays on the CPU
    split = tmp_path / "m.gpuidx"
    write_gpu_split(split, GpuSplit(tuple(masks), vram_capacity=10**9, dense_on_gpu=(False,) * spec.n_layers))
    model = load_runtime_model(sparse_bundled, split=split, device="emulated")
    model.mode = FFNMode.SPARSE
    assert model.decode_refusal() is None
    lines = layer_lines(model)
    assert [line.split(":")[0] for line in lines] == ["layer 0", "layer 1", "layers 2-5"]
    assert lines[1].startswith("layer 1: general path (FFN neurons split between devices) | ")
    assert " compiled decoder |" in lines[0] and " compiled decoder |" in lines[2]
    assert "FFN sparse, predicted (predictor hidden size 16), 25% of the neurons on emulated-device |" in lines[1]
    assert "| gate/up q4_0 on emulated-device / q4_0, " in lines[1]
    assert "emulated-device" not in lines[0] + lines[2]


def test_the_step_says_why_it_leaves_the_compiled_decoder(sparse_bundled):
    model = load_runtime_model(sparse_bundled, ram=RAM)  # neuron caches, which dense mode streams
    decoder = model.compiled_decoder()
    assert decoder.step_refusal(FFNMode.SPARSE, 1, 0) is None
    assert decoder.step_refusal(FFNMode.SPARSE, 7, 0) == "a block of 7 tokens (a prompt)"
    assert decoder.step_refusal(FFNMode.SPARSE, 1, decoder.max_context).startswith("context full")
    assert decoder.step_refusal(FFNMode.DENSE, 1, 0) == "dense mode under a RAM budget"
    model.mode = FFNMode.DENSE
    assert layer_lines(model)[0].startswith("layers 0-5: general path (dense mode under a RAM budget) | ")


def test_numpy_kernels_are_named_in_every_product(sparse_bundled):
    model = load_runtime_model(sparse_bundled)  # interleaved where the compiled kernels run
    kernels.use_reference("asked for by a test")
    try:
        assert model.decode_refusal() == "compiled kernels not in use: asked for by a test"
        report = model.execution_report()
    finally:
        kernels.use_reference(None)
    assert report[0] == "kernels: NumPy reference (asked for by a test)"
    assert "| gate/up q4_0, NumPy reference | down ffn_down_t q4_0, NumPy reference" in report[1]
    assert report[2] == "output head: q8_0, NumPy reference"


def spy_on_the_decoder(monkeypatch) -> tuple[list[int], list[int]]:
    """From now on: the tokens of each step the compiled decoder computes, and the layers it leaves to the
    general path (``RuntimeModel.general_layer``), in order."""
    calls, left, real, real_layer = [], [], CompiledDecoder.forward, RuntimeModel.general_layer

    def forward(self, x, *args, **kwargs):
        calls.append(len(x))
        return real(self, x, *args, **kwargs)

    def general_layer(self, i, *args, **kwargs):
        left.append(i)
        return real_layer(self, i, *args, **kwargs)

    monkeypatch.setattr(CompiledDecoder, "forward", forward)
    monkeypatch.setattr(RuntimeModel, "general_layer", general_layer)
    return calls, left


def down_bias(model) -> None:
    model.layers[2].dense.biases["down"] = np.zeros(model.spec.d_model, np.float32)


def decoding_off(model) -> None:
    model.compiled_decoding = False


@pytest.mark.parametrize(("mode", "ram", "change"), [
    (FFNMode.SPARSE, None, None), (FFNMode.DENSE, None, None), (FFNMode.SPARSE, None, down_bias),
    (FFNMode.SPARSE, None, decoding_off), (FFNMode.SPARSE, RAM, None), (FFNMode.DENSE, RAM, None),
    (FFNMode.ORACLE, None, None),
], ids=["sparse", "dense", "down-bias", "decoding-off", "sparse-ram", "dense-ram", "oracle"])
def test_the_reported_path_is_the_path_taken(sparse_bundled, monkeypatch, mode, ram, change):
    calls, left = spy_on_the_decoder(monkeypatch)  # before the decoder is built: it keeps general_layer
    model = load_runtime_model(sparse_bundled, ram=ram)
    model.mode = mode
    if change is not None:
        change(model)
    compiled = model.decode_refusal() is None
    assert (" compiled decoder |" in layer_lines(model)[0]) == compiled
    step = model.step_fn()
    step(np.arange(1, 4))
    assert calls == []  # a prompt: the general path, always
    for token in (7, 11):
        step(np.array([token]))
    assert calls == ([1, 1] if compiled else [])
    assert compiled == (mode is not FFNMode.ORACLE and change is not decoding_off
                        and (ram is None or mode is FFNMode.SPARSE))
    assert left == ([2, 2] if change is down_bias else [])  # the layer the report says the general path runs
    assert [i for i, line in enumerate(model.layer_paths()) if line.startswith("general path")] == (
        [2] if change is down_bias else [] if compiled else list(range(6)))


def test_run_verbose_prints_the_report_on_stderr_and_still_generates(sparse_bundled):
    result = invoke("run", sparse_bundled, "--verbose", "-p", "import os", "-n", "4")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("import os") and len(result.stdout.rstrip("\n")) > len("import os")
    err = result.stderr
    report = err.index("pitools: how this run computes:\n")
    assert "\n  layers 0-5: compiled decoder | " in err[report:]
    assert "\n  output head: " in err and "\n  prompts (blocks of tokens): general path" in err
    assert err.index("prompt: ") > report  # the summary comes after the report
    assert err.rstrip("\n").endswith("tokens decoded by the compiled decoder")
    assert "layers 0-5" not in invoke("run", sparse_bundled, "-n", "1").stderr  # not without --verbose
    assert "--verbose" in invoke("run", "--help").stdout


def test_the_bench_reports_how_our_engine_computed(sparse_bundled):
    settings = BenchSettings(prompt_tokens=4, generate=2, runs=1, threads=1)
    results = run_bench(sparse_bundled, None, settings, modes=(SPARSE,))
    execution = results[SPARSE].execution  # made in the engine's own process
    assert execution[1].startswith("layers 0-5: compiled decoder | ")
    rep = report(results, settings, None)
    assert rep["engines"][SPARSE]["execution"] == execution
    assert "\nsparse: how it computed:\n  kernels: " in format_report(rep)
