"""Typed metadata keys (formats/metadata_keys.py): a model file's or split file's key of another type, of
the wrong length, non-finite or out of range is one error naming the file and the key -- in `inspect`,
`solve` and `run` alike, never a traceback, never clamped; a split solved for another model file, named with
--split, is refused; inspect refuses predictors that do not fit, as run does.

The fuzz test at the end rewrites one typed key of a model file or a split file at a time with a value of another
GGUF type (or a wrong length, a value out of range, nothing) and runs the commands that read it, in the manner of
tests/test_fuzz.py (with its contract checks: tests/cli_checks.py). Case ``i`` rewrites key ``i`` of the two tables
(modulo their number: each key in every run) with a value drawn from ``random.Random(SEED + i)``; it is printed
when it fails, and is its own test id:
``pytest 'tests/test_typed_metadata.py::test_typed_key_fuzz_case[17]'``. 120 cases by default;
``PITOOLS_METADATA_FUZZ_CASES=N`` runs N.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from cli_checks import Command, check, fails, folders, invoke, run_command, snapshot, solve_command
from gguf import GGUFValueType as V
from gguf_fixtures import rewrite_gguf
from powerinfer_tools.formats.constants import (CACHE_BYTES_KEY, DENSE_ON_GPU_KEY, MODEL_FINGERPRINT_KEY,
                                                RAM_BUDGET_KEY, SPARSE_THRESHOLD_KEY, VRAM_BUDGET_KEY,
                                                VRAM_CAPACITY_KEY)
from powerinfer_tools.formats.metadata_keys import ANY, MODEL_KEYS, SPLIT_KEYS, TypedKey
from powerinfer_tools.formats.model_file import open_model_file

pytestmark = pytest.mark.usefixtures("bounded_memory")

TOKENS, TYPES = "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"
MODEL = "m.powerinfer.gguf"
RAM = "600KB"  # the tiered split's RAM budget: some neurons in RAM, the rest on disk behind a cache


@dataclass(frozen=True)
class Splits:
    gpu: Path  # solved with --vram: every key the GPU placement has
    tiered: Path  # solved with --vram and --ram: also the RAM tier's keys


@pytest.fixture(scope="module")
def splits(small_powerinfer_file, tmp_path_factory) -> Splits:
    """Split files solved for the fuzz test's PowerInfer model file (a copy of it has its fingerprint)."""
    root = tmp_path_factory.mktemp("splits")
    for name, budgets in (("gpu", ["--vram", "1MB"]), ("tiered", ["--vram", "70KB", "--ram", RAM])):
        result = invoke("solve", small_powerinfer_file, *budgets, "--reserve", "0B", "--time-limit", "2",
                        "-o", root / f"{name}.gpuidx")
        assert result.exit_code == 0, result.output
    return Splits(root / "gpu.gpuidx", root / "tiered.gpuidx")


@pytest.fixture
def model(small_powerinfer_file, tmp_path) -> Path:
    """A copy of the PowerInfer model file in a folder of its own (``in``), beside an empty ``out``."""
    inputs, _ = folders(tmp_path, "in", "out")
    return Path(shutil.copyfile(small_powerinfer_file, inputs / MODEL))


def split_copy(source: Path, model: Path, name: str = "s.gpuidx") -> Path:
    return Path(shutil.copyfile(source, model.parent / name))


def run_args(model: Path, *extra) -> list:
    return ["run", model, "-n", "2", "-p", "def ", "-t", "1", *extra]


def split_run_args(model: Path, split: Path, *extra) -> list:
    return run_args(model, "--split", split, "--device", "emulated", *extra)


def refused_alike(commands: list[list], match: str, names: Path) -> None:
    """Every command fails as the contract says, with one line saying ``match`` and naming ``names``; the inputs
    (the folder of ``names``) stay as they were and no output appears beside them."""
    inputs = names.parent
    before = snapshot(inputs)
    lines = {fails(*args, names=names, match=match) for args in commands}
    assert len(lines) == 1, lines  # the same line from each
    assert snapshot(inputs) == before and list((inputs.parent / "out").iterdir()) == []


