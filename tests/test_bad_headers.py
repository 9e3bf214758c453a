"""Bad weights and file headers: safetensors headers, NaN/inf weights, tensors that disagree with
config.json, GGUF files that are not regular files or whose header is corrupt. One error line naming
the file, exit status 1, no output left, the input unchanged."""

from __future__ import annotations

import json
import os
import shutil
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
from cli_checks import fails, invoke, snapshot
from gguf import GGUFWriter
from numpy_models import edit_config, write_gguf
from safetensors.numpy import load_file, save_file

UP = "model.layers.0.mlp.up_proj.weight"
GATE = "model.layers.0.mlp.gate_proj.weight"


@pytest.fixture
def model(tmp_path, numpy_checkpoint):
    (tmp_path / "out").mkdir()
    return Path(shutil.copytree(numpy_checkpoint, tmp_path / "model"))


def refused(model: Path, *extra, names: Path, match: str) -> None:
    """``pitools convert`` fails as the contract says: one line, no output (nor work folder), input unchanged."""
    before = snapshot(model)
    out = model.parent / "out"
    fails("convert", model, "-o", out / "m.gguf", "-q", *extra, names=names, match=match)
    assert list(out.iterdir()) == [] and snapshot(model) == before


# --- safetensors headers -----------------------------------------------------------------------


def rewrite_header(model: Path, edit) -> None:
    """Replace model.safetensors' JSON header by ``edit(header)``, keeping the tensor data."""
    path = model / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    raw = json.dumps(edit(json.loads(data[8 : 8 + n]))).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def with_entry(**changes):
    return lambda header: dict(header, **{UP: dict(header[UP], **changes)})


@pytest.mark.parametrize("edit, match", [
    (lambda header: [header], "corrupt safetensors header (a JSON list, not an object)"),
    (lambda header: dict(header, **{UP: [1]}), f"entry for tensor {UP!r} (not an object)"),
    (with_entry(shape=["64", 32]), "has shape ['64', 32]; expected a list of integers >= 0"),
    (with_entry(shape=[-64, -32]), "has shape [-64, -32]"),
    (with_entry(shape=[True, 32]), "has shape [True, 32]"),
    (with_entry(shape=64), "has shape 64"),
    (with_entry(data_offsets=[0]), "has data_offsets [0]; expected [begin, end]"),
    (with_entry(data_offsets="ab"), "has data_offsets 'ab'"),
    (with_entry(data_offsets=[10, 5]), "has data_offsets [10, 5]"),
    (with_entry(dtype=["F32"]), "has unsupported dtype ['F32']"),
    (lambda header: with_entry(data_offsets=header[GATE]["data_offsets"])(header), f"{GATE!r} and {UP!r} overlap"),
    (with_entry(data_offsets=[2**40, 2**40 + 8192]), "truncated safetensors file"),
])
def test_corrupt_safetensors_header(model, edit, match):
    rewrite_header(model, edit)
    refused(model, names=model / "model.safetensors", match=match)


def test_deeply_nested_header(model):
    raw = b"[" * 100_000 + b"]" * 100_000
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    refused(model, names=model / "model.safetensors", match="corrupt safetensors header")


def test_weights_path_that_is_a_folder(model):
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").mkdir()
    refused(model, names=model / "model.safetensors", match="not a regular file")


def test_empty_checkpoint_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Path("") is the current folder, which must not be taken for the checkpoint
    fails("convert", "", names="''", match="empty checkpoint path")


def test_engine_refuses_tensors_that_disagree_with_config(model, tmp_path):
    edit_config(model, intermediate_size=96)
    fails("profile", model, "-o", tmp_path / "prof", names=model / "model.safetensors",
          match="has shape [64, 32], config.json implies [96, 32]")
    assert not (tmp_path / "prof").exists()


# --- NaN and inf weights -----------------------------------------------------------------------


@pytest.fixture
def nonfinite(model):
    tensors = load_file(model / "model.safetensors")
    tensors[UP][0, 0], tensors[UP][3, 4], tensors[UP][5, 5] = np.nan, np.inf, -np.inf
    save_file(tensors, str(model / "model.safetensors"))
    return model


