"""``pitools advise``: whether sparsity makes MODEL faster here, in numbers, and the command to run."""

from __future__ import annotations

import json
from pathlib import Path

import click

from powerinfer_tools import kernels as compiled_kernels
from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.commands.options import kernels_option
from powerinfer_tools.commands.spellings import model_argument
from powerinfer_tools.runtime.advice import Advice, Budgets, advise as advice_for, mb
from powerinfer_tools.runtime.sparse_verdict import MIN_GAIN
from powerinfer_tools.runtime.warmup import Policy
from powerinfer_tools.solver.hardware import DEFAULT_PRESET, PRESETS


@click.command("advise", context_settings={"help_option_names": ["-h", "--help"]})
@model_argument(default=BUNDLED_MODEL)
@click.option("--vram", default=None, metavar="SIZE",
              help="A GPU's memory (11GB, 12GiB, ...): what the solver would place on it and what its cost model "
                   "predicts (nothing is written).")
@click.option("--ram", default=None, metavar="SIZE",
              help="Memory the weights may occupy (as `pitools run --ram`): what stays in memory, what a token reads "
                   "from disk, predicted sparse and dense.")
@click.option("--hardware", default=DEFAULT_PRESET, show_default=True,
              help=f"With --vram or --ram: the bandwidths the cost model uses, a preset ({', '.join(PRESETS)}) or "
                   "a profile file from `pitools probe`.")
@click.option("-c", "--ctx-size", type=click.IntRange(min=1), default=None,
              help="With --vram or --ram: positions the KV caches are sized for [default: the solver's, 2048].")
@click.option("-t", "--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for the measured check [default: all cores].")
@kernels_option(Policy.BACKGROUND)
@click.option("--no-measure", is_flag=True, help="Skip the measured check of sparse against dense on this machine.")
@click.option("--json", "as_json", is_flag=True, help="Print the advice as JSON.")
def advise(model: Path, vram: str | None, ram: str | None, hardware: str, ctx_size: int | None, threads: int | None,
           kernels: str, no_measure: bool, as_json: bool) -> None:
    """Will activation sparsity make MODEL faster on this machine? In a few
    seconds, in numbers, with the one command to run.

    MODEL is a GGUF file (dense or PowerInfer) or a checkpoint folder. Printed:
    the bytes a decoded token reads by part (output head, attention, FFN);
    whether the FFN has exact zeros (ReLU family) or needs thresholds (SiLU,
    GeGLU: CATS/TEAL); per way to run the FFNs (the file's own, or what a
    conversion would make), the share of neurons computed, the bytes read, the
    speedup those bytes promise over dense and the speed predicted, beside the
    quality the file records; where the file runs sparse, sparse against dense
    measured on this machine (as --mode auto measures it, once per file); with
    --vram or --ram, the solver's placement and its cost model's predictions.
    Last, one recommendation and its command.

    The prediction is the bytes' promise times how fast sparse decoding reads
    its bytes against dense decoding (a share measured by `pitools bench`);
    a measurement here, where there is one, decides over it.

    \b
    Examples:
      pitools advise model.gguf
      pitools advise model.powerinfer.gguf --vram 11GB
      pitools advise model.powerinfer.gguf --ram 4GB --json
    """
    if threads is not None:
        compiled_kernels.set_threads(threads)
    result = advice_for(model, Budgets(vram=vram, ram=ram, hardware=hardware, ctx_size=ctx_size), kernels=kernels,
                        measure=not no_measure, notice=lambda line: click.echo(f"pitools: {line}", err=True))
    click.echo(json.dumps(result.as_dict(), indent=2) if as_json else text(result))


VERDICTS = {"dense": "run dense", "sparse": "run sparse", "auto": "run, --mode auto measuring which is faster",
            "convert": "convert", "gpu": "run on the GPU", "ram": "run within the RAM budget",
            "none": "no command runs it within the budget"}


def text(advice: Advice) -> str:
    """The advice as a reader takes it: the model, its ways to run priced, the checks, the recommendation."""
    lines = [f"{advice.model}: {advice.about}"]
    if advice.options:
        names = [f"{o.name} ({o.flags})" if o.flags else o.name if o.runs_now else f"{o.name} (converted)"
                 for o in advice.options]
        width = max(map(len, names))
        lines += ["", f"{'way to run the FFNs':{width}} {'computed':>8} {'reads':>10} {'promise':>8} {'predicted':>9}  "
                      "quality"]
        for name, o in zip(names, advice.options):
            lines.append(f"{name:{width}} {o.computed:8.1%} {mb(o.bytes.total):>10} {o.promise:7.2f}x "
                         f"{o.predicted:8.2f}x  {o.quality}")
        lines.append(f"(promise: dense bytes over these; predicted: promise x {advice.read_rate:.2f}, sparse "
                     f"decoding's read rate against dense's, {advice.read_rate_source}; sparse must gain "
                     f"{MIN_GAIN:.2f}x)")
    if advice.measured is not None:
        lines.append(f"measured here: {advice.measured.describe()}")
    elif advice.options:
        lines.append(f"measured here: nothing: {advice.not_measured}")
    r = advice.recommendation
    lines += ["", f"recommendation: {VERDICTS[r.verdict]}" + (f": {r.command}" if r.command else "")]
    lines += [f"  - {why}" for why in r.why]
    return "\n".join(lines)