def model_commands(model: Path) -> list[list]:
    out = model.parent.parent / "out"
    return [["inspect", model], ["solve", model, "--vram", "1MB", "--reserve", "0B", "-o", out / "x.gpuidx"],
            run_args(model)]


# --- model files -------------------------------------------------------------------------------------------


def test_a_sparse_threshold_that_is_a_string(model):
    rewrite_gguf(model, {SPARSE_THRESHOLD_KEY: ("abc", V.STRING)})
    refused_alike(model_commands(model), f"{SPARSE_THRESHOLD_KEY} must be a finite number, not 'abc'", model)


def test_a_token_twice_in_the_vocabulary(model):
    tokens = open_model_file(model).get(TOKENS)
    twice = list(tokens)
    twice[300] = tokens[200]  # llama.cpp aborts on such a vocabulary (llama-vocab.cpp: a map from text to id)
    rewrite_gguf(model, {TOKENS: (twice, V.ARRAY, V.STRING)})
    refused_alike(model_commands(model), f"{TOKENS} holds {tokens[200]!r} twice (at 200 and 300)", model)


def test_empty_tokens_may_repeat_as_llama_cpp_renames_them(model):
    tokens = list(open_model_file(model).get(TOKENS))
    tokens[300] = tokens[301] = ""  # llama.cpp reads each as "[EMPTY_<id>]"
    rewrite_gguf(model, {TOKENS: (tokens, V.ARRAY, V.STRING)})
    for args in model_commands(model):
        assert invoke(*args).exit_code == 0


def test_a_vocabulary_shorter_than_the_embedding(model):
    """Checked with the tensors (inspect shows a file whose tensors do not fit), before a token is sampled."""
    types = open_model_file(model).get(TYPES)
    tokens = open_model_file(model).get(TOKENS)
    rewrite_gguf(model, {TOKENS: (tokens[:-1], V.ARRAY, V.STRING), TYPES: (types[:-1], V.ARRAY, V.INT32)})
    refused_alike(model_commands(model)[1:], f"{TOKENS} must hold {len(tokens)} tokens, not", model)


def test_frequencies_of_another_type(model):
    key = "pitools.blk.1.neuron_frequency"
    rewrite_gguf(model, {key: (["a", "b"], V.ARRAY, V.STRING)})
    refused_alike(model_commands(model), f"{key} is not an array of numbers: ['a', 'b'] (2 items)", model)


def test_inspect_refuses_predictors_that_do_not_fit_as_run_and_solve_do(model):
    fc2 = open_model_file(model)["blk.0.fc2.weight"].data
    rewrite_gguf(model, {}, tensors={"blk.0.fc2.weight": np.ascontiguousarray(fc2[:, :-1])})
    hidden = fc2.shape[1]
    refused_alike(model_commands(model), f"tensor blk.0.fc2.weight has shape [64, {hidden - 1}]; "
                                         f"the metadata implies [64, {hidden}]", model)


# --- split files -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source, key, value, match", [
    ("gpu", DENSE_ON_GPU_KEY, ([True], V.ARRAY, V.BOOL), "must hold 2 true-or-false values, not [True] (1 item)"),
    ("gpu", VRAM_BUDGET_KEY, ("10MB", V.STRING), "must be a non-negative integer, not '10MB'"),
    ("gpu", VRAM_CAPACITY_KEY, ("1000", V.STRING), "must be a non-negative integer, not '1000'"),
    ("tiered", RAM_BUDGET_KEY, ([600000], V.ARRAY, V.UINT64), "must be a non-negative integer, not [600000] (1 item)"),
    ("tiered", CACHE_BYTES_KEY, (-5, V.INT64), "must be a non-negative integer, not -5"),  # once clamped to 0
])
def test_split_key_of_another_type(model, splits, source, key, value, match):
    split = split_copy(getattr(splits, source), model)
    rewrite_gguf(split, {key: value})
    ram = ["--ram", RAM] if source == "tiered" else []
    refused_alike([split_run_args(model, split, *ram)], f"{split}: {key} {match}", split)


