"""``pitools run``: generate text, streaming it to standard output."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.commands.options import load_llm, runtime_options
from powerinfer_tools import kernels as compiled_kernels
from powerinfer_tools.commands.spellings import model_argument
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.runtime.engine import RuntimeModel
from powerinfer_tools.runtime.warmup import Policy, load_compiled
from powerinfer_tools.runtime.generation import SamplingConfig
from powerinfer_tools.units import format_size

DEFAULT_PROMPT = "def "


@click.command()
@model_argument(default=BUNDLED_MODEL)
@click.option("-p", "--prompt", default=DEFAULT_PROMPT, show_default=True,
              help="Text to continue; it must be valid UTF-8 (other bytes are an error, not replaced).")
@click.option("-f", "--file", "prompt_file", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="Read the prompt from FILE instead (UTF-8 text; one newline at its end is dropped, as llama.cpp's "
                   "-f does).")
@click.option("-n", "--n-tokens", default=64, show_default=True,
              help="Most tokens to generate (0 or more); fewer when the context window fills up.")
# The sampling defaults are SamplingConfig's, the Python API's (LLM.generate) too.
@click.option("--temp", default=SamplingConfig.temperature, show_default=True,
              help="Sampling temperature (>= 0); 0 is greedy, the default here and in the Python API. The HTTP API "
                   "of `pitools serve` takes OpenAI's default instead, 1.")
@click.option("--top-k", default=SamplingConfig.top_k, show_default=True,
              help="Sample among the K likeliest tokens (0: all).")
@click.option("--top-p", default=SamplingConfig.top_p, show_default=True,
              help="Sample from the smallest set with this much mass, in (0, 1].")
@click.option("--seed", type=int, default=None, help="Random seed (0 to 2^64 - 1) for reproducible sampling.")
@click.option("-v", "--verbose", is_flag=True,
              help="Before generating, print on stderr how each part of the model is computed: per group of "
                   "alike layers, whether the compiled decoder or the general path (and why) decodes a token, "
                   "the kernel of attention, gate/up and down, the FFN's variant; then the output head's kernel "
                   "and the prompt's path.")
@runtime_options
def run(model: Path, prompt: str, prompt_file: Path | None, n_tokens: int, temp: float, top_k: int, top_p: float,
        seed: int | None, verbose: bool, **runtime) -> None:
    """Generate a continuation of PROMPT with MODEL, streaming it to stdout.

    MODEL is a GGUF file (dense or PowerInfer, run by the sparse runtime) or a
    Hugging Face checkpoint folder (run by the NumPy reference engine); by
    default the bundled tiny ReLU LLaMA checkpoint. A summary line goes to
    stderr: prompt and generation speed, the mean fraction of FFN neurons
    computed, bytes of weights read per step, and the GPU's share of FFN work;
    where the run started on the NumPy kernels while the compiled ones were
    built (the first run of a kind of model on a machine: --kernels), how many
    tokens it computed before it moved onto them; with --ram, the weights in
    memory, the neuron caches' hit rate and the bytes read from disk per step;
    last, which path decodes tokens (the compiled decoder, or the general path
    and why: --verbose says more).

    \b
    Examples:
      pitools run -p "import os" -n 48
      pitools run -m model.gguf -f prompt.txt
      pitools run model.powerinfer.gguf --mode sparse --device cuda -p "def "
      pitools run model.powerinfer.gguf --device cuda --vram 8GB -p "def "
      pitools run model.powerinfer.gguf --ram 2GB -p "def "
      pitools run model.powerinfer.gguf --verbose -p "def "
    """
    if prompt_file is not None:
        prompt = _prompt_from(prompt_file, prompt)
    sampling = SamplingConfig(temperature=temp, top_k=top_k, top_p=top_p, seed=seed)  # checked before loading
    llm = load_llm(model, default_kernels=Policy.BACKGROUND, **runtime)
    if isinstance(llm.engine, RuntimeModel) and not compiled_kernels.reference_chosen():
        # The compiled code brought in from numba's cache, and the weights' pages touched, before the clock starts
        # (as the bench's warm-up rounds and `pitools serve` do): the summary's rates are the engine's per-token speed.
        load_compiled(llm.engine)
    pieces = llm.generate(prompt, n_tokens, sampling)  # checks the prompt before any of it is echoed
    if verbose:
        click.echo("pitools: how this run computes:\n" + "\n".join(f"  {line}" for line in llm.execution_report()),
                   err=True)
    click.echo(prompt, nl=False)
    for piece in pieces:
        click.echo(piece, nl=False)
        sys.stdout.flush()
    click.echo()
    s = llm.last_stats
    if s.stopped_at_window:
        click.echo(f"pitools: note: stopped at the end of the context window ({s.context_size} positions: "
                   f"{s.prompt_tokens} of prompt, {s.generated_tokens} generated)", err=True)
    click.echo(f"{_summary(llm)} | {llm.description}", err=True)


def _summary(llm) -> str:
    """The summary line's figures of ``llm``'s last generation: rates, FFN work, the move onto the compiled
    kernels, the RAM tier."""
    s = llm.last_stats
    summary = (f"{_throughput('prompt', s.prompt_tokens, s.prompt_rate)} | "
               f"{_throughput('generation', s.generated_tokens, s.generation_rate)}")
    if s.ffn.steps:
        summary += (
            f" | FFN density {s.ffn.density:.3f} | {s.ffn.bytes_per_step / 1e6:.2f} MB read/step"
            f" | GPU share {s.ffn.device_share:.2f}"
        )
    if (moved := s.handover) is not None:
        summary += (f" | the first {moved.reference_steps} tokens on the NumPy kernels, "
                    + ("then a wait for the compiled ones (more steps on these would have ended the run later)" if moved.waited
                       else "the rest on the compiled ones (built meanwhile)"))
    ram_state = getattr(llm.engine, "ram", None)
    if ram_state is not None:
        summary += (f" | weights in memory {format_size(ram_state.resident_bytes)} of "
                    f"{format_size(ram_state.plan.budget)}"
                    f" | cache hit rate {_hit_rate(s.ffn)} | {s.ffn.disk_bytes / max(s.ffn.steps, 1) / 1e6:.2f} MB "
                    "from disk/step")
    return summary


def _prompt_from(path: Path, prompt: str) -> str:
    """The prompt in the file ``path`` (-f), which -p must not also give."""
    if click.get_current_context().get_parameter_source("prompt") is click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError("give the prompt once: -p TEXT or -f FILE")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PitoolsError(f"{path}: the prompt file is not UTF-8 text (at byte {exc.start})") from None
    except OSError as exc:
        raise PitoolsError(f"{path}: cannot read the prompt file: {exc.strerror}") from None
    return text.removesuffix("\n")  # the newline that ends a text file's last line is not part of the prompt


def _hit_rate(ffn) -> str:
    """The neuron caches' hit rate; a run that never needed a neuron from outside memory has none."""
    return f"{ffn.hit_rate:.2f}" if ffn.cache_hits + ffn.cache_misses else "- (no neuron read from disk)"


def _throughput(what: str, tokens: int, rate: float | None) -> str:
    """``prompt: <n> tokens at <rate> tok/s``; without the rate when none was measured (no tokens, no time)."""
    return f"{what}: {tokens} tokens" + (f" at {rate:.1f} tok/s" if rate is not None else "")

