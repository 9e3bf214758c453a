"""``pitools profile``: record which FFN neurons fire on a calibration corpus, and report the skew."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.checkpoints.checkpoint import Checkpoint
from powerinfer_tools.profiling.corpus import CorpusSource, read_tokens, resolve_source
from powerinfer_tools.errors import Interrupted, PitoolsError
from powerinfer_tools.formats.profile_folder import load_profile
from powerinfer_tools.formats.profile_report import export_powerinfer_activations, write_report
from powerinfer_tools.checkpoints.hub import resolve_checkpoint
from powerinfer_tools.models import DecoderModel, load_model
from powerinfer_tools.profiling.profiler import Profiler, ProfileSettings
from powerinfer_tools.checkpoints.tokenizer import CheckpointTokenizer

DEFAULT_SEQ_LEN = 512  # capped by the model's context length


def corpus_options(f):
    """--corpus/--dataset/--split/--text-field/--tokens/--seq-len/--skip-tokens, shared with `perplexity`."""
    options = [
        click.option("--corpus", "corpus", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
                     help="Text file (one document) or JSON-lines file (*.jsonl, one document per line). "
                          "Repeatable. Default: the model folder's heldout.txt."),
        click.option("--dataset", metavar="NAME[:CONFIG]", default=None,
                     help="A Hugging Face hub dataset instead (needs the optional `datasets` package)."),
        click.option("--split", default="train", show_default=True, help="Split of --dataset."),
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
    return f


@dataclass
class ModelOnCorpus:
    """A loaded model and the corpus tokens it will read."""

    folder: Path
    model: DecoderModel
    source: CorpusSource
    tokens: np.ndarray
    seq_len: int


def load_model_and_corpus(model_arg: str, corpus: tuple[Path, ...], dataset: str | None, split: str,
                          text_field: str, n_tokens: int, seq_len: int | None, skip_tokens: int) -> ModelOnCorpus:
    folder = resolve_checkpoint(model_arg)
    model = load_model(Checkpoint(folder))
    spec = model.spec
    source = resolve_source(corpus, dataset, folder, split, text_field)
    tokenizer = CheckpointTokenizer(folder, spec.bos_token_id, spec.eos_token_id)
    tokens, seq_len = corpus_tokens(source, tokenizer, spec.max_positions, n_tokens, seq_len, skip_tokens)
    return ModelOnCorpus(folder, model, source, tokens, seq_len)


def corpus_tokens(source: CorpusSource, tokenizer, max_positions: int, n_tokens: int, seq_len: int | None,
                  skip_tokens: int) -> tuple[np.ndarray, int]:
    """The corpus tokens a model reads, and the window length (checked against its context)."""
    if seq_len is not None and seq_len > max_positions:
        raise PitoolsError(f"--seq-len {seq_len} exceeds the model's context length {max_positions}")
    tokens = read_tokens(source, tokenizer, n_tokens, skip_tokens)
    if len(tokens) < n_tokens:
        click.echo(f"pitools: the corpus has only {len(tokens)} tokens (after skipping {skip_tokens}); "
                   "using all of them", err=True)
    return tokens, seq_len or min(DEFAULT_SEQ_LEN, max_positions)


@click.command("profile", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", default=str(BUNDLED_MODEL), required=False)
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
def profile(model, corpus, dataset, split, text_field, n_tokens, seq_len, skip_tokens, output, pairs_mib, seed,
            force, report_dir, as_json, export_powerinfer, quiet) -> None:
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
    """
    if report_dir is None:
        if output is None:
            raise PitoolsError("give -o DIR to profile into, or --report DIR to report on an existing profile")
        loaded = load_model_and_corpus(model, corpus, dataset, split, text_field, n_tokens, seq_len, skip_tokens)
        settings = ProfileSettings(seq_len=loaded.seq_len, pairs_mib=pairs_mib, seed=seed)
        profiler = Profiler(loaded.model, str(loaded.folder), loaded.tokens, loaded.source.describe(), output,
                            settings)
        try:
            profiler.run(force=force, progress=not quiet)
        except KeyboardInterrupt as exc:
            raise Interrupted.of(exc).resumable(
                f"run the same command again to resume from the last checkpoint in {output}") from None
        report_dir = output
    report, text = write_report(report_dir)
    if export_powerinfer is not None:
        paths = export_powerinfer_activations(load_profile(report_dir)[1], export_powerinfer)
        click.echo(f"pitools: wrote {len(paths)} activation_N.pt files to {export_powerinfer}", err=True)
    click.echo(json.dumps(report, indent=2) if as_json else text)
