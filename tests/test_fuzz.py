"""Fuzz test of the error contract (docs/reference/errors.md).

Each case damages a copy of a tiny model -- its config.json, its safetensors header, the header,
key-value section or tensor table of a model file -- or picks odd option values, then runs the
commands that read it (convert, inspect, solve, run) in-process. Every command must either succeed
with a valid output, or fail with exactly one ``pitools: error:`` line that names the file (or the
option) at fault: no traceback, nothing at the output path, no temporary file left, no input changed.

Case ``i`` is drawn from ``random.Random(SEED + i)``: the failure message prints the seed and the
test id replays the case alone (``pytest 'tests/test_fuzz.py::test_fuzz_case[17]'``). 400 cases by
default; ``PITOOLS_FUZZ_CASES=N`` or ``pytest --fuzz-cases N`` runs N.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from cli_checks import (Command, changed_files, check, folders, refusal_problems, run_command, snapshot, solve_command,
                        uncaught)
from click.testing import CliRunner
from gguf import GGUFReader, GGUFValueType
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.solver.hardware import load_profile

from powerinfer_tools.commands.cli import cli
from powerinfer_tools.conversion.convert import convert

pytestmark = pytest.mark.usefixtures("bounded_memory")

SEED = 20_240_000
DEFAULT_CASES = 400
FAMILIES = {"config": 3, "safetensors": 3, "gguf": 5, "options": 1, "outputs": 1}  # relative frequencies


def case_count(config: pytest.Config) -> int:
    option = config.getoption("--fuzz-cases", default=None)
    return int(option if option is not None else os.environ.get("PITOOLS_FUZZ_CASES", DEFAULT_CASES))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case_index" in metafunc.fixturenames:
        metafunc.parametrize("case_index", range(case_count(metafunc.config)))


# --- the models every case starts from ---------------------------------------------------------------


@dataclass(frozen=True)
class Base:
    checkpoint: Path  # a tiny ReLU LLaMA checkpoint folder
    powerinfer: Path  # its PowerInfer file with predictors and firing frequencies (what solve needs)
    dense: Path  # its dense GGUF file


@pytest.fixture(scope="module")
def base(small_checkpoint, small_powerinfer_file, tmp_path_factory) -> Base:
    dense, _ = convert(str(small_checkpoint), tmp_path_factory.mktemp("fuzz-base") / "m.gguf", "f16", dense=True,
                       progress=False)
    return Base(small_checkpoint, small_powerinfer_file, dense)


# --- mutations: JSON values and config.json ----------------------------------------------------------

HUGE_INTS = [2**31, 2**32, 2**40, 2**63, 2**64, 10**30]
NONFINITE = [float("nan"), float("inf"), float("-inf")]  # Python's json writes and reads these


def odd_json_value(rng: random.Random, original):
    """A value of another type, or a number at an edge, or one near ``original``."""
    kinds = {
        "str": lambda: rng.choice(["", "relu", "32", "x" * 300, "\u2603"]),
        "float": lambda: rng.choice([0.5, 1e308, -1e308, 1e-310, 32.0, 2.5]),
        "bool": lambda: rng.choice([True, False]),
        "list": lambda: rng.choice([[], [32], [original], [[1]]]),
        "dict": lambda: rng.choice([{}, {"value": original}]),
        "null": lambda: None,
        "zero": lambda: 0,
        "negative": lambda: rng.choice([-1, -32, -(2**40)]),
        "huge": lambda: rng.choice(HUGE_INTS),
        "nonfinite": lambda: rng.choice(NONFINITE),
    }
    if isinstance(original, (int, float)) and not isinstance(original, bool):
        kinds["near"] = lambda: rng.choice([original + 1, original - 1, original * 2, original // 2, original * 3])
    return kinds[rng.choice(sorted(kinds))]()


# The fields the converter and the engines read; the rest of config.json gets a share of mutations too.
CONFIG_KEYS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "max_position_embeddings", "vocab_size", "hidden_act", "model_type", "rms_norm_eps", "rope_theta",
               "head_dim", "tie_word_embeddings", "bos_token_id", "eos_token_id", "rope_scaling", "architectures"]
WHOLE_CONFIGS = [b"[1, 2]", b"42", b'"config"', b"null", b'{"model_type": ', b"", b"\xff\xfe{}", b"{}"]


def mutate_config(rng: random.Random, folder: Path) -> str:
    path = folder / "config.json"
    roll = rng.random()
    if roll < 0.1:
        path.write_bytes(content := rng.choice(WHOLE_CONFIGS))
        return f"config.json is {content!r}"
    if roll < 0.13:
        path.unlink()
        path.mkdir()
        return "config.json is a folder"
    config = json.loads(path.read_text())
    key = rng.choice(CONFIG_KEYS) if rng.random() < 0.8 else rng.choice(sorted(config))
    if rng.random() < 0.2:
        config.pop(key, None)
        change = f"config.json without {key!r}"
    else:
        config[key] = odd_json_value(rng, config.get(key))
        change = f"config.json {key!r} = {config[key]!r}"
    path.write_text(json.dumps(config))
    return change[:200]


# --- mutations: the safetensors header ---------------------------------------------------------------

SAFETENSORS_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I8", "U8", "BOOL", "F8_E4M3", "Q4", "", 5, None]


def _odd_shape(rng: random.Random, shape: list):
    return rng.choice([
        list(reversed(shape)), [], [0], shape + [1], [-1] + shape[1:], [2**40] + shape[1:], [2**64, 2**64],
        [3.5] + shape[1:], [str(n) for n in shape], "32", None, [[n] for n in shape], [shape[0] * 2] + shape[1:],
    ])


def _odd_offsets(rng: random.Random, begin: int, end: int, data_bytes: int):
    return rng.choice([
        [end, begin], [begin, end + 4], [begin - 4, end - 4], [-8, end - begin - 8], [begin], [begin, end, 0],
        [data_bytes, data_bytes + end - begin], [begin, 2**64], [float(begin), float(end)], "0-8", None,
        [0, end - begin],  # overlaps the first tensor: readable, if odd
    ])


def _mutate_entry(rng: random.Random, header: dict, data_bytes: int) -> str:
    name = rng.choice(sorted(k for k in header if k != "__metadata__"))
    entry = header[name]
    what = rng.choice(["dtype", "shape", "data_offsets", "missing", "entry", "extra tensor"])
    if what == "dtype":
        entry["dtype"] = rng.choice(SAFETENSORS_DTYPES)
    elif what == "shape":
        entry["shape"] = _odd_shape(rng, entry["shape"])
    elif what == "data_offsets":
        entry["data_offsets"] = _odd_offsets(rng, *entry["data_offsets"], data_bytes)
    elif what == "missing":
        del entry[rng.choice(sorted(entry))]
    elif what == "entry":
        header[name] = rng.choice([[], "tensor", None, 7, {}])
    else:
        header["model.extra.weight"] = dict(entry)
    return f"{name}: {what} -> {json.dumps(header.get(name, header.get('model.extra.weight')))[:120]}"


def mutate_safetensors(rng: random.Random, folder: Path) -> str:
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    body, data = raw[8 : 8 + length], raw[8 + length :]
    roll = rng.random()
    if roll < 0.15:
        cut = rng.choice([0, 4, 8, 9, 8 + length // 2, 8 + length, rng.randrange(len(raw))])
        path.write_bytes(raw[:cut])
        return f"truncated to {cut} of {len(raw)} bytes"
    if roll < 0.3:
        bad = rng.choice([0, 1, length - 1, length + 1, len(raw) - 8, len(raw), 2**63, 2**64 - 1])
        path.write_bytes(struct.pack("<Q", bad) + raw[8:])
        return f"header length field {bad} (really {length})"
    if roll < 0.4:
        flipped = bytearray(body)
        for _ in range(rng.randint(1, 4)):
            flipped[rng.randrange(len(flipped))] ^= rng.randrange(1, 256)
        path.write_bytes(raw[:8] + bytes(flipped) + data)
        return "byte flips in the JSON header"
    if roll < 0.45:
        path.unlink()
        path.mkdir()
        return "model.safetensors is a folder"
    header, data = json.loads(body), bytearray(data)
    if roll < 0.52:
        header, change = rng.choice([[1, 2], 7, "header", None]), "header is not an object"
    elif roll < 0.62:
        change = _poison_weight(rng, header, data)
    else:
        change = _mutate_entry(rng, header, len(data))
    new_body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new_body)) + new_body + data)
    return change


def _poison_weight(rng: random.Random, header: dict, data: bytearray) -> str:
    """One weight NaN or infinite: convert must refuse it, naming the tensor (we never pass --allow-nonfinite)."""
    name = rng.choice(sorted(k for k, entry in header.items() if k != "__metadata__" and entry["dtype"] == "F32"))
    begin, end = header[name]["data_offsets"]
    index, value = rng.randrange((end - begin) // 4), rng.choice(NONFINITE)
    data[begin + 4 * index : begin + 4 * index + 4] = struct.pack("<f", value)
    return f"{name}[{index}] = {value}"


# --- mutations: model file (GGUF) headers, key-value section, tensor table --------------------------


@dataclass(frozen=True)
class Spot:
    """One number in a model file: what it is, where, its type and its original value."""

    label: str
    offset: int
    dtype: np.dtype
    value: float


@dataclass
class Layout:
    size: int
    header: list[Spot] = field(default_factory=list)  # version, tensor count, kv count
    values: dict[str, list[Spot]] = field(default_factory=dict)  # key -> its value(s)
    structure: dict[str, list[Spot]] = field(default_factory=dict)  # "key length", "type id", ... -> spots


def _spot(label: str, offset: int, part: np.ndarray) -> Spot:
    return Spot(label, offset, part.dtype, part[0].item())


def _field_spots(layout: Layout, field_, starts: list[int]) -> None:
    name, parts, kind = field_.name, field_.parts, field_.types[0]

    def add(what: str, i: int) -> None:
        layout.structure.setdefault(what, []).append(_spot(f"{name} {what}", starts[i], parts[i]))
    add("key length", 0)
    add("type id", 2)
    if kind == GGUFValueType.ARRAY:
        add("array item type", 3)
        add("array length", 4)
    strings = GGUFValueType.STRING in field_.types
    for i in field_.data[:4]:
        if strings:
            add("string length", i - 1)
        else:
            layout.values.setdefault(name, []).append(_spot(name, starts[i], parts[i]))


def _tensor_spots(layout: Layout, tensor, starts: list[int]) -> None:
    parts = tensor.field.parts  # name length, name, n_dims, dims, type, data offset
    for what, i in (("tensor name length", 0), ("tensor n_dims", 2), ("tensor dims", 3), ("tensor type", 4),
                    ("tensor data offset", 5)):
        layout.structure.setdefault(what, []).append(_spot(f"{tensor.name} {what}", starts[i], parts[i]))


def read_layout(path: Path, tmp: Path) -> Layout:
    """Where every number of ``path``'s header, key-value section and tensor table lies (gguf-py's reader,
    independent of ours, on a copy carrying the GGUF magic that gguf-py insists on)."""
    copy = tmp / path.name
    copy.write_bytes(b"GGUF" + path.read_bytes()[4:])
    reader = GGUFReader(copy)
    layout = Layout(size=path.stat().st_size)
    for field_ in reader.fields.values():
        starts = list(np.cumsum([field_.offset] + [p.nbytes for p in field_.parts]))
        if field_.name.startswith("GGUF."):
            layout.header.append(_spot(field_.name, field_.offset, field_.parts[0]))
        else:
            _field_spots(layout, field_, starts)
    for tensor in reader.tensors:
        _tensor_spots(layout, tensor, list(np.cumsum([tensor.field.offset] + [p.nbytes for p in tensor.field.parts])))
    return layout


KNOWN_KEYS = ["llama.block_count", "llama.attention.head_count", "llama.attention.head_count_kv",
              "llama.embedding_length", "llama.context_length", "llama.feed_forward_length", "llama.vocab_size",
              "llama.rope.dimension_count", "llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base",
              "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "pitools.blk.0.neuron_frequency",
              "pitools.blk.1.neuron_frequency", "pitools.sparse_threshold"]


def odd_number(rng: random.Random, spot: Spot) -> bytes:
    """A value of ``spot``'s type at an edge, or near the original, encoded as the file stores it."""
    if spot.dtype.kind == "f":
        value = rng.choice([0.0, -1.0, 2.0, 1e30, -1e30, 1e-45, *NONFINITE, spot.value * 2, -spot.value])
        return np.array([value], dtype=spot.dtype).tobytes()
    info = np.iinfo(spot.dtype) if spot.dtype.kind in "iu" else np.iinfo(np.uint8)
    original = int(spot.value)
    value = rng.choice([0, 1, 2, 3, -1, original - 1, original + 1, original * 2, original // 2, original * 1000,
                        2**31, 2**32 - 1, 2**63, info.max, info.min])
    return np.array([min(max(value, info.min), info.max)], dtype=spot.dtype).tobytes()


