"""``pitools bench``: tokens/s of our runtime against llama.cpp on the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import click

from powerinfer_tools.benchmarking.bench import (
    DENSE,
    LLAMA_CPP,
    SPARSE,
    BenchSettings,
    bench_quality,
    format_report,
    measure_bandwidth,
    predictor_summary,
    ram_within_limit,
    report,
    run_bench,
)
from powerinfer_tools.benchmarking.synth import dense_companion
from powerinfer_tools.commands.options import neuron_choice_option
from powerinfer_tools.commands.spellings import model_argument
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.solver.hardware import load_profile
from powerinfer_tools.units import parse_size

_DEFAULTS = BenchSettings()


@click.command("bench", context_settings={"help_option_names": ["-h", "--help"]})
@model_argument(kind=click.Path(dir_okay=False, exists=True, path_type=Path), required=True)
@click.option("--baseline", type=click.Choice([LLAMA_CPP, "none"]), default=LLAMA_CPP, show_default=True,
              help="Engine to compare against.")
@click.option("--baseline-model", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="Dense GGUF of the same weights for llama.cpp [default: beside MODEL, as `pitools synth` "
                   "writes it: m.powerinfer.gguf -> m.gguf].")
@click.option("-n", "--generate", type=click.IntRange(min=1), default=_DEFAULTS.generate, show_default=True,
              help="Decoding steps per run.")
@click.option("-p", "--prompt-tokens", type=click.IntRange(min=1), default=_DEFAULTS.prompt_tokens,
              show_default=True, help="Prompt length.")
@click.option("--runs", type=click.IntRange(min=1), default=_DEFAULTS.runs, show_default=True,
              help="Rounds: measured runs per engine, each in a fresh process after its own warm-up run; "
                   "medians are reported.")
@click.option("-t", "--threads", type=click.IntRange(min=1), default=_DEFAULTS.threads, show_default=True,
              help="Threads of every engine.")
@click.option("--powerinfer", type=click.Path(path_type=Path), default=None, metavar="PATH",
              help="PowerInfer's own `main` (a CPU build of SJTU-IPADS/PowerInfer): run it on MODEL as a third "
                   "engine.")
@click.option("--mode", "modes", type=click.Choice([SPARSE, DENSE, "none"]), multiple=True,
              help="Our runtime's FFN modes to run (repeatable); none: only the other engines (for a memory limit "
                   "below what our runtime needs) [default: both].")
@click.option("--hardware", default=None,
              help="Hardware profile whose CPU bandwidth to use (a `pitools probe` output); default: probe now.")
@click.option("--memory-limit", default=None, metavar="SIZE",
              help="Run every engine's process in a Linux memory cgroup of SIZE (e.g. 2GB), page cache counted, "
                   "as on a machine with that much memory; each starts with its model file out of the page cache. "
                   "Needs root or a delegated cgroup. An engine the kernel kills for exceeding it ends the bench "
                   "with that error.")
@click.option("--ram", default=None, metavar="SIZE",
              help="Our runtime's weights budget (as `pitools run --ram`: a neuron cache over the cold neurons). "
                   "With --memory-limit it defaults to the limit less our runtime's fixed memory and its KV cache.")
@click.option("--quality-steps", type=click.IntRange(min=0), default=_DEFAULTS.quality_steps, show_default=True,
              help="After the timed rounds, off the clock: decode the first N steps again sparse and dense on MODEL "
                   "and report top-1 agreement, KL and perplexity against dense, and the recall the predictors "
                   "achieved (every neuron computed beside them); 0: skip.")
@neuron_choice_option
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress output.")
def bench(model, baseline, baseline_model, generate, prompt_tokens, runs, threads, powerinfer, modes, hardware,
          memory_limit, ram, quality_steps, neuron_choice, as_json, quiet) -> None:
    """Benchmark MODEL on our runtime, sparse and dense, against llama.cpp
    (and PowerInfer's runtime).

    Sparse runs MODEL with its predictors; dense computes every neuron, on
    the baseline's dense GGUF (the same file llama.cpp reads) when there is
    one, else on MODEL.

    Each engine runs alone: per round, each in turn gets a fresh process
    that loads the model, makes a warm-up run and the measured run, and
    exits before the next starts; the order rotates every round, for --runs
    rounds. A run processes a prompt of --prompt-tokens tokens of the
    bundled held-out text in one block, then decodes the --generate tokens
    that follow it one at a time (the same tokens for every engine). Printed
    per engine: prompt and generation tokens/s, weight bytes read per
    generated token, the bandwidth that implies and its fraction of the
    probed memory bandwidth, the fraction of FFN neurons computed, and peak
    RSS against the target (model file + KV cache + 15%). Then the ratios to
    llama.cpp (medians of per-round ratios), under the JSON keys
    sparse_vs_llamacpp_generation, dense_vs_llamacpp_generation and
    sparse_vs_llamacpp_prompt; the CPU model, each engine's settings, and
    our runtime's path and kernels per layer (as `pitools run --verbose`).

    What the speed costs is measured after the rounds, off the clock
    (--quality-steps): the sparse run's top-1 agreement with dense, the KL
    divergence of its next-token distribution from dense's, perplexity of
    the text's next tokens, and the recall its predictors achieved.

    Every engine gets --threads threads (OpenMP, OpenBLAS, numba, llama.cpp,
    PowerInfer's -t) and otherwise its libraries' defaults: OMP_WAIT_POLICY
    and the like pass through as set in the environment. llama.cpp runs at
    its defaults, weight repacking (CPU_REPACK) on; where its AMX path
    faults (a probe process tries it first), AMX alone is turned off.

    --powerinfer runs PowerInfer's main on MODEL with the prompt's text,
    greedily (no teacher forcing), timed by the timings it prints.

    \b
    Examples:
      pitools synth --shape tinyllama-1.1b -o tl.powerinfer.gguf
      pitools bench tl.powerinfer.gguf --threads 2 --json
      pitools bench tl.powerinfer.gguf --powerinfer ~/PowerInfer/build/bin/main
    """
    settings = _settings(model, prompt_tokens, generate, runs, threads, memory_limit, ram, modes, quality_steps,
                         neuron_choice)
    baseline_model = _baseline_file(model, baseline, baseline_model)
    log = (lambda message: None) if quiet else (lambda message: click.echo(message, err=True))
    bandwidth, source = _bandwidth(hardware, threads, log)
    modes = tuple(m for m in modes if m != "none") if modes else (SPARSE, DENSE)
    if not modes and baseline_model is None and powerinfer is None:
        raise PitoolsError("--mode none and --baseline none leave no engine to run")
    results = run_bench(model, baseline_model, settings, modes, log, powerinfer)
    sparse = SPARSE in results
    rep = report(results, settings, bandwidth, source, predictor_summary(model) if sparse else None,
                 bench_quality(model, settings, log) if sparse else None)
    click.echo(json.dumps(rep, indent=2) if as_json else format_report(rep))


def _baseline_file(model: Path, baseline: str, baseline_model: Path | None) -> Path | None:
    """llama.cpp's dense GGUF: the one given, else the one beside MODEL; None with --baseline none."""
    if baseline == "none":
        return None
    if baseline_model is None:
        baseline_model = dense_companion(model)
        if not baseline_model.is_file():
            raise PitoolsError(f"no dense GGUF for llama.cpp at {baseline_model}; give --baseline-model FILE.gguf "
                               "(or --baseline none)")
    return baseline_model


def _bandwidth(hardware: str | None, threads: int, log) -> tuple[float, str]:
    """The CPU bandwidth (GB/s) the report compares with, and where it comes from."""
    if hardware is not None:
        profile = load_profile(hardware)
        return profile.cpu_bandwidth_gbs, f"hardware profile {profile.name}"
    log("probing memory bandwidth (as `pitools probe`) ...")
    return measure_bandwidth(threads), f"`pitools probe` measurement, {threads} threads"


def _settings(model: Path, prompt_tokens: int, generate: int, runs: int, threads: int, memory_limit: str | None,
              ram: str | None, modes: tuple[str, ...], quality_steps: int, neuron_choice: str) -> BenchSettings:
    """The checked settings; under a memory limit without --ram, our runtime's weights get what the limit
    leaves them."""
    limit = parse_size(memory_limit, "--memory-limit") if memory_limit is not None else None
    budget = parse_size(ram, "--ram") if ram is not None else None
    if budget is None and limit is not None and modes != ("none",):
        budget = ram_within_limit(model, limit, prompt_tokens + generate)
    return BenchSettings(prompt_tokens=prompt_tokens, generate=generate, runs=runs, threads=threads,
                         memory_limit=limit, ram=budget, quality_steps=quality_steps, neuron_choice=neuron_choice)