def test_nonfinite_weights_are_refused_as_they_stream(nonfinite):
    refused(nonfinite, "--no-sparsity", names=nonfinite / "model.safetensors",
            match=f"tensor {UP!r} has 3 non-finite values (NaN/inf); pass --allow-nonfinite to convert anyway")


def test_nonfinite_weights_are_refused_before_profiling(nonfinite):
    refused(nonfinite, names=nonfinite / "model.safetensors", match=f"{UP!r} has 3 non-finite values")
    fails("profile", nonfinite, "-o", nonfinite.parent / "prof", names=nonfinite / "model.safetensors",
          match="3 non-finite values")
    assert not (nonfinite.parent / "prof").exists()


def test_allow_nonfinite_writes_them(nonfinite):
    out = nonfinite.parent / "out" / "m.gguf"
    result = invoke("convert", nonfinite, "-o", out, "-q", "--no-sparsity", "--outtype", "f32", "--allow-nonfinite")
    assert result.exit_code == 0, result.output
    from powerinfer_tools.formats.model_file import open_model_file

    up = open_model_file(out)["blk.0.ffn_up.weight"].data
    assert np.isnan(up).sum() == 1 and np.isinf(up).sum() == 2
    out.unlink()
    refused(nonfinite, "--allow-nonfinite", names=nonfinite / "model.safetensors",
            match="profiling needs finite weights; convert with --no-sparsity")


# --- GGUF files --------------------------------------------------------------------------------


def test_inspect_paths_that_are_not_regular_files(tmp_path):
    fails("inspect", "/dev/zero", names="/dev/zero", match="not a regular file")
    fails("inspect", tmp_path, names=tmp_path, match="is a directory")
    os.mkfifo(tmp_path / "fifo")
    fails("inspect", tmp_path / "fifo", names=tmp_path / "fifo", match="not a regular file")


def gguf_with_tensor(path: Path) -> Path:
    """A small valid GGUF file of an architecture inspect shows without checking hyperparameters."""
    writer = GGUFWriter(path, "test")
    writer.add_array("test.values", [1, 2, 3])
    writer.add_tensor("test.tensor", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def after(data: bytes, marker: bytes, skip: int = 0) -> int:
    """The offset ``skip`` bytes past the end of ``marker`` in ``data``."""
    return data.index(marker) + len(marker) + skip


# (where, how many bytes, value): the value types and counts gguf-py trusts.
CORRUPTIONS = {
    "kv count": (lambda d: 16, 8, 2**63),
    "key length": (lambda d: 24, 8, 2**62),
    "value type": (lambda d: after(d, b"general.architecture"), 4, 99),
    "string length": (lambda d: after(d, b"general.architecture", 4), 8, 2**64 - 1),
    "array item type": (lambda d: after(d, b"test.values", 4), 4, 77),
    "array length": (lambda d: after(d, b"test.values", 8), 8, 2**63),
    "nested arrays": (lambda d: after(d, b"test.values", 4), 4, 9),
    "tensor dimensions": (lambda d: after(d, b"test.tensor"), 4, 2**31),
    "tensor type": (lambda d: after(d, b"test.tensor", 12), 4, 1000),
    "tensor offset": (lambda d: after(d, b"test.tensor", 16), 8, 2**64 - 1),
}


@pytest.mark.parametrize("what", CORRUPTIONS)
def test_inspect_corrupt_gguf_header(tmp_path, what):
    path = gguf_with_tensor(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    where, size, value = CORRUPTIONS[what]
    at = where(data)
    data[at : at + size] = value.to_bytes(size, "little")
    path.write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning printed on stderr would be a second line
        fails("inspect", path, names=path, match="corrupt or truncated model file")


def test_inspect_architecture_that_is_not_a_string(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    at = after(data, b"general.architecture")
    data[at : at + 4] = (4).to_bytes(4, "little")  # uint32: the string's length bytes become a number
    path.write_bytes(bytes(data))
    fails("inspect", path, names=path, match="corrupt or truncated model file")