def _overwrite(data: bytearray, spot: Spot, new: bytes) -> str:
    data[spot.offset : spot.offset + len(new)] = new
    return f"{spot.label} ({spot.dtype}, was {spot.value!r}) = {np.frombuffer(new, dtype=spot.dtype)[0]!r}"


def _gguf_change(rng: random.Random, layout: Layout, data: bytearray) -> str:
    """One change to ``data``, in place; returns what it was."""
    what = rng.choice(["magic", "header", "known key", "any value", "structure", "structure", "byte flips"])
    if what == "magic":
        magic = rng.choice([b"GGUF", b"PWRI", b"GGML", b"\0\0\0\0", bytes(rng.randrange(256) for _ in range(4))])
        data[:4] = magic
        return f"magic {bytes(magic)!r}"
    if what == "byte flips":
        spots = sorted(rng.randrange(min(4096, len(data))) for _ in range(rng.randint(1, 16)))
        for at in spots:
            data[at] ^= rng.randrange(1, 256)
        return f"bytes flipped at {spots}"
    if what == "header":
        spot = rng.choice(layout.header)
    elif what == "known key":
        spot = rng.choice(layout.values[rng.choice([k for k in KNOWN_KEYS if k in layout.values])])
    elif what == "any value":
        spot = rng.choice(layout.values[rng.choice(sorted(layout.values))])
    else:
        spot = rng.choice(layout.structure[rng.choice(sorted(layout.structure))])
    return _overwrite(data, spot, odd_number(rng, spot))


