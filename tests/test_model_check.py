"""A model file whose tensor table disagrees with its metadata is refused at load, naming the file
and the tensor, by every reader that computes with it (`run`, `solve`)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from cli_checks import fails, invoke
from gguf import GGMLQuantizationType, GGUFReader
from safetensors.numpy import load_file, save_file


def patched(path: Path, tmp_path: Path, field: str, value: bytes, nth: int = 0) -> Path:
    """A copy of ``path`` with the ``nth`` element of one metadata or tensor-table field overwritten."""
    data = bytearray(path.read_bytes())
    readable = tmp_path / "as-gguf.gguf"  # gguf-py reads GGUF's magic only, not PowerInfer's PWRI
    readable.write_bytes(b"GGUF" + data[4:])
    reader = GGUFReader(readable)
    if field in reader.fields:
        part = reader.fields[field].parts[reader.fields[field].data[nth]]
    else:  # a tensor's type: the table entry's type word
        tensor = next(t for t in reader.tensors if t.name == field)
        part = tensor.field.parts[-2]
    offset = part.ctypes.data - reader.data.ctypes.data
    data[offset : offset + len(value)] = value
    out = tmp_path / path.name
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("command", [["run", "-n", "1"], ["solve", "--vram", "1MB", "--reserve", "0B", "--force"]])
def test_a_width_that_disagrees_with_the_tensors_names_the_tensor(small_powerinfer_file, tmp_path, command):
    bad = patched(small_powerinfer_file, tmp_path, "llama.feed_forward_length", struct.pack("<I", 63))
    fails(command[0], bad, *command[1:], match="tensor blk.0.ffn_gate.weight has shape [64, 32]; "
                                               "the metadata implies [63, 32]")


def test_a_tensor_type_the_runtime_cannot_compute_with_is_named(small_powerinfer_file, tmp_path):
    # The F32 matrix relabelled Q8_1 (one 32-element block per row) still lies within the file: only its type is
    # wrong (one outside formats/weight_types.py: ggml encodes inputs so, not weights).
    q8_1 = struct.pack("<I", GGMLQuantizationType.Q8_1)
    bad = patched(small_powerinfer_file, tmp_path, "blk.0.attn_q.weight", q8_1)
    result = invoke("run", bad, "-n", "1")
    assert result.exit_code == 1 and result.stderr.startswith("pitools: error: "), (result.stderr, result.exception)
    assert "blk.0.attn_q.weight" in result.stderr, result.stderr


def test_frequencies_outside_0_1_name_the_key(small_powerinfer_file, tmp_path):
    bad = patched(small_powerinfer_file, tmp_path, "pitools.blk.1.neuron_frequency", struct.pack("<f", 1.5), nth=3)
    fails("solve", bad, "--vram", "1MB", "--reserve", "0B", "--force",
          match="pitools.blk.1.neuron_frequency must hold 64 firing probabilities in [0, 1]")


def test_weights_beyond_float16_are_refused_for_an_f16_output(small_checkpoint, tmp_path):
    shutil.copytree(small_checkpoint, tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = 1e6
    save_file(tensors, weights)
    out = tmp_path / "out"
    out.mkdir()
    fails("convert", tmp_path / "model", "-o", out / "m.gguf", "--no-sparsity", "--outtype", "f16", "-q",
          match="blk.1.ffn_up.weight holds values beyond float16's range")
    assert list(out.iterdir()) == []
    result = invoke("convert", tmp_path / "model", "-o", out / "m.gguf", "--no-sparsity", "--outtype", "f32", "-q")
    assert result.exit_code == 0, result.stderr


def test_integer_weights_are_refused(small_checkpoint, tmp_path):
    shutil.copytree(small_checkpoint, tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    assert header["model.norm.weight"]["dtype"] == "F32"
    header["model.norm.weight"]["dtype"] = "I32"  # same width: the file stays consistent
    text = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    weights.write_bytes(data[:8] + text + data[8 + length :])
    fails("convert", tmp_path / "model", "-o", tmp_path / "m.gguf", "--no-sparsity", "-q",
          match="tensor 'model.norm.weight' is stored as I32; weights must be floating point")


@pytest.mark.parametrize("stored, match", [
    ([0.5, 1.5, 0.0], "must hold 3 routing frequencies in [0, 1]"),
    ([0.5, 0.5], "must hold 3 routing frequencies"),
    (["a", "b", "c"], "is not an array of numbers"),
])
def test_routing_frequencies_that_are_not_shares_name_the_key(stored, match):
    """Read by the RAM plan, `pitools solve` and the bench: one checked reader."""
    from types import SimpleNamespace

    from powerinfer_tools.errors import PitoolsError
    from powerinfer_tools.formats.model_check import routing_frequencies

    model = SimpleNamespace(path="m.gguf", get={"pitools.blk.0.expert_frequency": stored}.get)
    with pytest.raises(PitoolsError, match=rf"m.gguf: pitools.blk.0.expert_frequency {match}".replace("[", r"\[")
                       .replace("]", r"\]")):
        routing_frequencies(model, SimpleNamespace(n_experts=3), 0)
    assert routing_frequencies(SimpleNamespace(path="m", get={}.get), SimpleNamespace(n_experts=3), 0) is None
