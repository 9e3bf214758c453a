"""Bad profile and predictor folders, and a full disk while profiling: one error line naming the file,
exit status 1, the folder left as it was (or resumable)."""

from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_checks import fails, invoke, snapshot
from powerinfer_tools.formats import profile_folder as profiling

PROFILE = ("--tokens", "2000", "--seq-len", "64", "-q")  # 32 windows, every token's pairs kept
TRAIN = ("--budget", "0.5", "--epochs", "1", "-q")


@pytest.fixture(scope="module")
def pristine(numpy_checkpoint, tmp_path_factory):
    """A finished profile of the shared tiny checkpoint, and its predictors beside it."""
    folder = tmp_path_factory.mktemp("bad-profile") / "profile"
    assert invoke("profile", numpy_checkpoint, "-o", folder, *PROFILE).exit_code == 0
    assert invoke("train-predictors", folder, "-o", folder.parent / "predictors", *TRAIN).exit_code == 0
    return folder


@pytest.fixture
def profile(tmp_path, pristine):
    return Path(shutil.copytree(pristine, tmp_path / "profile"))


def edit_json(path: Path, edit) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def refused_training(profile: Path, names: Path, match: str) -> None:
    before = snapshot(profile)
    fails("train-predictors", profile, "-o", profile.parent / "pred", *TRAIN, names=names, match=match)
    assert not (profile.parent / "pred").exists() and snapshot(profile) == before


@pytest.mark.parametrize("edit, match", [
    (lambda meta: [meta], "not a pitools profile (a JSON list, not an object)"),
    (lambda meta: {k: v for k, v in meta.items() if k != "d_ff"}, "d_ff must be an integer >= 1, not None"),
    (lambda meta: dict(meta, n_layers="2"), "n_layers must be an integer >= 1, not '2'"),
    (lambda meta: dict(meta, pairs_capacity=-1), "pairs_capacity must be an integer >= 0, not -1"),
    (lambda meta: dict(meta, progress=[]), "progress must be an object, not []"),
    (lambda meta: dict(meta, progress={"complete": "yes"}), "progress.complete must be true or false"),
])
def test_bad_profile_json(profile, edit, match):
    edit_json(profile / "profile.json", edit)
    refused_training(profile, profile / "profile.json", match)
    fails("profile", "--report", profile, names=profile / "profile.json", match=match)


def test_stats_of_another_shape(profile):
    edit_json(profile / "profile.json", lambda meta: dict(meta, n_layers=3))
    refused_training(profile, profile / "stats.safetensors", "blk.2.fire_count")


def corrupt_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[10:40] = b"x" * 30
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, match", [
    (corrupt_header, "corrupt training-pair file"),
    (lambda path: path.write_bytes(b"garbage"), "corrupt training-pair file"),
    (lambda path: os.truncate(path, 10_000), "truncated training-pair file (10000 bytes, its header says"),
    (lambda path: np.save(path, np.load(path)[:, :4]), "holds [2000, 4] training pairs; the profile needs [2000, 8]"),
    (lambda path: np.save(path, np.load(path).astype(np.int16)), "holds C-order int16 [2000, 8], not uint8"),
])
def test_bad_training_pairs(profile, damage, match):
    pairs = profile / "pairs" / "blk.1.fired.npy"
    damage(pairs)
    refused_training(profile, pairs, match)


def test_truncated_pairs_are_not_zero_filled_on_resume(profile, numpy_checkpoint):
    pairs = profile / "pairs" / "blk.0.x.npy"
    edit_json(profile / "profile.json", lambda meta: dict(meta, progress=dict(meta["progress"], complete=False)))
    os.truncate(pairs, 10_000)
    fails("profile", numpy_checkpoint, "-o", profile, *PROFILE, names=pairs, match="truncated training-pair file")
    assert pairs.stat().st_size == 10_000


@pytest.mark.parametrize("edit, match", [
    (lambda meta: [meta], "not a pitools predictor folder (a JSON list, not an object)"),
    (lambda meta: dict(meta, layers={}), "layers must be an array"),
    (lambda meta: dict(meta, layers=[dict(meta["layers"][0], hidden="8")]), "layers[0].hidden must be an integer"),
    (lambda meta: dict(meta, layers=meta["layers"][::-1]), "layers[0] is layer 1"),
    (lambda meta: dict(meta, layers=meta["layers"][:1]), "1 of 2 layers finished, yet complete is true"),
    (lambda meta: dict(meta, sparse_threshold=float("nan")), "sparse_threshold is nan; it must be a finite float32"),
    (lambda meta: dict(meta, sparse_threshold=1e300), "sparse_threshold is 1e+300; it must be a finite float32"),
])
def test_bad_predictors_json(pristine, tmp_path, edit, match):
    predictors = Path(shutil.copytree(pristine.parent / "predictors", tmp_path / "predictors"))
    edit_json(predictors / "predictors.json", edit)
    fails("train-predictors", "--report", predictors, names=predictors / "predictors.json", match=match)


# --- a full disk -------------------------------------------------------------------------------


def test_full_disk_when_pairs_are_created(numpy_checkpoint, tmp_path, monkeypatch):
    def fallocate(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    fails("profile", numpy_checkpoint, "-o", tmp_path / "prof", *PROFILE, names=tmp_path / "prof" / "pairs",
          match="cannot write training pairs: No space left on device")
    assert not (tmp_path / "prof" / "pairs").exists()  # the space it took is given back


def test_full_disk_while_pairs_are_written_then_resume(numpy_checkpoint, pristine, tmp_path, monkeypatch):
    writes = []

    def open_failing_on_the_fifth_write(file, mode="r", *args, **kwargs):
        if mode == "r+b":  # how pairs are written
            if len(writes) == 4:
                raise OSError(errno.ENOSPC, "No space left on device")
            writes.append(file)
        return builtins.open(file, mode, *args, **kwargs)

    monkeypatch.setattr(profiling, "open", open_failing_on_the_fifth_write, raising=False)
    folder = tmp_path / "prof"
    fails("profile", numpy_checkpoint, "-o", folder, *PROFILE, names=folder / "pairs",
          match="cannot write training pairs: No space left on device")
    monkeypatch.undo()
    assert invoke("profile", numpy_checkpoint, "-o", folder, *PROFILE).exit_code == 0  # resumes, and completes
    assert snapshot(folder / "pairs") == snapshot(pristine / "pairs")
