"""``pitools run``: generate text, streaming it to standard output."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from powerinfer_tools import kernels
from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.runtime.generation import SamplingConfig
from powerinfer_tools.runtime.llm import LLM
from powerinfer_tools.solver.hardware import DEFAULT_PRESET, PRESETS
from powerinfer_tools.commands.options import ram_options
from powerinfer_tools.units import format_size, parse_size


@click.command()
@click.argument("model", type=click.Path(path_type=Path, exists=True), default=BUNDLED_MODEL, required=False)
@click.option("-p", "--prompt", default="def ", show_default=True,
              help="Text to continue; it must be valid UTF-8 (other bytes are an error, not replaced).")
@click.option("-n", "--n-tokens", default=64, show_default=True,
              help="Most tokens to generate (0 or more); fewer when the context window fills up.")
@click.option("-c", "--ctx-size", type=int, default=None,
              help="Context window: positions for prompt and generated tokens together [default: the "
                   "model's trained positions, also the most it takes].")
@click.option("--temp", default=0.0, show_default=True, help="Sampling temperature (>= 0); 0 is greedy.")
@click.option("--top-k", default=40, show_default=True, help="Sample among the K likeliest tokens (0: all).")
@click.option("--top-p", default=0.95, show_default=True,
              help="Sample from the smallest set with this much mass, in (0, 1].")
@click.option("--seed", type=int, default=None, help="Random seed (0 to 2^64 - 1) for reproducible sampling.")
@click.option("--mode", type=click.Choice([FFNMode.SPARSE.value, FFNMode.DENSE.value]), default=FFNMode.SPARSE.value,
              show_default=True,
              help="sparse: compute only the FFN neurons the predictors (or a SiLU model's thresholds) select; "
                   "dense: all of them.")
@click.option("--device", type=click.Choice(["cpu", "cuda", "emulated"]), default="cpu", show_default=True,
              help="Where the split's hot neurons run: cpu ignores the split; emulated is a NumPy stand-in "
                   "for a GPU that checks the budget and counts PCIe bytes (for testing).")
@click.option("-t", "--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for the compiled kernels [default: all cores].")
@click.option("--split", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="GPU split file [default: MODEL.generated.gpuidx beside the model, if present].")
@click.option("--no-split", is_flag=True, help="Ignore any split file.")
@click.option("--vram", default=None,
              help="GPU memory budget (11GB, 800MiB, ...): solve the split for it now, unless the split file "
                   "was already solved for this budget, and keep it beside the model as PowerInfer does.")
@click.option("--hardware", default=DEFAULT_PRESET, show_default=True,
              help=f"With --vram: preset ({', '.join(PRESETS)}) or profile file from `pitools probe`.")
@ram_options
def run(model: Path, prompt: str, n_tokens: int, ctx_size: int | None, temp: float, top_k: int, top_p: float,
        seed: int | None, mode: str, device: str, threads: int | None, split: Path | None, no_split: bool,
        vram: str | None, hardware: str, ram: str | None, cache_policy: str) -> None:
    """Generate a continuation of PROMPT with MODEL, streaming it to stdout.

    MODEL is a GGUF file (dense or PowerInfer, run by the sparse runtime) or a
    Hugging Face checkpoint folder (run by the NumPy reference engine); by
    default the bundled tiny ReLU LLaMA checkpoint. A summary line goes to
    stderr: prompt and generation speed, the mean fraction of FFN neurons
    computed, bytes of weights read per step, and the GPU's share of FFN work;
    with --ram, the weights in memory, the neuron caches' hit rate and the
    bytes read from disk per step.

    \b
    Examples:
      pitools run -p "import os" -n 48
      pitools run model.powerinfer.gguf --mode sparse --device cuda -p "def "
      pitools run model.powerinfer.gguf --device cuda --vram 8GB -p "def "
      pitools run model.powerinfer.gguf --ram 2GB -p "def "
    """
    sampling = SamplingConfig(temperature=temp, top_k=top_k, top_p=top_p, seed=seed)  # checked before loading
    budget = parse_size(vram, "--vram") if vram is not None else None
    ram_budget = parse_size(ram, "--ram") if ram is not None else None
    if threads is not None:
        kernels.set_threads(threads)
    _spin_only_on_idle_cores(kernels.get_threads())
    if split is not None and vram is None and not split.is_file():
        raise PitoolsError(f"{split}: no such split file (give --vram to solve one)")
    llm = LLM.load(model, mode=mode, split=split, use_split=not no_split, device=device, vram=budget,
                   hardware=hardware, ctx_size=ctx_size, ram=ram_budget, cache_policy=cache_policy)
    pieces = llm.generate(prompt, n_tokens, sampling)  # checks the prompt before any of it is echoed
    click.echo(prompt, nl=False)
    for piece in pieces:
        click.echo(piece, nl=False)
        sys.stdout.flush()
    click.echo()
    s = llm.last_stats
    if s.stopped_at_window:
        click.echo(f"pitools: note: stopped at the end of the context window ({s.context_size} positions: "
                   f"{s.prompt_tokens} of prompt, {s.generated_tokens} generated)", err=True)
    summary = (f"{_throughput('prompt', s.prompt_tokens, s.prompt_rate)} | "
               f"{_throughput('generation', s.generated_tokens, s.generation_rate)}")
    if s.ffn.steps:
        summary += (
            f" | FFN density {s.ffn.density:.3f} | {s.ffn.bytes_per_step / 1e6:.2f} MB read/step"
            f" | GPU share {s.ffn.device_share:.2f}"
        )
    ram_state = getattr(llm.engine, "ram", None)
    if ram_state is not None:
        summary += (f" | weights in memory {format_size(ram_state.resident_bytes)} of {format_size(ram_budget)}"
                    f" | cache hit rate {s.ffn.hit_rate:.2f} | {s.ffn.disk_bytes / max(s.ffn.steps, 1) / 1e6:.2f} MB "
                    "from disk/step")
    click.echo(f"{summary} | {llm.description}", err=True)


def _throughput(what: str, tokens: int, rate: float | None) -> str:
    """``prompt: 5 tokens at 812.3 tok/s``; without the rate when none was measured (no tokens, no time)."""
    return f"{what}: {tokens} tokens" + (f" at {rate:.1f} tok/s" if rate is not None else "")


def _spin_only_on_idle_cores(threads: int) -> None:
    """Load the compiled kernels with OpenMP's waiting threads asleep (``OMP_WAIT_POLICY=passive``) when
    other work holds the cores.

    The kernels' parallel loops run on libgomp, whose threads spin while they wait, by default. That
    is the quickest hand-over on idle cores, but when another process holds a core the spinning
    thread burns its time slice waiting for its preempted partner, at every one of a token's ~110
    joins: on the shared 2-core machine at a load of 9-12, a TinyLlama-shape token took 550-760 ms
    spinning against 116-136 ms passive. So: passive when fewer cores are idle (by the 1-minute load
    average) than there are threads, unless the user set the variable. libgomp reads it once, as it
    loads with ggml's CPU library; the variable is unset again after, so that no child process or
    later in-process caller inherits it.
    """
    idle = (os.cpu_count() or 1) - os.getloadavg()[0]
    if "OMP_WAIT_POLICY" in os.environ or idle >= threads - 0.5:
        return
    os.environ["OMP_WAIT_POLICY"] = "passive"
    try:
        kernels.available()
    finally:
        del os.environ["OMP_WAIT_POLICY"]
