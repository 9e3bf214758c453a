"""``pitools profile``: record which FFN neurons fire on a calibration corpus, and report the skew."""

from __future__ import annotations

import json
from pathlib import Path

import click

from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.cluster.ray_layer_ranges import layer_ranges as cut_into_ranges
from powerinfer_tools.cluster.workers import ray_workers
from powerinfer_tools.commands.options import corpus_options, ray_option
from powerinfer_tools.commands.spellings import model_argument
from powerinfer_tools.errors import Interrupted, PitoolsError
from powerinfer_tools.fileio import check_output_folder
from powerinfer_tools.formats.profile_folder import load_profile
from powerinfer_tools.formats.profile_report import export_powerinfer_activations, write_report
from powerinfer_tools.profiling.corpus import load_model_and_corpus
from powerinfer_tools.profiling.profiler import Profiler, ProfileSettings


@click.command("profile", context_settings={"help_option_names": ["-h", "--help"]})
@model_argument(default=str(BUNDLED_MODEL), kind=click.STRING)
@corpus_options
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Profile folder to write (or resume).")
@click.option("--pairs-mib", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Disk cap for the predictor training pairs, all layers together.")
@click.option("--seed", default=0, show_default=True, help="Which tokens' training pairs are kept under the cap.")
@click.option("--force", is_flag=True, help="Start over even if the output folder holds a profile.")
@click.option("--report", "report_dir", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="Only report on this existing profile folder.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--export-powerinfer", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also write PowerInfer's activation_N.pt files into this folder (needs torch).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@ray_option
@click.option("--layer-ranges", type=click.IntRange(min=1), default=None, metavar="N",
              help="With --ray, for a model larger than one node's memory: cut its layers into N ranges, each "
                   "held by a Ray actor that reads only its layers from MODEL's folder, which must be at the "
                   "same path on every node; windows pass from range to range. Needs N CPUs on the cluster. "
                   "The same profile as without it.")
def profile(model, corpus, dataset, dataset_split, text_field, n_tokens, seq_len, skip_tokens, output, pairs_mib, seed,
            force, report_dir, as_json, export_powerinfer, quiet, ray_address, layer_ranges) -> None:
    """Profile MODEL's FFN neurons on a calibration corpus.

    MODEL is a checkpoint folder or hub id (default: the bundled tiny ReLU
    LLaMA, profiled on its held-out text). The reference engine reads the
    corpus in windows of --seq-len tokens and records, per layer and neuron,
    how many tokens it fired on and its mean absolute activated value; it also
    keeps (FFN input, fired mask) pairs on disk for `pitools train-predictors`.
    Progress is saved every 30 seconds: run the same command again after an
    interruption and it resumes.

    At the end (or with --report DIR alone) it prints, per layer, the mean
    fraction of neurons firing per token and the fraction of neurons that carry
    80% of all firings, writes them to DIR/report.json and plots the cumulative
    distribution to DIR/firing_cdf.png (when matplotlib is installed).

    \b
    Examples:
      pitools profile -o prof
      pitools profile SparseLLM/ReluLLaMA-7B --corpus wiki.jsonl --tokens 200000 -o prof7b
      pitools profile --report prof --json
      pitools profile ./ReluLLaMA-70B --corpus wiki.jsonl -o prof70b --ray 10.0.0.5:6379
      pitools profile /shared/ReluLLaMA-70B --corpus wiki.jsonl -o prof70b --ray 10.0.0.5:6379 --layer-ranges 4
    """
    if report_dir is None:
        if output is None:
            raise PitoolsError("give -o DIR to profile into, or --report DIR to report on an existing profile")
        if layer_ranges is not None and ray_address is None:
            raise PitoolsError("--layer-ranges runs the ranges on a Ray cluster: give --ray too")
        check_output_folder(output)
        # With ranges of layers on the cluster, this process reads no layer: a model larger than its memory.
        loaded = load_model_and_corpus(model, corpus, dataset, dataset_split, text_field, n_tokens, seq_len, skip_tokens,
                                       layers=None if layer_ranges is None else range(0))
        settings = ProfileSettings(seq_len=loaded.seq_len, pairs_mib=pairs_mib, seed=seed)
        profiler = Profiler(loaded.model, str(loaded.folder), loaded.tokens, loaded.source.describe(), output,
                            settings)
        ranges = None if layer_ranges is None else cut_into_ranges(loaded.model.spec.n_layers, layer_ranges)
        try:
            with ray_workers(ray_address, ranges, loaded.folder) as workers:
                profiler.run(force=force, progress=not quiet, windows=workers and workers.windows)
        except KeyboardInterrupt as exc:
            raise Interrupted.of(exc).resumable(
                f"run the same command again to resume from the last checkpoint in {output}") from None
        report_dir = output
    report, text = write_report(report_dir)
    if export_powerinfer is not None:
        paths = export_powerinfer_activations(load_profile(report_dir)[1], export_powerinfer)
        click.echo(f"pitools: wrote {len(paths)} activation_N.pt files to {export_powerinfer}", err=True)
    click.echo(json.dumps(report, indent=2) if as_json else text)
