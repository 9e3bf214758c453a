"""``pitools perplexity``: language-model perplexity on a corpus, dense or with sparse FFNs."""

from __future__ import annotations

import json
from pathlib import Path

import click

from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.commands.options import corpus_options, neuron_choice_option, ram_options
from powerinfer_tools.commands.spellings import model_argument, renamed
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.predictor_folder import load_predictors
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.profiling.corpus import HELDOUT_FILE, corpus_tokens, load_model_and_corpus, resolve_source
from powerinfer_tools.profiling.perplexity import (
    PerplexityResult,
    format_result,
    oracle_chooser,
    predictor_chooser,
    runtime_perplexity,
)
from powerinfer_tools.profiling.perplexity import perplexity as measure
from powerinfer_tools.runtime.loader import load_runtime_model
from powerinfer_tools.runtime.tokenizer import GGUFTokenizer
from powerinfer_tools.units import parse_size


@click.command("perplexity", context_settings={"help_option_names": ["-h", "--help"]})
@model_argument(default=str(BUNDLED_MODEL), kind=click.STRING)
@corpus_options
# --sparse is this command's old spelling of run's --mode, and "predicted" its old spelling of sparse.
@renamed("--sparse", "--mode", "mode")
@click.option("--mode", type=click.Choice([m.value for m in FFNMode] + ["predicted"]), default="dense",
              show_default=True, help="The FFN modes of `pitools run --mode`, and oracle. dense: every neuron; "
                   "oracle: only the neurons that truly fire; sparse: only those the predictors (or a SiLU model's "
                   "thresholds) select (predicted: its old spelling).")
@click.option("--predictors", "predictor_dir", type=click.Path(file_okay=False, exists=True, path_type=Path),
              default=None, help="Predictor folder from `pitools train-predictors` (for --mode sparse).")
@ram_options
@neuron_choice_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def perplexity(model, corpus, dataset, dataset_split, text_field, n_tokens, seq_len, skip_tokens, mode, predictor_dir,
               ram, cache_policy, neuron_choice, as_json, quiet) -> None:
    """Perplexity of MODEL on a corpus.

    MODEL is a GGUF file, run by the runtime, or a checkpoint folder or hub id,
    run by the NumPy reference engine (default: the bundled tiny ReLU LLaMA, on
    its held-out text; a GGUF defaults to a heldout.txt beside it). The corpus
    is read in windows of --seq-len tokens, each with a fresh cache; every
    token after the first is scored once. --mode takes the FFN modes of
    `pitools run --mode`, and oracle. With oracle or sparse, the fraction of
    FFN neurons computed is reported too, and the recall (share of truly
    firing neurons computed; not for a GGUF file under --ram or with
    thresholds). A GGUF file's --mode sparse uses its own predictors (or
    thresholds).

    \b
    Examples:
      pitools perplexity --tokens 20000
      pitools perplexity --mode sparse --predictors pred --skip-tokens 40000
      pitools perplexity tiny.powerinfer.gguf --mode sparse --corpus heldout.txt
    """
    budget = parse_size(ram, "--ram") if ram is not None else None
    if Path(model).suffix == ".gguf":
        if predictor_dir is not None:
            raise PitoolsError(f"{model}: a GGUF file runs with its own predictors; --predictors is for checkpoints")
        result = _gguf_perplexity(Path(model), corpus, dataset, dataset_split, text_field, n_tokens, seq_len, skip_tokens,
                                  mode, quiet, budget, cache_policy, neuron_choice)
        click.echo(json.dumps(result.as_dict(), indent=2) if as_json else format_result(result))
        return
    if budget is not None or neuron_choice != "auto":
        raise PitoolsError(f"{model}: --ram and --neuron-choice are for GGUF files on the runtime; a checkpoint runs "
                           "on the reference engine")
    if (FFNMode(mode) is FFNMode.SPARSE) != (predictor_dir is not None):
        raise PitoolsError("--predictors PRED goes with --mode sparse, and only with it")
    loaded = load_model_and_corpus(model, corpus, dataset, dataset_split, text_field, n_tokens, seq_len, skip_tokens)
    choose = None
    if FFNMode(mode) is FFNMode.ORACLE:
        choose = oracle_chooser()
    elif FFNMode(mode) is FFNMode.SPARSE:
        threshold, layers = load_predictors(predictor_dir)
        spec = loaded.model.spec
        if len(layers) != spec.n_layers or layers[0][0].shape[1] != spec.d_model or layers[0][1].shape[0] != spec.d_ff:
            raise PitoolsError(f"{predictor_dir}: predictors do not fit this model "
                               f"({spec.n_layers} layers, d_model {spec.d_model}, d_ff {spec.d_ff})")
        choose = predictor_chooser(threshold, layers)
    result = measure(loaded.model, loaded.tokens, loaded.seq_len, mode, choose, progress=not quiet)
    click.echo(json.dumps(result.as_dict(), indent=2) if as_json else format_result(result))


def _gguf_perplexity(path: Path, corpus, dataset, dataset_split, text_field, n_tokens, seq_len, skip_tokens, mode,
                     quiet, ram: int | None, cache_policy: str, neuron_choice: str) -> PerplexityResult:
    model = load_runtime_model(path, use_split=False, ram=ram, cache_policy=cache_policy, neuron_choice=neuron_choice)
    if FFNMode(mode) is FFNMode.SPARSE and not model.can_run_sparse:
        raise PitoolsError(f"{path}: no predictors in the file (convert it with profiling for --mode sparse)")
    if not corpus and dataset is None and not (path.parent / HELDOUT_FILE).is_file():
        raise PitoolsError(f"{path}: no {HELDOUT_FILE} beside the model to default to; pass --corpus FILE or --dataset NAME")
    source = resolve_source(corpus, dataset, path.parent, dataset_split, text_field)
    # Special-token spellings in the text (document separators) parse as the tokens, as the reference
    # engine's Hugging Face tokenizer parses them: both then score the same token stream.
    tokenizer = GGUFTokenizer(model.metadata, parse_special=True, source=str(path))
    tokens, seq_len = corpus_tokens(source, tokenizer, model.spec.max_positions, n_tokens, seq_len, skip_tokens)
    return runtime_perplexity(model, tokens, seq_len, mode, progress=not quiet)
