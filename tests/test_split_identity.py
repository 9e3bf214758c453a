"""A split file names the model it was solved for (``pitools.model_fingerprint``): `run --vram` solves
again for another model of the same shape instead of reusing its cached split."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from gguf_fixtures import random_predictors, save_predictors
from powerinfer_tools.formats.constants import MODEL_FINGERPRINT_KEY
from powerinfer_tools.formats.fingerprint import model_fingerprint
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.formats.gpu_split import GpuSplit, default_split_path, read_gpu_split, write_gpu_split
from powerinfer_tools.solver.hardware import load_profile
from powerinfer_tools.solver.split import ensure_split

from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.commands.cli import cli
from powerinfer_tools.conversion.convert import convert
from powerinfer_tools.conversion.sparsify import SparsifySettings, profile_checkpoint
from powerinfer_tools.errors import PitoolsError

N_LAYERS, D_MODEL, D_FF = 6, 256, 1024  # the bundled model
BUDGET = 10**7


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The bundled model as a PowerInfer file with firing frequencies (a short profile, random predictors)."""
    root = tmp_path_factory.mktemp("identity")
    profile_checkpoint(BUNDLED_MODEL, root / "profile", SparsifySettings(tokens=256, seq_len=64), progress=False)
    save_predictors(root / "pred", random_predictors(N_LAYERS, D_MODEL, D_FF, hidden=8))
    path, _ = convert(str(BUNDLED_MODEL), root / "m.powerinfer.gguf", "f32", predictors=root / "pred",
                      profile=root / "profile", sparsify=SparsifySettings(), progress=False)
    return path


@pytest.fixture
def models(converted, tmp_path):
    """Model A, and model B: the same shape and weights under another name (its metadata differs)."""
    a, b = tmp_path / "a.powerinfer.gguf", tmp_path / "b.powerinfer.gguf"
    shutil.copyfile(converted, a)
    data = converted.read_bytes()
    assert data.count(b"tiny-relu-llama") == 1
    b.write_bytes(data.replace(b"tiny-relu-llama", b"tiny-relu-other"))
    return a, b


def solve(model, split=None):
    split = split or default_split_path(model)
    return ensure_split(model, split, BUDGET, load_profile("rtx2080ti"), reserve_bytes=0)


# --- the fingerprint -------------------------------------------------------------------------------------


def test_the_fingerprint_covers_header_metadata_and_tensor_table_only(models, tmp_path):
    a, b = models
    assert model_fingerprint(a) == model_fingerprint(shutil.copyfile(a, tmp_path / "copy.gguf"))
    assert model_fingerprint(a) != model_fingerprint(b)
    data = bytearray(a.read_bytes())
    data[-100] ^= 0xFF  # a weight: not read, which keeps a 4 GB file's fingerprint fast
    (tmp_path / "weights.gguf").write_bytes(bytes(data))
    assert model_fingerprint(tmp_path / "weights.gguf") == model_fingerprint(a)


def test_the_fingerprint_ends_where_the_tensor_table_does(models, tmp_path):
    a, _ = models
    plain = tmp_path / "plain.gguf"
    plain.write_bytes(b"GGUF" + a.read_bytes()[4:])  # gguf-py's reader (independent of ours) refuses PWRI
    reader = gguf.GGUFReader(plain)
    last = reader.tensors[-1].field  # name, dimensions, type and offset of the last tensor
    end = last.offset + sum(part.nbytes for part in last.parts)
    data = bytearray(a.read_bytes())
    data[end:] = b"\xee" * (len(data) - end)  # padding and tensor data
    (tmp_path / "after.gguf").write_bytes(bytes(data))
    assert model_fingerprint(tmp_path / "after.gguf") == model_fingerprint(a)
    data[end - 1] ^= 0xFF  # the last tensor's offset
    (tmp_path / "table.gguf").write_bytes(bytes(data))
    assert model_fingerprint(tmp_path / "table.gguf") != model_fingerprint(a)


def test_an_open_files_fingerprint_is_the_one_read_from_its_path(models, synthesized_tiny):
    """``ModelFile.fingerprint`` hashes the header its reader has mapped (what the runtime keys its kept sparse
    verdicts and checks splits by); ``model_fingerprint`` walks the header on its own."""
    for path in (*models, synthesized_tiny.dense):  # PowerInfer's magic and GGUF's
        assert open_model_file(path).fingerprint() == model_fingerprint(path)


@pytest.mark.parametrize("damage", ["truncate", "version"])
def test_a_damaged_header_is_an_error_naming_the_file(models, tmp_path, damage):
    a, _ = models
    data = a.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:2000] if damage == "truncate" else data[:4] + b"\x07\0\0\0" + data[8:])
    with pytest.raises(PitoolsError, match=f"{bad}: corrupt or truncated model file"):
        model_fingerprint(bad)


# --- cached splits ---------------------------------------------------------------------------------------


def test_a_cached_split_of_another_model_with_the_same_shape_is_solved_again(models):
    a, b = models
    assert solve(a) is not None and solve(a) is None  # solved, then kept
    assert read_gpu_split(default_split_path(a)).extra[MODEL_FINGERPRINT_KEY] == model_fingerprint(a)
    shutil.copyfile(default_split_path(a), default_split_path(b))  # e.g. a model file replaced in place
    assert solve(b) is not None
    assert read_gpu_split(default_split_path(b)).extra[MODEL_FINGERPRINT_KEY] == model_fingerprint(b)


def test_our_split_without_a_fingerprint_is_solved_again_powerinfers_is_kept(models, tmp_path):
    a, _ = models
    masks = tuple(np.arange(D_FF) < 64 for _ in range(N_LAYERS))
    split = tmp_path / "s.gpuidx"
    write_gpu_split(split, GpuSplit(masks, vram_capacity=1000, vram_budget=BUDGET))
    assert solve(a, split) is not None  # ours from before fingerprints: for which model is unknown
    write_gpu_split(split, GpuSplit(masks, vram_capacity=1000))  # PowerInfer's: fits the budget, kept
    assert solve(a, split) is None


def test_run_and_solve_record_and_check_the_model(models):
    a, b = models
    result = CliRunner().invoke(cli, ["solve", str(a), "--vram", "10MB", "--reserve", "0B"])
    assert result.exit_code == 0, result.output
    assert read_gpu_split(default_split_path(a)).extra[MODEL_FINGERPRINT_KEY] == model_fingerprint(a)
    shutil.copyfile(default_split_path(a), default_split_path(b))
    args = ["-p", "def", "-n", "2", "--device", "emulated", "--vram", "10MB"]
    result = CliRunner().invoke(cli, ["run", str(b), *args])
    assert result.exit_code == 0, result.output
    assert "solved now" in result.stderr  # not the cached split of model A
