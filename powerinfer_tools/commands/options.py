"""Options several commands share, declared once."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import click

from powerinfer_tools import kernels as compiled_kernels
from powerinfer_tools.commands.spellings import renamed
from powerinfer_tools.errors import PitoolsError, install_hint
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.runtime.warmup import Policy
from powerinfer_tools.profiling.corpus import DEFAULT_SEQ_LEN
from powerinfer_tools.runtime.gate_choice import NeuronChoice
from powerinfer_tools.runtime.llm import AUTO, LLM
from powerinfer_tools.runtime.neuron_cache import DEFAULT_POLICY, POLICIES
from powerinfer_tools.solver.hardware import DEFAULT_PRESET, PRESETS
from powerinfer_tools.units import parse_size


def kernels_option(default: Policy | None, default_words: str = ""):
    """--kernels: what a command does when the compiled kernels this kind of model needs are not built yet
    (``default``, or None with the defaults in ``default_words``: `run` and `serve` share the option)."""
    return click.option(
        "--kernels", type=click.Choice([p.value for p in Policy]), default=default and default.value,
        show_default=default is not None, envvar="PITOOLS_KERNELS",
        help="When the compiled CPU kernels for this kind of model are not yet built on this machine (once, about "
             "half a minute): wait for them; start at once on the slower NumPy kernels while a background process "
             "builds them, moving onto them as soon as they are ready (waiting instead where the NumPy kernels "
             "would be slower: a busy machine, a large model); or use the NumPy reference only. Also PITOOLS_KERNELS"
             + (f" [default: {default_words}]." if default_words else "."))


def corpus_options(f):
    """--corpus/--dataset/--dataset-split/--text-field/--tokens/--seq-len/--skip-tokens, shared by `profile` and
    `perplexity` (--split, the old spelling of --dataset-split, is run's GPU split file)."""
    options = [
        click.option("--corpus", "corpus", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
                     help="Text file (one document) or JSON-lines file (*.jsonl, one document per line). "
                          "Repeatable. Default: the model folder's heldout.txt."),
        click.option("--dataset", metavar="NAME[:CONFIG]", default=None,
                     help="A Hugging Face hub dataset instead (needs the optional `datasets` package)."),
        click.option("--dataset-split", default="train", show_default=True, help="Split of --dataset."),
        click.option("--text-field", default="text", show_default=True,
                     help="Field holding the text in JSON-lines records and --dataset records."),
        click.option("--tokens", "n_tokens", type=click.IntRange(min=2), default=100_000, show_default=True,
                     help="Tokens to read (fewer if the corpus is shorter)."),
        click.option("--seq-len", type=click.IntRange(min=1), default=None,
                     help=f"Tokens per forward pass, each with a fresh cache [default: {DEFAULT_SEQ_LEN}, "
                          "at most the model's context length]."),
        click.option("--skip-tokens", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Start this many tokens into the corpus (to evaluate on text a profile did not see)."),
    ]
    for option in reversed(options):
        f = option(f)
    return renamed("--split", "--dataset-split", "dataset_split")(f)


def ray_option(f):
    """--ray [ADDRESS], shared by the commands that profile or train predictors (read by ``cluster.workers``)."""
    return click.option(
        "--ray", "ray_address", metavar="[ADDRESS]", is_flag=False, flag_value="auto", default=None,
        help="Profile (a task per window of calibration text) and train the predictors (a task per layer, "
             "per expert of a mixture) on a Ray cluster: ADDRESS "
             "(host:port of its head) joins a running cluster; --ray alone joins $RAY_ADDRESS or the cluster "
             "`ray start` made on this machine, else starts Ray here. The same output as without it on one "
             "BLAS thread (OMP_NUM_THREADS=1), as each task runs (docs/how-to/scale-out.md); needs the ray extra, "
             f"{install_hint('ray')}. Put --ray alone after the "
             "arguments, or it takes the next one for its ADDRESS.",
    )(f)


def ram_options(f):
    """--ram/--cache-policy, shared by `run`, `perplexity` and `bench`."""
    options = [
        click.option("--ram", default=None, metavar="SIZE",
                     help="Memory the model's weights may occupy (4GB, 800MiB, ...): attention, head and "
                          "predictors are loaded, the hottest FFN neurons pinned, and the rest read from the "
                          "file (direct I/O) into a neuron cache when the predictor selects them, as are the "
                          "token embedding's rows (unless the head is the embedding). The budget is "
                          "kept: nothing is read through the page cache. A PowerInfer file; one written by "
                          "`pitools bundle` reads each neuron in one request [default: the whole file, mapped]."),
        click.option("--cache-policy", type=click.Choice(POLICIES), default=DEFAULT_POLICY, show_default=True,
                     help="With --ram: which cached neuron to evict (lru: used longest ago; lfu: used least "
                          "often, see docs/lab/benchmarks.md for the comparison)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def neuron_choice_option(f):
    """--neuron-choice, shared by `run`, `serve`, `perplexity` and `bench`."""
    return click.option(
        "--neuron-choice", type=click.Choice([c.value for c in NeuronChoice]), default=NeuronChoice.AUTO.value,
        show_default=True,
        help="Sparse mode on a ReLU-family model (ReGLU, dReLU): which neurons to compute in each layer is chosen "
             "by its predictor, or by its whole gate (every gate row read, then the up and down rows of the neurons "
             "that fire: exact); auto: per layer, whichever reads fewer bytes by the shares the file records.")(f)


def runtime_options(f):
    """How a model is loaded and run, shared by `run` and `serve` (read by ``load_llm``): -c/--ctx-size,
    --mode, --device, -t/--threads, --split, --no-split, --vram, --hardware, --ram, --cache-policy,
    --neuron-choice."""
    options = [
        click.option("-c", "--ctx-size", type=int, default=None,
                     help="Context window: positions for prompt and generated tokens together [default: the "
                          "model's trained positions, also the most it takes]."),
        click.option("--mode", type=click.Choice([AUTO, FFNMode.SPARSE.value, FFNMode.DENSE.value]),
                     default=AUTO, show_default=True, envvar="PITOOLS_MODE",
                     help="sparse: compute only the FFN neurons the predictors (or a SiLU model's thresholds) "
                          "select; dense: all of them; auto: sparse where that decodes faster than dense on this "
                          "machine (measured once per model file, then kept), else dense. Also PITOOLS_MODE."),
        click.option("--device", type=click.Choice(["cpu", "cuda", "emulated"]), default="cpu", show_default=True,
                     help="Where the split's hot neurons run: cpu ignores the split; emulated is a NumPy stand-in "
                          "for a GPU that checks the budget and counts PCIe bytes (for testing)."),
        click.option("-t", "--threads", type=click.IntRange(min=1), default=None,
                     help="CPU threads for the compiled kernels [default: all cores]."),
        click.option("--split", type=click.Path(path_type=Path, dir_okay=False), default=None,
                     help="GPU split file [default: MODEL.generated.gpuidx beside the model, if present]."),
        click.option("--no-split", is_flag=True, help="Ignore any split file."),
        click.option("--vram", default=None,
                     help="GPU memory budget (11GB, 800MiB, ...): solve the split for it now, unless the split "
                          "file was already solved for this budget, and keep it beside the model as PowerInfer "
                          "does."),
        click.option("--hardware", default=DEFAULT_PRESET, show_default=True,
                     help=f"With --vram: preset ({', '.join(PRESETS)}) or profile file from `pitools probe`."),
        kernels_option(None, "background for run, wait for serve"),
    ]
    f = neuron_choice_option(ram_options(f))  # listed last
    for option in reversed(options):
        f = option(f)
    return f


def load_llm(model: Path, ctx_size: int | None, mode: str, device: str, threads: int | None, split: Path | None,
             no_split: bool, vram: str | None, hardware: str, ram: str | None, cache_policy: str, kernels: str | None,
             neuron_choice: str, default_kernels: Policy) -> LLM:
    """The model loaded as ``runtime_options`` say (``--kernels`` by the command's ``default_kernels`` when not
    given); sizes and the split are checked before anything loads."""
    budget = parse_size(vram, "--vram") if vram is not None else None
    ram_budget = parse_size(ram, "--ram") if ram is not None else None
    if threads is not None:
        compiled_kernels.set_threads(threads)
    if split is not None and vram is None and not split.is_file():
        raise PitoolsError(f"{split}: no such split file (give --vram to solve one)")
    with _spin_only_on_idle_cores(compiled_kernels.get_threads()):
        return LLM.load(model, mode=mode, split=split, use_split=not no_split, device=device, vram=budget,
                        hardware=hardware, ctx_size=ctx_size, ram=ram_budget, cache_policy=cache_policy,
                        kernels=kernels or default_kernels, neuron_choice=neuron_choice,
                        notice=lambda line: click.echo(f"pitools: {line}", err=True))


@contextlib.contextmanager
def _spin_only_on_idle_cores(threads: int):
    """Within: whatever loads the compiled kernels loads them with OpenMP's waiting threads asleep
    (``OMP_WAIT_POLICY=passive``) when other work holds the cores now.

    The kernels' parallel loops run on libgomp, whose threads spin a while as they wait, by default. That
    is the quickest hand-over on idle cores, but when another process holds a core the spinning thread
    burns its time slice waiting for its preempted partner, at every one of a token's joins; on idle cores
    passive waits halve the speed (docs/lab/benchmarks.md, "pitools run and the bench's engine"). So the cores
    are judged by what runs now (``kernels.idle_cores``), not by the 1-minute load average: that average still
    counts the work of the minutes before (a previous run, a build) for minutes after it ended, and chose
    passive on idle cores. The user's setting
    wins. libgomp reads the variable once, as it loads with ggml's CPU library; the variable is unset again
    after, so that no child process or later in-process caller inherits it. (Loading a model loads the
    kernels, unless it runs on the NumPy reference: then numba stays unloaded, but ggml's CPU library is loaded
    all the same where the run moves onto the compiled kernels once a background build has made them:
    ``kernels.load_cpu_library``.)
    """
    if "OMP_WAIT_POLICY" in os.environ or compiled_kernels.idle_cores() >= threads - 0.5:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = "passive"
    try:
        yield
    finally:
        del os.environ["OMP_WAIT_POLICY"]