def test_a_split_solved_for_another_model_file_is_refused(model, splits):
    other = model.parent / "other.powerinfer.gguf"
    shutil.copyfile(model, other)
    rewrite_gguf(other, {"general.name": ("another model of the same shape", V.STRING)})
    split = split_copy(splits.gpu, model)
    line = fails(*split_run_args(other, split), names=split, match=f"solved for another model file than {other}")
    assert MODEL_FINGERPRINT_KEY in line
    assert invoke(*split_run_args(model, split)).exit_code == 0  # the model it was solved for


def test_a_split_that_records_no_model_is_taken_as_before(model, splits):
    split = split_copy(splits.gpu, model)
    rewrite_gguf(split, {MODEL_FINGERPRINT_KEY: None})  # as PowerInfer's own splits
    other = model.parent / "other.powerinfer.gguf"
    shutil.copyfile(model, other)
    rewrite_gguf(other, {"general.name": ("another model of the same shape", V.STRING)})
    result = invoke(*split_run_args(other, split))
    assert result.exit_code == 0, result.stderr


def test_intact_splits_run(model, splits):
    for split, extra in ((splits.gpu, []), (splits.tiered, ["--ram", RAM])):
        result = invoke(*split_run_args(model, split_copy(split, model), *extra))
        assert result.exit_code == 0, result.stderr


# --- the fuzz test -------------------------------------------------------------------------------------------

SEED = 20_250_300
DEFAULT_CASES = 120
N_LAYERS = 2  # the small model's, so its splits'


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "typed_case" in metafunc.fixturenames:
        metafunc.parametrize("typed_case", range(int(os.environ.get("PITOOLS_METADATA_FUZZ_CASES", DEFAULT_CASES))))


def concrete_key(rng: random.Random, template: str, arch: str) -> str:
    """One key the table's entry stands for ({layer}: one of the model's, {name}: a kind of threshold)."""
    return template.format(arch=arch, layer=rng.randrange(N_LAYERS), expert=0,
                           name=rng.choice(["cats", "ffn_in", "ffn_down"]))


# Values at the edges of each kind, and the GGUF types to store them as.
EDGES = {int: [0, 1, 7, -1, -5, 2**31, 2**32 - 1, 2**62],
         float: [0.0, -1.0, 0.5, 1.5, 1e30, -1e30, 1e-45, float("nan"), float("inf"), float("-inf")],
         str: ["", "abc", "x" * 300], bool: [True, False]}
INT_TYPES = {V.UINT32: (0, 2**32 - 1), V.INT32: (-(2**31), 2**31 - 1), V.UINT64: (0, 2**64 - 1),
             V.INT64: (-(2**63), 2**63 - 1)}
OTHER_TYPES = {float: [V.FLOAT32, V.FLOAT64], str: [V.STRING], bool: [V.BOOL]}


def gguf_type(rng: random.Random, kind: type, values: list) -> V:
    """A GGUF type for items of ``kind`` that holds every one of ``values``."""
    if kind is not int:
        return rng.choice(OTHER_TYPES[kind])
    return rng.choice([t for t, (low, high) in INT_TYPES.items() if low <= min(values) and max(values) <= high])


def stored(rng: random.Random, kind: type, value) -> tuple:
    """``value`` (an item of ``kind``, or a list of them) with the GGUF type(s) to store it as."""
    if isinstance(value, list):
        return value, V.ARRAY, gguf_type(rng, kind, value)
    return value, gguf_type(rng, kind, [value])


