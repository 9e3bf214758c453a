"""Bad input to `pitools convert` and `pitools inspect`: one clear line, exit status 1, nothing left behind."""

from __future__ import annotations

import errno
import json
import shutil
import struct

import numpy as np
import pytest
from cli_checks import fails, invoke
from gguf import GGUFWriter
from gguf_fixtures import random_predictors, save_predictors
from numpy_models import edit_config


@pytest.fixture
def model(tmp_path, small_checkpoint):
    """A fresh copy each test may damage; outputs go to tmp_path/out."""
    folder = tmp_path / "model"
    shutil.copytree(small_checkpoint, folder)
    (tmp_path / "out").mkdir()
    return folder


def converts_nothing(model, *extra, match: str) -> None:
    out = model.parent / "out"
    fails("convert", model, "-o", out / "m.gguf", "-q", *extra, match=match)
    assert list(out.iterdir()) == []  # no output, no temporary file


def test_truncated_safetensors(model):
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    converts_nothing(model, match="truncated safetensors file")


def test_corrupt_safetensors_header(model):
    path = model / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:16] = b"\x00garbage"
    path.write_bytes(bytes(data))
    converts_nothing(model, match="corrupt safetensors header")


def test_missing_tokenizer(model):
    (model / "tokenizer.json").unlink()
    converts_nothing(model, match="no tokenizer.json")


@pytest.mark.parametrize("text, match", [('{"model": ', "invalid JSON"), ('{"model": []}', "model vocabulary")])
def test_corrupt_tokenizer(model, text, match):
    (model / "tokenizer.json").write_text(text)
    converts_nothing(model, match=match)


def test_config_without_a_needed_field(model):
    edit_config(model, hidden_size=None)
    converts_nothing(model, match="lacks the field 'hidden_size'")


def test_config_that_does_not_fit_the_weights(model):
    edit_config(model, intermediate_size=96)
    converts_nothing(model, match="config.json implies [96, 32]")


def test_unsupported_architecture(model):
    edit_config(model, model_type="gpt2")
    converts_nothing(model, match="model_type 'gpt2' is not supported")


def test_existing_output_needs_force(model):
    out = model.parent / "out" / "m.gguf"
    out.write_bytes(b"keep me")
    fails("convert", model, "-o", out, "-q", match="output exists; pass --force")
    assert out.read_bytes() == b"keep me"
    result = invoke("convert", model, "-o", out, "-q", "--force", "--no-sparsity")
    assert result.exit_code == 0 and out.read_bytes()[:4] == b"PWRI"


def test_full_disk(model, monkeypatch):
    calls = []

    def write_tensor_data(self, tensor, *args, **kwargs):
        calls.append(tensor.nbytes)
        if len(calls) == 5:  # some tensors are already on disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, tensor, *args, **kwargs)

    original = GGUFWriter.write_tensor_data
    monkeypatch.setattr(GGUFWriter, "write_tensor_data", write_tensor_data)
    converts_nothing(model, "--no-sparsity", match="No space left on device")
    assert len(calls) == 5


def test_interrupted_conversion_leaves_nothing(model, monkeypatch):
    def interrupt(self, tensor, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(GGUFWriter, "write_tensor_data", interrupt)
    result = invoke("convert", model, "-o", model.parent / "out" / "m.gguf", "-q", "--no-sparsity")
    assert result.exit_code != 0
    assert list((model.parent / "out").iterdir()) == []


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda p: (p / "predictors.json").unlink(), "not a predictor folder: no predictors.json"),
        (lambda p: save_predictors(p, random_predictors(2, 32, 64, 8), complete=False), "not complete"),
        (lambda p: save_predictors(p, random_predictors(1, 32, 64, 8)), "no tensor 'blk.1.fc1.weight'"),
        (lambda p: save_predictors(p, random_predictors(2, 32, 48, 8)), "expected [hidden, 32] and [64, hidden]"),
        (lambda p: save_predictors(p, random_predictors(2, 32, 64, 8), sparse_threshold="high"), "must be a number"),
    ],
)
def test_bad_predictor_folder(model, damage, match):
    predictors = model.parent / "predictors"
    save_predictors(predictors, random_predictors(2, 32, 64, 8))
    damage(predictors)
    converts_nothing(model, "--predictors", predictors, match=match)


def test_unembeddable_tokenizer(model):
    path = model / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["model"]["type"] = "Unigram"
    path.write_text(json.dumps(spec))
    converts_nothing(model, match="cannot embed this tokenizer")


# --- inspect -----------------------------------------------------------------------------------


@pytest.fixture
def converted(model):
    path = model.parent / "out" / "m.gguf"
    assert invoke("convert", model, "-o", path, "-q", "--no-sparsity").exit_code == 0
    return path


def test_inspect_truncated_file(converted):
    data = converted.read_bytes()
    converted.write_bytes(data[: len(data) - 1000])
    fails("inspect", converted, match="truncated")


def test_inspect_truncated_header(converted):
    converted.write_bytes(converted.read_bytes()[:300])
    fails("inspect", converted, match="corrupt or truncated model file")


def test_inspect_corrupt_header(converted):
    data = bytearray(converted.read_bytes())
    data[8:16] = struct.pack("<Q", 2**40)  # tensor count
    converted.write_bytes(bytes(data))
    fails("inspect", converted, match="corrupt or truncated model file")


def test_inspect_not_a_model_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(np.arange(100, dtype=np.uint8).tobytes())
    fails("inspect", path, match="not a GGUF or PowerInfer model file")
    fails("inspect", tmp_path / "missing.gguf", match="no such file")
