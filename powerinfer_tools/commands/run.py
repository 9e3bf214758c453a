"""``pitools run``: generate text, streaming it to standard output."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from ..bundled import BUNDLED_MODEL
from ..checkpoint import Checkpoint
from ..generation import Sampler, SamplingConfig, generate, stream_text
from ..models import load_model
from ..tokenizer import CheckpointTokenizer


@click.command()
@click.argument("model", type=click.Path(path_type=Path), default=BUNDLED_MODEL, required=False)
@click.option("-p", "--prompt", default="def ", show_default=True, help="Text to continue.")
@click.option("-n", "--n-tokens", default=64, show_default=True, help="Most tokens to generate.")
@click.option("--temp", default=0.0, show_default=True, help="Sampling temperature; 0 is greedy.")
@click.option("--top-k", default=40, show_default=True, help="Sample among the K likeliest tokens (0: all).")
@click.option("--top-p", default=0.95, show_default=True, help="Sample from the smallest set with this much mass.")
@click.option("--seed", type=int, default=None, help="Random seed for reproducible sampling.")
def run(model: Path, prompt: str, n_tokens: int, temp: float, top_k: int, top_p: float, seed: int | None) -> None:
    """Generate a continuation of PROMPT with MODEL (a Hugging Face checkpoint
    folder; default: the bundled tiny ReLU LLaMA) using the NumPy reference engine.

    Tokens are printed as they are produced; a summary line (prompt and
    generation speed) goes to standard error.

    \b
    Example:
      pitools run -p "import os" -n 48
    """
    checkpoint = Checkpoint(model)
    engine = load_model(checkpoint)
    spec = engine.spec
    tokenizer = CheckpointTokenizer(model, spec.bos_token_id, spec.eos_token_id)
    prompt_ids = tokenizer.encode(prompt)
    sampler = Sampler(SamplingConfig(temperature=temp, top_k=top_k, top_p=top_p, seed=seed))
    stop = [spec.eos_token_id] if spec.eos_token_id is not None else []

    step = engine.step_fn()
    timings: list[float] = []

    def timed_step(tokens):
        t0 = time.perf_counter()
        logits = step(tokens)
        timings.append(time.perf_counter() - t0)
        return logits

    tokens = generate(timed_step, prompt_ids, n_tokens, sampler, stop)
    click.echo(prompt, nl=False)
    for piece in stream_text(tokens, tokenizer.decode):
        click.echo(piece, nl=False)
        sys.stdout.flush()
    click.echo()
    prompt_time, gen_times = timings[0], timings[1:]
    gen_rate = len(gen_times) / sum(gen_times) if gen_times else float("nan")
    click.echo(
        f"prompt: {len(prompt_ids)} tokens, {len(prompt_ids) / prompt_time:.1f} tok/s | "
        f"generation: {len(timings)} tokens, {gen_rate:.1f} tok/s | engine: reference (NumPy)",
        err=True,
    )
