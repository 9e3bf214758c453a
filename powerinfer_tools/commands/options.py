"""Options several commands share, declared once."""

from __future__ import annotations

from pathlib import Path

import click

from powerinfer_tools.profiling.corpus import DEFAULT_SEQ_LEN
from powerinfer_tools.runtime.neuron_cache import DEFAULT_POLICY, POLICIES


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


def ram_options(f):
    """--ram/--cache-policy, shared by `run`, `perplexity` and `bench`."""
    options = [
        click.option("--ram", default=None, metavar="SIZE",
                     help="Memory the model's weights may occupy (4GB, 800MiB, ...): attention, embeddings, head "
                          "and predictors are loaded, the hottest FFN neurons pinned, and the rest read from the "
                          "file (direct I/O) into a neuron cache when the predictor selects them. The budget is "
                          "kept: nothing is read through the page cache. A PowerInfer file; one written by "
                          "`pitools bundle` reads each neuron in one request [default: the whole file, mapped]."),
        click.option("--cache-policy", type=click.Choice(POLICIES), default=DEFAULT_POLICY, show_default=True,
                     help="With --ram: which cached neuron to evict (lru: used longest ago; lfu: used least "
                          "often, see docs/benchmarks.md for the comparison)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f