def odd_value(rng: random.Random, typed: TypedKey, original) -> tuple | None:
    """A value for a key of ``typed`` unlike ``original`` (None: absent): of another kind (an integer where a
    number is due included), an array for a scalar and the reverse, an edge of its kind (negative, non-finite,
    out of range), a wrong length, an item twice; or None, the key removed."""
    count = len(original) if isinstance(original, list) and original else rng.choice([1, N_LAYERS, 64])

    def edge(kind: type, array: bool):
        return [rng.choice(EDGES[kind]) for _ in range(count)] if array else rng.choice(EDGES[kind])

    array, other = typed.length is not None, rng.choice([k for k in EDGES if k is not typed.kind])
    mutations = {
        "another kind": lambda: stored(rng, other, edge(other, array)),
        "the other shape": lambda: stored(rng, other, edge(other, not array)),
        "nothing": lambda: None,
    }
    if typed.kind is not str:  # what a string means is its reader's business, not its type's
        mutations["an edge of its kind"] = lambda: stored(rng, typed.kind, edge(typed.kind, array))
    if isinstance(original, list) and original:
        mutations["wrong length"] = lambda: stored(rng, typed.kind, rng.choice(
            [v for v in (original[:-1], original + original[-1:], original[:1], original * 2) if v]))
        mutations["one odd item"] = lambda: stored(rng, typed.kind, _replaced(original, rng.randrange(len(original)),
                                                                              edge(typed.kind, False)))
        if typed.distinct and len(original) > 1:
            i, j = rng.sample(range(len(original)), 2)
            mutations["an item twice"] = lambda: stored(rng, typed.kind, _replaced(original, j, original[i]))
    return mutations[rng.choice(sorted(mutations))]()


def _replaced(values: list, index: int, item) -> list:
    changed = list(values)
    changed[index] = item
    return changed


# Case i rewrites key i (modulo their number) of the two tables: every key is fuzzed in every run.
FUZZED_KEYS = [("model", template) for template in sorted(MODEL_KEYS)] + [("split", template)
                                                                         for template in sorted(SPLIT_KEYS)]


def model_case(rng: random.Random, template: str, model: Path, out: Path) -> tuple[str, list[Command]]:
    key = concrete_key(rng, template, "llama")
    value = odd_value(rng, MODEL_KEYS[template], open_model_file(model).metadata.get(key))
    rewrite_gguf(model, {key: value})
    commands = [Command(["inspect", model], names=(model.name,)),
                solve_command(model, out, "--vram", "1MB", "--reserve", "0B"),
                run_command(model)]
    return f"{model.name}: {key} = {_described(value)}", commands


def split_case(rng: random.Random, template: str, model: Path, splits: Splits) -> tuple[str, list[Command]]:
    source = rng.choice(["gpu", "tiered"])
    split = split_copy(getattr(splits, source), model, "fuzzed.gpuidx")
    key = concrete_key(rng, template, "generic.gpu_index")
    value = odd_value(rng, SPLIT_KEYS[template], open_model_file(split).metadata.get(key))
    rewrite_gguf(split, {key: value})
    ram = ["--ram", RAM] if source == "tiered" else []
    commands = [Command(["inspect", split], names=(split.name,)),
                Command(split_run_args(model, split, *ram), names=(split.name,))]
    return f"{source} split: {key} = {_described(value)}", commands


def _described(value) -> str:
    if value is None:
        return "(removed)"
    shown = repr(value[0])
    return f"{shown[:120]} as {' of '.join(t.name for t in value[1:])}"


def test_typed_key_fuzz_case(typed_case, small_powerinfer_file, splits, tmp_path):
    seed = SEED + typed_case
    rng = random.Random(seed)
    inputs, out = folders(tmp_path, "in", "out")
    model = Path(shutil.copyfile(small_powerinfer_file, inputs / MODEL))
    kind, template = FUZZED_KEYS[typed_case % len(FUZZED_KEYS)]
    change, commands = (model_case(rng, template, model, out) if kind == "model"
                        else split_case(rng, template, model, splits))
    problems = [p for command in commands for p in check(command, inputs, out)[1]]
    report = f"typed-key fuzz case {typed_case} (seed {seed}): {change}\n" + "\n".join(problems)
    if problems:
        pytest.fail(report, pytrace=False)


def test_every_key_of_the_tables_is_of_a_kind_the_fuzz_test_knows():
    for typed in (*MODEL_KEYS.values(), *SPLIT_KEYS.values()):
        assert typed.kind in EDGES and (typed.length in (None, ANY) or "." in typed.length)
