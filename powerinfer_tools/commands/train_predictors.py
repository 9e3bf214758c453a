"""``pitools train-predictors``: train each layer's neuron predictor from a profile."""

from __future__ import annotations

import json
from pathlib import Path

import click

from powerinfer_tools.cluster.workers import ray_workers
from powerinfer_tools.commands.options import ray_option
from powerinfer_tools.errors import Interrupted, PitoolsError
from powerinfer_tools.fileio import check_output_folder
from powerinfer_tools.formats.predictor_folder import format_predictor_report, predictor_report, read_predictors
from powerinfer_tools.predictors import trainer as predictors
from powerinfer_tools.predictors.trainer import TrainSettings

_DEFAULTS = TrainSettings()


@click.command("train-predictors", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("profile_dir", metavar="DIR", required=False,
                type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Predictor folder to write (or resume).")
@click.option("--recall", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=_DEFAULTS.recall,
              show_default=True, help="Held-out recall every layer's predictor must reach.")
@click.option("--budget", type=click.FloatRange(0, min_open=True), default=_DEFAULTS.budget, show_default=True,
              help="Size of all predictors together, as a fraction of the FFN weights.")
@click.option("--min-precision", type=click.FloatRange(0, 1), default=_DEFAULTS.min_precision, show_default=True,
              help="Precision a hidden size must also reach to be chosen over the next larger one.")
@click.option("--epochs", type=click.IntRange(min=1), default=_DEFAULTS.epochs, show_default=True,
              help="Epochs over the training pairs per candidate size (more when recall is short).")
@click.option("--seed", default=_DEFAULTS.seed, show_default=True, help="Seed for initial weights and batch order.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="cuda trains with CuPy on the GPU; auto uses it when present.")
@click.option("--force", is_flag=True, help="Start over even if the output folder holds predictors.")
@click.option("--report", "report_dir", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="Only report on this existing predictor folder.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress output.")
@ray_option
def train_predictors(profile_dir, output, recall, budget, min_precision, epochs, seed, device, force,
                     report_dir, as_json, quiet, ray_address) -> None:
    """Train the neuron predictors of a profiled model.

    DIR is a finished `pitools profile` folder. For every layer an MLP
    fc2·relu(fc1·x) learns from the profile's pairs (x: the residual stream
    entering the FFN, before its norm; which neurons fired) which neurons fire;
    a neuron counts as predicted when its output is >= 0, the rule of
    PowerInfer's runtime. Each layer gets the smallest hidden size
    of a ladder (8, 12, 16, 24, 32, 48, ...) that reaches --recall on held-out
    pairs (the tuning half of the profile's last 10%) at --min-precision,
    within what is left of --budget; easy layers
    leave budget to harder ones. The sizes are searched by doubling and
    bisection from the previous layer's size, and a candidate whose learning
    curve cannot pass is stopped early; a layer where no size passes keeps the
    best trade-off and says so. A warning comes first when the profile holds
    fewer than 10 pairs per input dimension. Written after every layer: run
    the same command again after an interruption and it resumes.

    The folder holds predictors.safetensors (blk.N.fc1.weight, blk.N.fc2.weight)
    and predictors.json; `pitools convert --predictors` reads it. The report
    (also with --report PRED alone) shows per layer the hidden size, recall,
    precision, the fraction of neurons computed against the fraction firing,
    and bytes, measured on the other half of the held-out pairs, which chose
    nothing.

    \b
    Examples:
      pitools train-predictors prof -o pred
      pitools train-predictors prof -o pred --recall 0.97 --budget 0.15
      pitools train-predictors --report pred --json
      pitools train-predictors prof -o pred --ray 10.0.0.5:6379
    """
    if report_dir is None:
        if profile_dir is None or output is None:
            raise PitoolsError("give a profile DIR and -o PRED to train, or --report PRED to report on predictors")
        check_output_folder(output)
        settings = TrainSettings(recall=recall, budget=budget, min_precision=min_precision, epochs=epochs, seed=seed)
        try:
            with ray_workers(ray_address) as workers:
                meta = predictors.train_predictors(profile_dir, output, settings, device=device, force=force,
                                                   progress=not quiet,
                                                   candidates=workers and workers.candidates)
        except KeyboardInterrupt as exc:
            raise Interrupted.of(exc).resumable(
                f"run the same command again to resume after the last layer saved in {output}") from None
    else:
        meta = read_predictors(report_dir, require_complete=False).meta
    report = predictor_report(meta)
    click.echo(json.dumps(report, indent=2) if as_json else format_predictor_report(report))
