"""pitools perplexity: dense against transformers, oracle equal to dense, predicted within the bound."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cli_checks import invoke
from hf_models import build
from powerinfer_tools.formats.predictor_folder import load_predictors
from tiny_models import TINY_RELU_LLAMA

from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.checkpoints.tokenizer import CheckpointTokenizer
from powerinfer_tools.models import load_model
from powerinfer_tools.predictors.trainer import TrainSettings, train_predictors
from powerinfer_tools.profiling.corpus import CorpusSource, read_tokens
from powerinfer_tools.profiling.perplexity import oracle_chooser, perplexity, predictor_chooser
from powerinfer_tools.profiling.profiler import Profiler, ProfileSettings

# The bound: computing only the predicted neurons costs at most 2% relative perplexity.
PREDICTED_BOUND = 0.02


def test_dense_perplexity_matches_transformers(tmp_path):
    torch_model = build(tmp_path, "llama", config_overrides=TINY_RELU_LLAMA)
    tokens = np.random.default_rng(0).integers(0, 260, 150)
    ours = perplexity(load_model(Checkpoint(tmp_path)), tokens, seq_len=64, progress=False)
    nll, scored = 0.0, 0
    with torch.no_grad():
        for start in range(0, 149, 64):  # the same windows: inputs start.., targets one further on
            window = torch.tensor(tokens[start : start + 65])
            logits = torch_model(window[None, :-1], use_cache=False).logits[0].double()
            nll += F.cross_entropy(logits, window[1:], reduction="sum").item()
            scored += len(window) - 1
    assert ours.scored_tokens == scored == 149
    assert ours.perplexity == pytest.approx(np.exp(nll / scored), rel=1e-5)


def test_oracle_equals_dense_and_selecting_nothing_does_not(sparse_tiny):
    model = load_model(Checkpoint(sparse_tiny))
    tokens = np.random.default_rng(1).integers(0, 256, 300)
    dense = perplexity(model, tokens, 100, progress=False)
    oracle = perplexity(model, tokens, 100, "oracle", oracle_chooser(), progress=False)
    assert oracle.perplexity == pytest.approx(dense.perplexity, rel=1e-6)
    s = oracle.selection
    assert s["recall"] == 1.0 and s["computed_density"] == s["fired_density"] < 0.2
    nothing = perplexity(model, tokens, 100, "none", lambda layer, residual, fired: np.zeros((len(residual), 160), bool), progress=False)
    assert nothing.selection["recall"] == 0.0 and nothing.selection["computed_density"] == 0.0
    assert abs(nothing.perplexity / dense.perplexity - 1) > 0.01


def sparse_accuracy(folder, calibration: tuple[int, int], evaluation: tuple[int, int], seq_len: int, work,
                    settings: TrainSettings):
    """Profile the ``(skip, count)`` calibration tokens of heldout.txt, train predictors, then measure
    dense, oracle and predicted perplexity on the evaluation tokens (a disjoint slice)."""
    model = load_model(Checkpoint(folder))
    tokenizer = CheckpointTokenizer(folder, model.spec.bos_token_id, model.spec.eos_token_id)
    source = CorpusSource((folder / "heldout.txt",))
    calibration_tokens = read_tokens(source, tokenizer, calibration[1], skip_tokens=calibration[0])
    Profiler(model, str(folder), calibration_tokens, ["heldout"], work / "prof", ProfileSettings(seq_len)).run(
        progress=False)
    train_predictors(work / "prof", work / "pred", settings, device="cpu", progress=False)
    tokens = read_tokens(source, tokenizer, evaluation[1], skip_tokens=evaluation[0])
    threshold, layers = load_predictors(work / "pred")
    return (perplexity(model, tokens, seq_len, progress=False),
            perplexity(model, tokens, seq_len, "oracle", oracle_chooser(), progress=False),
            perplexity(model, tokens, seq_len, "sparse", predictor_chooser(threshold, layers),
                       progress=False))


def test_predicted_perplexity_bound_on_the_tiny_model(sparse_tiny, tmp_path):
    dense, oracle, predicted = sparse_accuracy(sparse_tiny, (0, 4000), (4000, 1000), 128, tmp_path,
                                               TrainSettings(budget=0.3, batch_size=128))
    assert oracle.perplexity == pytest.approx(dense.perplexity, rel=1e-6)
    assert predicted.selection["recall"] > 0.9  # on text the predictors never saw
    assert predicted.perplexity <= dense.perplexity * (1 + PREDICTED_BOUND)

    cli = invoke("perplexity", str(sparse_tiny), "--mode", "sparse", "--predictors", str(tmp_path / "pred"),
                 "--skip-tokens", "4000", "--tokens", "1000", "--seq-len", "128", "--json", "-q")
    assert cli.exit_code == 0, cli.stderr
    assert json.loads(cli.stdout) == json.loads(json.dumps(predicted.as_dict()))


@pytest.mark.slow
def test_predicted_perplexity_bound_on_the_bundled_model(tmp_path):
    """The model card's check on a slice: calibrate on 16k held-out tokens, evaluate on 4k others.

    The evaluation slice is the start of heldout.txt (Python source); its end is
    mostly charmap tables, which would flatter the figures. Shorter training than
    the defaults keeps the test to minutes; the recall target is the default.
    """
    settings = TrainSettings(epochs=3, min_epoch_steps=100)
    dense, oracle, predicted = sparse_accuracy(BUNDLED_MODEL, (4096, 16384), (0, 4096), 256, tmp_path, settings)
    assert oracle.perplexity == pytest.approx(dense.perplexity, rel=1e-5)
    assert predicted.selection["recall"] > 0.9
    assert predicted.perplexity <= dense.perplexity * (1 + PREDICTED_BOUND)


def test_cli_dense_oracle_and_argument_errors(sparse_tiny):
    common = [str(sparse_tiny), "--tokens", "300", "--seq-len", "100", "--json", "-q"]
    dense = invoke("perplexity", *common)
    assert dense.exit_code == 0, dense.stderr
    oracle = invoke("perplexity", *common, "--mode", "oracle")
    assert oracle.exit_code == 0, oracle.stderr
    dense, oracle = json.loads(dense.stdout), json.loads(oracle.stdout)
    assert dense["scored_tokens"] == 299 and dense["selection"] is None
    assert oracle["perplexity"] == pytest.approx(dense["perplexity"], rel=1e-6)
    assert oracle["selection"]["recall"] == 1.0

    missing = invoke("perplexity", *common, "--mode", "sparse")
    assert missing.exit_code == 1 and "--predictors PRED goes with --mode sparse" in missing.stderr
