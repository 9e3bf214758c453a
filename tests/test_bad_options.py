"""Bad option values of `pitools run`, `solve` and `probe`, and of the Python API that `run` wraps:
one line naming the option, exit status 1, nothing written, no input changed."""

from __future__ import annotations

import pytest
from cli_checks import fails
from click.testing import CliRunner
from powerinfer_tools.solver.split import ensure_split

from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.commands.cli import cli
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.runtime.generation import SamplingConfig
from powerinfer_tools.runtime.llm import LLM, GenerationStats
from powerinfer_tools.units import MAX_SIZE, format_size, parse_size

# --- run: sampling, token count, context size, prompt text -----------------------------------------------


@pytest.mark.parametrize("option, value, match", [
    ("--temp", "-1", "temperature (--temp): must be a finite number >= 0, not -1.0"),
    ("--temp", "nan", "temperature (--temp): must be a finite number >= 0"),
    ("--temp", "inf", "temperature (--temp): must be a finite number >= 0"),
    ("--top-p", "0", "top_p (--top-p): must be in (0, 1], not 0.0"),
    ("--top-p", "1.5", "top_p (--top-p): must be in (0, 1]"),
    ("--top-k", "-5", "top_k (--top-k): must be a whole number >= 0, not -5"),
    ("--seed", "-1", "seed (--seed): must be a whole number from 0 to 2^64 - 1"),
    ("--seed", str(2**64), "seed (--seed): must be a whole number from 0 to 2^64 - 1"),
    ("-n", "-1", "tokens to generate (-n/--n-tokens): must be a whole number >= 0, not -1"),
    ("--ctx-size", "0", "context size (-c/--ctx-size): must be a whole number from 1 to the model's 256 positions"),
    ("-c", "257", "context size (-c/--ctx-size): must be a whole number from 1 to the model's 256 positions"),
    ("--vram", "0B", "--vram: 0 bytes is too small; it must be at least 1 B"),
    ("--vram", "99999999TB", "--vram: 86.74 EiB is too large; sizes stop below 2^63 bytes"),
])
def test_run_refuses_bad_values_in_one_line(option, value, match):
    fails("run", "-p", "def", "--device", "emulated", option, value, match=match)


def test_a_prompt_that_is_not_utf8_is_refused_before_anything_is_printed():
    # On Linux, click hands `-p $'ab\xff'` over as surrogate-escaped text.
    result = CliRunner().invoke(cli, ["run", "-p", "ab\udcff", "-n", "1"])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr == "pitools: error: prompt (-p/--prompt): not valid UTF-8 (at character 2)\n"


def test_zero_tokens_reports_counts_not_rates_of_nothing():
    result = CliRunner().invoke(cli, ["run", "-p", "def", "-n", "0"])
    assert result.exit_code == 0, result.output
    assert "generation: 0 tokens |" in result.stderr
    assert "nan" not in result.stderr and "inf" not in result.stderr


def test_rates_of_untimed_or_empty_phases_are_none():
    assert GenerationStats(prompt_tokens=3, prompt_seconds=0.0).prompt_rate is None  # a coarse clock
    assert GenerationStats(decode_steps=0, generation_seconds=0.5).generation_rate is None
    assert GenerationStats(decode_steps=4, generation_seconds=0.5).generation_rate == 8


def test_the_api_checks_the_same_settings_as_errors_of_both_kinds():
    for bad in (dict(temperature=-0.5), dict(temperature=float("inf")), dict(top_p=0), dict(top_k=1.5),
                dict(top_k=True), dict(seed=-1), dict(seed=2**64)):
        with pytest.raises(PitoolsError):
            SamplingConfig(**bad)
        with pytest.raises(ValueError):
            SamplingConfig(**bad)
    SamplingConfig(temperature=0, top_k=0, top_p=1, seed=2**64 - 1)  # the edges are valid
    llm = LLM.load(BUNDLED_MODEL)
    with pytest.raises(PitoolsError, match=r"tokens to generate \(-n/--n-tokens\)"):
        llm.generate("def", max_tokens=-1)  # at the call, before the first piece is asked for
    with pytest.raises(PitoolsError, match="not valid UTF-8"):
        llm.generate("\ud800")


# --- sizes: solve, run, probe ------------------------------------------------------------------------------


def test_sizes_are_bounded_and_zero_only_where_allowed():
    assert parse_size("0B", "--reserve", minimum=0) == 0
    assert parse_size(f"{MAX_SIZE}B") == MAX_SIZE
    with pytest.raises(PitoolsError, match="--vram: 8.00 EiB is too large"):
        parse_size("8388608TiB", "--vram")  # 2^63
    with pytest.raises(PitoolsError, match="--vram: 0 bytes is too small"):
        parse_size("0.1B", "--vram")  # rounds down to nothing


@pytest.mark.parametrize("nbytes", [1, 1023, 1024, 4_762_149, 4_760_536, 4 * 2**20, 2**30 + 1, 10**15 + 7, 2**50 - 1])
def test_a_minimum_is_printed_as_a_size_that_reads_back_as_enough(nbytes):
    """Rounded up at its last digit (4,762,149 bytes is 4.5415 MiB: "4.54 MiB" is 4,760,535 bytes, too few), and
    by no more than that digit."""
    shown = format_size(nbytes, round_up=True)
    value, unit = shown.split()
    step = parse_size(f"0.01{unit}") if "." in value else 1
    assert nbytes <= parse_size(shown) < nbytes + step
    assert format_size(4_762_149, round_up=True) == "4.55 MiB" and format_size(4_762_149) == "4.54 MiB"


@pytest.mark.parametrize("args, match", [
    (["--vram", "99999999TB"], "--vram: 86.74 EiB is too large"),
    (["--vram", "0GB"], "--vram: 0 bytes is too small"),
    (["--vram", "1GB", "--reserve", "8388608TiB"], "--reserve: 8.00 EiB is too large"),
])
def test_solve_refuses_bad_sizes_and_writes_nothing(tmp_path, args, match):
    model = tmp_path / "m.powerinfer.gguf"
    model.write_bytes(b"read by no one: sizes are checked first")
    fails("solve", model, *args, match=match)
    assert sorted(p.name for p in tmp_path.iterdir()) == [model.name]
    assert model.read_bytes() == b"read by no one: sizes are checked first"


@pytest.mark.parametrize("size, match", [
    ("0B", "--size: 0 B is too small to measure; give at least 4.00 MiB: a pass over less takes about as long"),
    ("1MiB", "--size: 1.00 MiB is too small to measure; give at least 4.00 MiB"),
    ("1000TiB", "--size: 1000.00 TiB is more than this machine's memory"),
])
def test_probe_refuses_sizes_it_cannot_measure(tmp_path, size, match):
    fails("probe", "-o", tmp_path / "hw.toml", "--size", size, match=match)
    assert list(tmp_path.iterdir()) == []


def test_the_api_budget_is_checked_before_the_model_is_read(tmp_path):
    with pytest.raises(PitoolsError, match="VRAM budget: -1 bytes is too small"):
        ensure_split(tmp_path / "absent.gguf", tmp_path / "s.gpuidx", -1, hardware=None)
