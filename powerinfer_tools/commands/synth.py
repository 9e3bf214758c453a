"""``pitools synth``: a synthetic ReLU or SiLU model of a real architecture's shape, for benchmarks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click
from click.core import ParameterSource

from powerinfer_tools.benchmarking import synth as synth_module
from powerinfer_tools.benchmarking.synth import (
    CALIBRATION_TOKENS,
    DEFAULT_TARGET_SPARSITY,
    HARDNESS,
    ROUTING_SKEW,
    SHAPES,
    SYNTH_TRAINING,
    SiluSettings,
    synthesize,
    synthesize_silu,
)
from powerinfer_tools.cluster.workers import ray_workers
from powerinfer_tools.commands.options import ray_option
from powerinfer_tools.commands.spellings import renamed
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.activation_thresholds import SparsityRule
from powerinfer_tools.formats.quantization import OUTTYPES

# The options of one activation only, by their parameter names.
RELU_ONLY = ("density", "hardness", "rank", "noise", "context", "routing_skew", "epochs", "min_precision", "ray_address")
SILU_ONLY = ("target_sparsity", "sparsity_rule")


@click.command("synth", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--shape", type=click.Choice(list(SHAPES)), required=True, help="Architecture shape to copy.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="PowerInfer GGUF to write (name it *.powerinfer.gguf: the dense file is then *.gguf).")
@click.option("--activation", type=click.Choice(["relu", "silu"]), default="relu", show_default=True,
              help="relu: ReGLU with planted firing and trained predictors; silu: SwiGLU (dense shapes) with "
                   "calibrated activation thresholds (CATS/TEAL) instead of predictors.")
@click.option("--target-sparsity", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=None,
              help=f"silu: share of the FFN's work the thresholds skip [default: {DEFAULT_TARGET_SPARSITY}].")
@click.option("--sparsity-rule", type=click.Choice([r.value for r in SparsityRule]), default=None,
              help="silu: cats skips neurons whose |SiLU(gate x)| is small; teal skips weight columns whose input "
                   "is small; cats+teal both [default: cats].")
@click.option("--density", type=float, default=0.1, show_default=True,
              help="Mean fraction of FFN neurons that fire per token.")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="Layers, instead of the shape's own: a quicker model of the same widths (its ratios weigh "
                   "the output matrix more) [default: the shape's].")
@click.option("--hardness", type=click.Choice(list(HARDNESS)), default="easy", show_default=True,
              help="How hard firing is to predict: sets --rank, --noise and --min-precision (each can be "
                   "overridden). hard: predictors of ~1/8 of d_model, as published ones are, that must compute "
                   "~1.5x the neurons that fire to reach 95% recall; easy: tiny predictors, near-exact; "
                   "realistic: as hard as a real model measured (SmolLM2: ~46% of the neurons computed at 95% "
                   "recall by predictors of 10% of the FFN weights), ~5x the neurons that fire, and firing that "
                   "depends on the earlier tokens as much as SmolLM2's (--context 0.8).")
@click.option("--outtype", type=click.Choice(list(OUTTYPES)), default="q4_0", show_default=True)
@click.option("--rank", type=click.IntRange(min=1), default=None,
              help="Latent dimensions that decide which neurons fire (what the predictors must learn) "
                   "[default: from --hardness].")
@click.option("--noise", type=click.FloatRange(0, 1, max_open=True), default=None,
              help="Share of a gate pre-activation outside the latent space (harder to predict) "
                   "[default: from --hardness].")
@click.option("--context", type=click.FloatRange(0, 1, max_open=True), default=None,
              help="Share of the last FFN's input that earlier tokens write, through planted previous-token "
                   "attention heads (0: every FFN sees its token's embedding, whatever came before; above 0 the "
                   "model is profiled by running it on Python source text) [default: from --hardness].")
@click.option("--routing-skew", type=click.FloatRange(min=0), default=ROUTING_SKEW, show_default=True,
              help="Mixture shapes: Zipf exponent of the share of tokens routed to each expert (0: even; "
                   "large values starve the idlest experts, whose predictors then compute every neuron).")
@click.option("--profile-tokens", type=click.IntRange(min=64), default=None,
              help="Tokens profiled for predictor training [default: 4096 per FFN on average; a mixture's experts "
                   "each see their share of the tokens: 16384 for Mixtral's 2 of 8]; silu: calibration tokens "
                   f"[default: {CALIBRATION_TOKENS}].")
@click.option("--epochs", type=click.IntRange(min=1), default=SYNTH_TRAINING.epochs, show_default=True,
              help="Predictor training epochs per candidate size (fewer: faster, for large shapes).")
@click.option("--min-precision", type=click.FloatRange(0, 1), default=None,
              help="Least share of the neurons a predictor selects that must fire (higher: larger predictors "
                   "that compute fewer idle neurons) [default: from --hardness].")
@click.option("--seed", default=0, show_default=True)
@click.option("--work", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for the f16 checkpoint, profile and predictors [default: OUTPUT.work].")
@click.option("--keep-work", is_flag=True, help="Keep the work folder instead of deleting it at the end.")
@renamed("-f", "--force", "force")
@click.option("--force", is_flag=True, help="Overwrite the outputs if they exist.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress output.")
@ray_option
def synth(shape, output, activation, target_sparsity, sparsity_rule, density, layers, hardness, outtype, rank, noise,
          context, routing_skew, profile_tokens, epochs, min_precision, seed, work, keep_work, force, as_json, quiet,
          ray_address) -> None:
    """Write a synthetic ReLU (or SiLU) LLaMA (or Mixtral) of a real shape, for benchmarking.

    Random weights, but the FFN neurons fire with planted power-law
    frequencies (about --density of them per token, a minority of hot
    neurons carrying most firings, as in real profiles), so a token costs
    what it costs in a real model of that shape. A mixture's router sends
    tokens to its experts with a planted skew (--routing-skew), and each
    expert's neurons fire so on the tokens routed to it. Our own pipeline
    then profiles it, trains its predictors and converts it twice: OUTPUT,
    a PowerInfer GGUF with the predictors, and beside it a dense GGUF of
    the same weights that llama.cpp loads (the baseline of `pitools bench`).
    The vocabulary is the bundled 4096-token tokenizer padded with unused
    tokens to the shape's size (32000 for the LLaMA and Mixtral shapes). See
    powerinfer_tools/benchmarking/synth.py for the construction.

    With --activation silu, a SwiGLU LLaMA of a dense shape with sane random
    weights (SwiGLU's activation statistics, which the summary reports), its
    thresholds calibrated to --target-sparsity on random token ids (the
    reference engine runs it: float32 weights in memory) instead of
    predictors.

    \b
    Examples:
      pitools synth --shape tinyllama-1.1b --density 0.1 -o tl.powerinfer.gguf
      pitools bench tl.powerinfer.gguf
      pitools synth --shape mixtral-8x7b --layers 2 -o mx.powerinfer.gguf
      pitools synth --shape tinyllama-1.1b --activation silu --target-sparsity 0.5 -o tls.powerinfer.gguf
    """
    _check_options(activation)
    common = dict(work=work, keep_work=keep_work, force=force, progress=not quiet, layers=layers)
    if activation == "silu":
        settings = SiluSettings(DEFAULT_TARGET_SPARSITY if target_sparsity is None else target_sparsity,
                                sparsity_rule or SparsityRule.CATS, seed)
        summary = synthesize_silu(shape, output, outtype, settings, calibration_tokens=profile_tokens,
                                  **common).summary()
        click.echo(json.dumps(summary, indent=2) if as_json else _silu_report(summary))
        return
    level = HARDNESS[hardness]
    planting = level.planting(SHAPES[shape], density, seed)
    planting = dataclasses.replace(planting, rank=rank or planting.rank,
                                   noise=planting.noise if noise is None else noise, routing_skew=routing_skew,
                                   context=planting.context if context is None else context)
    train = dataclasses.replace(synth_module.SYNTH_TRAINING, epochs=epochs,
                                min_precision=level.min_precision if min_precision is None else min_precision)
    with ray_workers(ray_address) as workers:
        summary = synthesize(shape, output, outtype, planting, profile_tokens=profile_tokens, train=train,
                             candidates=workers and workers.candidates, **common).summary()
    click.echo(json.dumps(summary, indent=2) if as_json else _relu_report(summary))


def _check_options(activation: str) -> None:
    """Refuse the options of the other activation (given on the command line, even at their defaults)."""
    context = click.get_current_context()
    others = RELU_ONLY if activation == "silu" else SILU_ONLY
    flags = {param.name: param.opts[0] for param in context.command.params}  # ray_address: --ray
    given = [flags[name] for name in others
             if context.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)]
    if given:
        other = "relu" if activation == "silu" else "silu"
        raise PitoolsError(f"{', '.join(given)}: only for --activation {other}, not {activation}")


def _relu_report(summary: dict) -> str:
    hidden = summary["predictor_hidden"]
    return (
        f"wrote {summary['powerinfer']} (PowerInfer, with predictors) and {summary['dense']} (dense)\n"
        f"{_experts_line(summary)}"
        f"firing density: planted {summary['planted_density']:.3f}, profiled {summary['profiled_density']:.3f}; "
        f"hot neurons carrying 80% of firings: {summary['profiled_hot80']:.1%}\n"
        f"predictors: hidden {min(hidden)}-{max(hidden)}, worst FFN recall {summary['predictor_recall']:.1%} "
        f"and precision {summary['predictor_precision']:.1%}, computing {summary['predicted_density']:.1%} "
        "of the neurons on held-out tokens\n"
        f"predictability (rank {summary['rank']}, noise {summary['noise']}): an ideal predictor of "
        f"{2 * (summary['rank'] + 1)} hidden units computes {summary['ideal_computed']:.1%} of the neurons "
        f"at 95% recall (precision {summary['ideal_precision']:.1%}); earlier tokens write "
        f"{summary['context']:.0%} of the last FFN's input"
    )


def _silu_report(summary: dict) -> str:
    """The files, the calibration and the activations' statistics (mean over layers; per layer in --json)."""
    means = summary["statistics"]["mean_over_layers"]
    lines = [f"wrote {summary['powerinfer']} (PowerInfer, {summary['rule']} thresholds) and {summary['dense']} "
             "(dense)",
             f"thresholds for {summary['target_sparsity']:.0%} sparsity from {summary['calibration_tokens']} random "
             f"tokens: neurons read on {summary['calibrated_density']:.1%} of tokens on average, 80% of the reads "
             f"by {summary['calibrated_hot80']:.1%} of the neurons",
             f"activations on {summary['statistics']['tokens']} tokens (mean over layers; Gaussian: excess kurtosis "
             "0, 68.3% within 1 std; Laplacian: 3, 75.7%):"]
    for name, label in (("ffn_input", "FFN input"), ("abs_silu_gate", "|SiLU(gate x)|"),
                        ("down_input", "down-projection input")):
        m = means[name]
        lines.append(f"  {label}: mean {m['mean']:.3f}, std {m['std']:.3f}, excess kurtosis "
                     f"{m['excess_kurtosis']:.2f}, {m['within_1std']:.1%} within 1 std")
    return "\n".join(lines)


def _experts_line(summary: dict) -> str:
    """A mixture's experts and their routing, as ranges over layers and experts (per expert in --json); "" if dense."""
    if "experts" not in summary:
        return ""

    def span(values: list[list[float]]) -> str:
        flat = [v for layer in values for v in layer]
        return f"{min(flat):.1%}-{max(flat):.1%}"

    return (f"experts: {summary['experts']} per layer, {summary['experts_used']} per token; tokens routed to an "
            f"expert: planted {span(summary['planted_routing'])}, profiled {span(summary['profiled_routing'])} "
            f"(even: {summary['experts_used'] / summary['experts']:.1%}); firing density of an expert on its "
            f"tokens: {span(summary['profiled_expert_density'])}\n")