def mutate_gguf(rng: random.Random, path: Path, layout: Layout) -> str:
    data = bytearray(path.read_bytes())
    changes = [_gguf_change(rng, layout, data) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
    if rng.random() < 0.15:
        cut = rng.randrange(len(data)) if rng.random() < 0.5 else rng.randrange(min(16384, len(data)))
        del data[cut:]
        changes.append(f"truncated to {cut} of {layout.size} bytes")
    path.write_bytes(bytes(data))
    return "; ".join(changes)


# --- the cases ---------------------------------------------------------------------------------------


def open_finite_model_file(path: Path) -> None:
    """Opens a model file and checks that every tensor is finite, as converting without --allow-nonfinite promises."""
    for tensor in open_model_file(path).tensors.values():
        if not np.isfinite(tensor.dequantize()).all():
            raise ValueError(f"tensor {tensor.name} holds NaN or inf")


def convert_command(folder: Path, output: Path, *options: str) -> Command:
    args = ["convert", folder, "-o", output, "-q", *options]
    return Command(args, output, open_finite_model_file, (folder.name, output.name))


def checkpoint_case(rng: random.Random, base: Base, tmp: Path, mutate) -> tuple[str, list[str]]:
    """convert the damaged checkpoint; run what it wrote, if anything, and the checkpoint itself."""
    folder = tmp / "fuzzed-ckpt"
    shutil.copytree(base.checkpoint, folder)
    out, converted = folders(tmp, "out", "converted")
    change = mutate(rng, folder)
    layout = rng.choice(["--dense", "--no-sparsity"])  # the fastest: no profiling
    output = out / "fuzzed-out.gguf"
    ok, problems = check(convert_command(folder, output, layout, "--outtype", rng.choice(["f32", "f16", "q8_0"])),
                         folder, out)
    if ok:
        shutil.move(output, converted / "fuzzed-converted.gguf")
        problems += check(run_command(converted / "fuzzed-converted.gguf"), converted, out)[1]
    problems += check(run_command(folder), folder, out)[1]
    return f"{change} (convert {layout})", problems


def gguf_case(rng: random.Random, base: Base, layouts: dict[Path, Layout], tmp: Path) -> tuple[str, list[str]]:
    """inspect, solve and run a damaged model file."""
    source = rng.choice([base.powerinfer, base.powerinfer, base.dense])
    inputs, out = folders(tmp, "in", "out")
    model = inputs / f"fuzzed{''.join(source.suffixes)}"
    shutil.copyfile(source, model)
    change = mutate_gguf(rng, model, layouts[source])
    commands = [
        Command(["inspect", model], names=(model.name,)),
        solve_command(model, out, "--vram", "1MB", "--reserve", "0B"),
        run_command(model, "--mode", rng.choice(["sparse", "dense"])),
    ]
    return f"{source.name}: {change}", [p for c in commands for p in check(c, inputs, out)[1]]


RUN_OPTIONS = {
    "--temp": ["-1", "0", "0.7", "nan", "inf", "-inf", "1e308", "abc"],
    "--top-p": ["0", "-0.1", "1", "1.5", "nan", "0.5"],
    "--top-k": ["-5", "0", "1", str(2**40), "2.5"],
    "--n-tokens": ["-1", "0", "1", "40", str(2**40)],
    "--ctx-size": ["-1", "0", "1", "8", "32", "33", str(2**40)],
    "--seed": ["-1", "0", str(2**64), "7"],
    "--prompt": ["", "é", "ab\udcff", "\ud800", "x" * 120_000, "def " * 20],
}
SIZES = ["0B", "-1GB", "1B", "12MB", "99999999TB", "1e400GB", "nanGB", "abc", "4MiB", "1000TiB"]


def options_case(rng: random.Random, base: Base, tmp: Path) -> tuple[str, list[str]]:
    """Odd values of the options that take numbers, sizes and text, on an intact model."""
    inputs, out = folders(tmp, "in", "out")
    model = inputs / "fuzzed.powerinfer.gguf"
    shutil.copyfile(base.powerinfer, model)
    command = rng.choice(["run", "run", "solve", "probe"])
    if command == "run":
        chosen = rng.sample(sorted(RUN_OPTIONS), rng.randint(1, 3))
        extra = [a for option in chosen for a in (option, rng.choice(RUN_OPTIONS[option]))]
        command = run_command(model, *extra, names=tuple(option.lstrip("-") for option in chosen))
    elif command == "solve":
        command = solve_command(model, out, "--vram", rng.choice(SIZES), "--reserve", rng.choice(SIZES),
                                "--ctx-size", rng.choice(["1", "32", str(2**40)]), names=("vram", "reserve", "ctx"))
    else:
        profile = out / "hw.toml"
        args = ["probe", "-o", profile, "--size", rng.choice(SIZES), "--repeats", "1"]
        command = Command(args, profile, load_profile, ("size",))
    return "options", check(command, inputs, out)[1]


# --- output paths that are not regular files --------------------------------------------------------

OUTPUT_KINDS = ["fifo", "character device", "link to a character device", "folder", "missing folder",
                "existing file", "input"]


def make_output(kind: str, folder: Path, command_input: Path | None) -> tuple[Path, str]:
    """An output path of ``kind`` in ``folder`` (made there now) and what it is, as the case's description says
    it. A character device is a private node made here (the null device's numbers), never a real one; where
    this process may not make one, a FIFO stands in."""
    path = folder / "target"
    if kind in ("character device", "link to a character device"):
        try:
            os.mknod(folder / "node", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        except OSError:
            os.mkfifo(folder / "node")
            kind += " (a FIFO: no device node may be made here)"
        if kind.startswith("link"):
            path.symlink_to(folder / "node")
        else:
            path = folder / "node"
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "missing folder":
        path = folder / "missing" / "target"
    elif kind == "existing file":
        path.write_bytes(b"an earlier output")
    else:
        path = command_input
    return path, kind


def file_kinds(folder: Path) -> dict[str, tuple[int, int]]:
    """What each entry of ``folder`` is (its type bits and device numbers), links not followed."""
    return {p.name: (stat.S_IFMT(p.lstat().st_mode), p.lstat().st_rdev) for p in folder.iterdir()}


def outputs_case(rng: random.Random, base: Base, tmp: Path) -> tuple[str, list[str]]:
    """Every command that writes a file, pointed at something that is not a regular file (or at its input, or
    into a missing folder), with and without --force: a refusal in one line that leaves everything as it was.
    Only an ordinary earlier output may be replaced, and only with --force."""
    inputs, special = folders(tmp, "in", "special")
    checkpoint, model = inputs / "ckpt", inputs / "fuzzed.powerinfer.gguf"
    shutil.copytree(base.checkpoint, checkpoint)
    shutil.copyfile(base.powerinfer, model)
    commands = {
        "convert": (["convert", checkpoint, "--dense", "-q"], checkpoint / "model.safetensors"),
        "solve": (["solve", model, "--vram", "1MB", "--reserve", "0B", "--time-limit", "2"], model),
        "bundle": (["bundle", model, "-q"], model),
        "probe": (["probe", "--size", "4MiB", "--repeats", "1"], None),
    }
    args, command_input = commands[rng.choice(sorted(commands))]
    kind = rng.choice([k for k in OUTPUT_KINDS if k != "input" or command_input is not None])
    force = rng.choice([[], ["--force"]])
    target, kind = make_output(kind, special, command_input)
    args = args + ["-o", target] + force
    before, kinds = snapshot(inputs), file_kinds(special)
    result = CliRunner().invoke(cli, [str(a) for a in args])
    replaces = kind == "existing file" and force
    traceback_text = uncaught(result)
    if traceback_text is not None:
        problems = ["uncaught exception: " + traceback_text.splitlines()[-1]]
    elif replaces:
        problems = [] if result.exit_code == 0 else [f"--force did not replace an earlier output: {result.stderr!r}"]
    else:
        problems = refusal_problems(result, Command(args, names=(target.name,))) if result.exit_code else ["exit 0"]
    if file_kinds(special) != kinds:  # an earlier output replaced is a regular file still
        problems.append(f"the folder of the output changed: {kinds} -> {file_kinds(special)}")
    if snapshot(inputs) != before:
        problems.append(f"an input changed: {changed_files(before, snapshot(inputs))}")
    return f"{args[0]} -o {kind} {' '.join(force)}", [f"{Command(args)}: {p}" for p in problems]


@pytest.fixture(scope="module")
def layouts(base, tmp_path_factory) -> dict[Path, Layout]:
    tmp = tmp_path_factory.mktemp("layouts")
    return {path: read_layout(path, tmp) for path in (base.powerinfer, base.dense)}


def test_the_harness_passes_intact_inputs(base, layouts, tmp_path):
    """An undamaged checkpoint and model file go through every command (no false alarms)."""
    folder = tmp_path / "fuzzed-ckpt"
    shutil.copytree(base.checkpoint, folder)
    inputs, out = folders(tmp_path, "in", "out")
    model = inputs / "fuzzed.powerinfer.gguf"
    shutil.copyfile(base.powerinfer, model)
    for command, watched in [(convert_command(folder, out / "fuzzed-out.gguf", "--dense"), folder),
                             (Command(["inspect", model]), inputs),
                             (solve_command(model, out, "--vram", "1MB", "--reserve", "0B"), inputs),
                             (run_command(model), inputs), (run_command(folder), folder)]:
        assert check(command, watched, out) == (True, [])


def test_the_harness_sees_tracebacks_and_leftovers(base, tmp_path, monkeypatch):
    inputs, out = folders(tmp_path, "in", "out")
    model = inputs / "fuzzed.gguf"
    shutil.copyfile(base.dense, model)

    def crash(path):
        (out / ".left.tmp").write_bytes(b"")
        return 1 / 0

    monkeypatch.setattr("powerinfer_tools.commands.inspect.open_model_file", crash)
    ok, problems = check(Command(["inspect", model]), inputs, out)
    assert not ok and "ZeroDivisionError" in problems[0] and "holds ['.left.tmp'], expected []" in problems[1]
    monkeypatch.setattr("powerinfer_tools.commands.inspect.open_model_file", lambda path: model.write_bytes(b""))
    ok, problems = check(Command(["inspect", model]), inputs, out)
    assert not ok and any("an input changed: ['fuzzed.gguf']" in p for p in problems)


def test_fuzz_case(case_index, base, layouts, tmp_path):
    seed = SEED + case_index
    rng = random.Random(seed)
    family = rng.choices(sorted(FAMILIES), weights=[FAMILIES[f] for f in sorted(FAMILIES)])[0]
    if family == "config":
        change, problems = checkpoint_case(rng, base, tmp_path, mutate_config)
    elif family == "safetensors":
        change, problems = checkpoint_case(rng, base, tmp_path, mutate_safetensors)
    elif family == "gguf":
        change, problems = gguf_case(rng, base, layouts, tmp_path)
    elif family == "options":
        change, problems = options_case(rng, base, tmp_path)
    else:
        change, problems = outputs_case(rng, base, tmp_path)
    if problems:  # the case and what went wrong, without pytest's dump of the fixtures
        pytest.fail(f"fuzz case {case_index} (seed {seed}), {family}: {change}\n" + "\n".join(problems), pytrace=False)
