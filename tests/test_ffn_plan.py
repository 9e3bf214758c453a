"""Each layer's FFN plan (``runtime/ffn_plan.py``, issue 56): decided once at load for every mode, what both engines
(the general path and the compiled decoder) run, and the one count of the bytes a token reads of the FFN."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import MODEL_TENSOR
from gguf_fixtures import TOKENS, random_predictors, save_predictors

from powerinfer_tools import kernels
from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.formats.constants import PowerInferTensor, predictor_names, tensor_name
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.runtime import engine
from powerinfer_tools.runtime.engine import TokenStats
from powerinfer_tools.runtime.ffn_plan import Cache, Choice, Down, GateUp, plan_ffn
from powerinfer_tools.runtime.loader import load_runtime_model

N_LAYERS, D_MODEL, D_FF = 6, 256, 1024  # the bundled model's


@pytest.fixture(scope="module")
def predicted(tmp_path_factory):
    """The bundled model in f32 with random predictors (a layer's each of its own hidden size): a sparse PowerInfer
    file."""
    root = tmp_path_factory.mktemp("ffn-plan")
    layers = [random_predictors(1, D_MODEL, D_FF, hidden=8 * (1 + i % 2), seed=i)[0] for i in range(N_LAYERS)]
    save_predictors(root / "predictors", layers)
    return convert(str(BUNDLED_MODEL), root / "m.powerinfer.gguf", outtype="f32", predictors=root / "predictors",
                   progress=False)[0]


def test_each_modes_plan_says_what_chooses_and_what_a_token_reads_from_the_file(predicted):
    model = load_runtime_model(predicted)
    file = open_model_file(predicted)
    row = {t: file[tensor_name(t, 0)].nbytes // D_FF
           for t in (MODEL_TENSOR.FFN_GATE, MODEL_TENSOR.FFN_UP, PowerInferTensor.FFN_DOWN_T)}
    for mode, choice in ((FFNMode.DENSE, Choice.EVERY), (FFNMode.SPARSE, Choice.PREDICTOR),
                         (FFNMode.ORACLE, Choice.ORACLE)):
        plans = model.ffn_plans[mode]
        assert len(plans) == N_LAYERS and all(plan.mode is mode and plan.choice is choice for plan in plans)
        assert all((plan.gate_up, plan.down, plan.cache) == (GateUp.ROWS, Down.ROWS, Cache.NONE) for plan in plans)
        predictors = [sum(file[name].nbytes for name in predictor_names(i)) if mode is FFNMode.SPARSE else 0
                      for i in range(N_LAYERS)]
        assert [plan.predictor_bytes for plan in plans] == [(p,) for p in predictors]
        neuron = row[MODEL_TENSOR.FFN_GATE] + row[MODEL_TENSOR.FFN_UP]
        assert [plan.bytes_read(10, 7) for plan in plans] == [p + 10 * neuron + 7 * row[PowerInferTensor.FFN_DOWN_T]
                                                              for p in predictors]
    assert [plan.hidden for plan in model.ffn_plans[FFNMode.SPARSE]] == [(8 * (1 + i % 2),) for i in range(N_LAYERS)]


def test_the_plans_are_made_at_load_and_looked_up_per_step(predicted, monkeypatch):
    made = []
    monkeypatch.setattr(engine, "plan_ffn", lambda *args: made.append(args) or plan_ffn(*args))
    model = load_runtime_model(predicted)
    assert len(made) == N_LAYERS * len(FFNMode)
    for mode in (FFNMode.SPARSE, FFNMode.DENSE, FFNMode.ORACLE):
        model.mode = mode
        step = model.step_fn()
        for tokens in (TOKENS[:4], TOKENS[4:5], TOKENS[5:6]):  # a prompt, then tokens one at a time
            step(tokens)
    assert len(made) == N_LAYERS * len(FFNMode)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled decoder", "general path"])
def test_both_engines_run_what_the_plan_says_and_count_its_bytes(predicted, compiled):
    """Sparse mode whose plans are changed to compute every neuron (before the compiled decoder is built: it takes
    them then) computes and reads what dense mode does; as loaded, it computes the predictors' neurons."""
    if compiled and not kernels.available():
        pytest.skip(f"compiled kernels unavailable: {kernels.unavailable_reason()}")

    def decoded(model, mode):
        model.mode, model.compiled_decoding = mode, compiled
        caches = model.new_cache()
        model.forward(TOKENS[:4], caches)
        model.stats = TokenStats()
        logits = np.concatenate([model.forward(TOKENS[i : i + 1], caches) for i in range(4, len(TOKENS))])
        assert (model.decode_path() == "compiled decoder") == compiled
        return logits, model.stats

    model = load_runtime_model(predicted)
    dense, dense_stats = decoded(model, FFNMode.DENSE)
    _, sparse_stats = decoded(load_runtime_model(predicted), FFNMode.SPARSE)
    assert sparse_stats.neurons_active < 0.9 * sparse_stats.neurons_total  # the predictors choose
    every = load_runtime_model(predicted)
    every.ffn_plans[FFNMode.SPARSE] = [dataclasses.replace(plan, choice=Choice.EVERY, predictor_bytes=(0,))
                                       for plan in every.ffn_plans[FFNMode.SPARSE]]
    logits, stats = decoded(every, FFNMode.SPARSE)
    np.testing.assert_array_equal(logits, dense)
    assert stats == dense_stats and stats.neurons_active == stats.neurons_total
    assert stats.bytes_read == stats.steps * (model.static_bytes + sum(
        plan.bytes_read(D_FF, D_FF) for plan in model.ffn_plans[FFNMode.DENSE]))
