"""One name per concept across commands, as llama.cpp spells it: MODEL or -m/--model, -c/--ctx-size, -f/--file for
run's prompt, --force, --mode, --split for a GPU split and --dataset-split for a dataset's, one rule for sizes.
Each old spelling still works, hidden from the help, with a one-line note on stderr; given beside its new
spelling it is a usage error."""

from __future__ import annotations

import json

import pytest
from cli_checks import invoke

from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.commands.cli import COMMANDS, cli
from powerinfer_tools.runtime.generation import SamplingConfig
from powerinfer_tools.runtime.llm import LLM

# (command, old spelling, new spelling)
RENAMED = [("convert", "-f", "--force"), ("bundle", "-f", "--force"), ("synth", "-f", "--force"),
           ("solve", "--ctx", "--ctx-size"), ("perplexity", "--sparse", "--mode"),
           ("perplexity", "--split", "--dataset-split"), ("profile", "--split", "--dataset-split")]
MODEL_COMMANDS = ["advise", "bench", "bundle", "inspect", "perplexity", "profile", "run", "serve", "solve"]


def command(name: str):
    return cli.get_command(None, name)


def note(old: str, new: str) -> str:
    return f"pitools: note: {old} is deprecated; use {new}\n"


@pytest.mark.parametrize("name, old, new", RENAMED)
def test_an_old_spelling_is_hidden_beside_the_new_one(name, old, new):
    options = {opt: param for param in command(name).params for opt in param.opts + param.secondary_opts}
    assert options[old].hidden and not options[new].hidden
    help_text = invoke(name, "--help").stdout
    assert f"{new} " in help_text and f"{old}," not in help_text and f"{old} " not in help_text


@pytest.mark.parametrize("name", MODEL_COMMANDS)
def test_every_command_of_a_model_takes_it_as_m_too(name):
    options = {opt for param in command(name).params for opt in param.opts}
    assert {"-m", "--model"} <= options
    some_file = BUNDLED_MODEL / "config.json"  # any existing file: refused before it is read
    result = invoke(name, some_file, "-m", some_file)
    assert result.exit_code == 2 and "give the model once: as MODEL or as -m/--model" in result.stderr


def test_a_command_that_needs_a_model_says_so_for_either_spelling():
    result = invoke("inspect")
    assert result.exit_code == 2 and "give the model: MODEL, or -m/--model MODEL" in result.stderr


def test_the_perplexity_mode_spelled_the_old_way_gives_the_same_result():
    args = ["perplexity", "--tokens", "300", "--seq-len", "64", "--json", "-q"]
    new = invoke(*args, "--mode", "oracle")
    old = invoke(*args, "--sparse", "oracle")
    assert new.exit_code == 0 and old.exit_code == 0, old.stderr
    assert json.loads(old.stdout) == json.loads(new.stdout) and not new.stderr
    assert old.stderr == note("--sparse", "--mode")
    predicted = invoke(*args, "--sparse", "predicted")  # the old spelling of sparse, with the old option
    assert predicted.exit_code == 1 and "--predictors PRED goes with --mode sparse" in predicted.stderr
    both = invoke(*args, "--sparse", "oracle", "--mode", "dense")
    assert both.exit_code == 2 and "--sparse is the old spelling of --mode: give --mode alone" in both.stderr


def test_the_dataset_split_spelled_the_old_way_is_noted():
    args = ["perplexity", "--tokens", "300", "--seq-len", "64", "--json", "-q"]
    old = invoke(*args, "--split", "validation")  # no --dataset: the split is not read
    assert old.exit_code == 0 and old.stderr == note("--split", "--dataset-split")
    assert json.loads(old.stdout) == json.loads(invoke(*args).stdout)
    profile = invoke("profile", "--split", "train")  # no -o: refused after the note
    assert profile.stderr.splitlines() == [note("--split", "--dataset-split").strip(),
                                           "pitools: error: give -o DIR to profile into, or --report DIR to report "
                                           "on an existing profile"]


def test_solve_context_spelled_the_old_way_solves_the_same(small_powerinfer_file, tmp_path):
    args = ["solve", small_powerinfer_file, "--vram", "600MiB", "-o", tmp_path / "split", "--force", "--json"]
    new, old = invoke(*args, "--ctx-size", "64"), invoke(*args, "--ctx", "64")
    assert new.exit_code == 0 and old.exit_code == 0, old.stderr
    assert old.stderr == note("--ctx", "--ctx-size")
    assert json.loads(old.stdout)["placement"] == json.loads(new.stdout)["placement"]
    other = json.loads(invoke(*args, "-c", "2048").stdout)["placement"]
    assert other["vram_bytes"]["kv_cache"] > json.loads(new.stdout)["placement"]["vram_bytes"]["kv_cache"]


def test_force_spelled_f_still_overwrites(tmp_path, small_powerinfer_file):
    out = tmp_path / "m.gguf"
    convert = ["convert", BUNDLED_MODEL, "--dense", "--outtype", "f32", "-o", out, "-q"]
    assert invoke(*convert).exit_code == 0
    assert invoke(*convert).exit_code == 1  # exists
    old = invoke(*convert, "-f")
    assert old.exit_code == 0 and old.stderr == note("-f", "--force")
    bundled = tmp_path / "b.powerinfer.gguf"
    assert invoke("bundle", small_powerinfer_file, "-o", bundled, "-q").exit_code == 0
    old = invoke("bundle", "-m", small_powerinfer_file, "-o", bundled, "-q", "-f")
    assert old.exit_code == 0 and old.stderr == note("-f", "--force")
    synth = invoke("synth", "--shape", "test-tiny", "-o", tmp_path / "s.powerinfer.gguf", "-f", "--target-sparsity",
                   "0.5")  # refused after the note: a ReLU synthesis takes no target sparsity
    assert synth.exit_code == 1 and synth.stderr.startswith(note("-f", "--force"))


def test_run_reads_its_prompt_from_a_file_as_llama_cpp_does(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("import os\n")  # a text file's last newline is not part of the prompt
    args = ["run", "-n", "4", "--temp", "0"]
    from_file = invoke(*args, "-m", BUNDLED_MODEL, "-f", prompt)
    from_text = invoke(*args, BUNDLED_MODEL, "-p", "import os")
    assert from_file.exit_code == 0, from_file.stderr
    assert from_file.stdout == from_text.stdout and from_file.stdout.startswith("import os")
    both = invoke(*args, "-f", prompt, "-p", "x")
    assert both.exit_code == 2 and "give the prompt once: -p TEXT or -f FILE" in both.stderr
    prompt.write_bytes(b"def \xff")
    bad = invoke(*args, "--file", prompt)
    assert bad.exit_code == 1 and bad.stderr == f"pitools: error: {prompt}: the prompt file is not UTF-8 text (at byte 4)\n"


def test_sampling_defaults_are_alike_in_run_and_the_python_api():
    run = {param.name: param.default for param in command("run").params}
    default = SamplingConfig()
    assert (run["temp"], run["top_k"], run["top_p"]) == (default.temperature, default.top_k, default.top_p)
    assert default.temperature == 0  # greedy
    assert LLM.generate.__defaults__[-1] == default
    assert "OpenAI's default instead, 1" in " ".join(invoke("run", "--help").stdout.split())


def test_the_version_is_in_the_help():
    assert "--version" in invoke("--help").stdout
    assert set(MODEL_COMMANDS) | {"convert", "synth"} <= set(COMMANDS)
