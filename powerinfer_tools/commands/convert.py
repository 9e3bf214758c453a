"""``pitools convert``: a Hugging Face checkpoint (or a GGUF file) to a PowerInfer or dense GGUF model file."""

from __future__ import annotations

from pathlib import Path

import click

from powerinfer_tools.cluster.workers import ray_workers
from powerinfer_tools.commands.options import ray_option
from powerinfer_tools.commands.spellings import renamed
from powerinfer_tools.conversion.convert import ConversionPlan
from powerinfer_tools.conversion.convert import convert as convert_checkpoint
from powerinfer_tools.conversion.sparsify import SparsifySettings
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.activation_thresholds import SparsityRule
from powerinfer_tools.formats.constants import FFN_ACTIVATION_KEY, PowerInferTensor, block_part, predictor_names
from powerinfer_tools.formats.gguf_spec import architecture_ffn
from powerinfer_tools.formats.quantization import OUTTYPES
from powerinfer_tools.formats.weight_types import WEIGHT_TYPES
from powerinfer_tools.predictors.trainer import TrainSettings
from powerinfer_tools.profiling.quality import describe


def _powerinfer_runtime_notes(plan: ConversionPlan, has_predictors: bool) -> list[str]:
    """What keeps PowerInfer's own runtime from using a file that ours reads fine."""
    if not plan.powerinfer:
        return []
    notes = []
    if not has_predictors:
        fc1, fc2 = predictor_names("N")
        notes.append(f"no --predictors: PowerInfer's own runtime needs {fc1}/{fc2} predictor tensors to load this file")
    down_t = block_part(PowerInferTensor.FFN_DOWN_T)
    readable = [t.name for t in WEIGHT_TYPES.values() if t.powerinfer_axpy]
    if any(t.name.endswith(f".{down_t}.weight") and not WEIGHT_TYPES[t.qtype].powerinfer_axpy for t in plan.tensors):
        notes.append(f"PowerInfer's CPU runtime reads {down_t} only as {' or '.join(readable)}; "
                     f"use --outtype {' or '.join(readable)} for it")
    return notes


def quality_loss(text: str) -> float:
    """``--max-quality-loss``'s relative perplexity increase: a percentage ("5%") or a fraction ("0.05"); its range
    is ``SparsifySettings``'s to check."""
    number = text.strip().removesuffix("%")
    try:
        return float(number) / (100 if number != text.strip() else 1)
    except ValueError:
        raise PitoolsError(f"--max-quality-loss takes a percentage (5%) or a fraction (0.05), not {text!r}") from None


@click.command("convert", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("source", metavar="SRC")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Output file (default: <model>.powerinfer.gguf, or <model>.gguf when dense, beside the checkpoint folder; "
         "beside a GGUF file, <file>.powerinfer.gguf or <file>.<outtype>.gguf).",
)
@click.option(
    "--outtype",
    type=click.Choice(list(OUTTYPES)),
    default="f16",
    show_default=True,
    help="Type of the weight matrices; norms and biases stay f32.",
)
@click.option("--dense", is_flag=True, help="Write a plain GGUF that llama.cpp loads, even for a ReLU-family model.")
@click.option(
    "--predictors",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Reuse this folder of trained predictors (`pitools train-predictors`) instead of training them.",
)
@click.option(
    "--profile",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Reuse this activation profile (`pitools profile`) instead of profiling.",
)
@click.option("--corpus", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Calibration text for profiling (repeatable) [default: the heldout.txt in the checkpoint folder, "
                   "or beside the GGUF file].")
@click.option("--tokens", type=click.IntRange(min=16), default=SparsifySettings.tokens, show_default=True,
              help="Calibration tokens to profile.")
@click.option("--recall", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=TrainSettings.recall,
              show_default=True, help="Held-out recall every layer's predictor must reach.")
@click.option("--budget", type=click.FloatRange(0, min_open=True), default=TrainSettings.budget, show_default=True,
              help="All predictors' size as a fraction of the FFN weights.")
@click.option("--reorder/--no-reorder", default=True, show_default=True,
              help="Store each FFN's neurons hot-first, so the GPU's share is a contiguous prefix.")
@click.option("--target-sparsity", type=click.FloatRange(0, 1, max_open=True), default=None,
              help="A SiLU (SwiGLU) model: calibrate thresholds that skip this share of activations "
                   "(by --sparsity-rule) instead of training predictors; written in the PowerInfer layout.")
@click.option("--max-quality-loss", metavar="LOSS", default=None,
              help="A SiLU (SwiGLU) model, instead of --target-sparsity: the sparsest per-layer thresholds whose "
                   "perplexity on held-out calibration text is at most LOSS above dense (5% or 0.05).")
@click.option("--sparsity-rule", type=click.Choice([r.value for r in SparsityRule]), default=SparsityRule.CATS.value,
              show_default=True,
              help="With --target-sparsity or --max-quality-loss: cats skips neurons whose |SiLU(gate)| is small; teal skips the small "
                   "entries of the FFN's inputs; cats+teal is cats, then teal on the down projection's input.")
@click.option("--no-sparsity", is_flag=True,
              help="PowerInfer layout without profiling, predictors or reordering (our runtime runs it dense).")
@click.option("--allow-nonfinite", is_flag=True,
              help="Write weights holding NaN or inf as they are instead of refusing them (not with profiling).")
@renamed("-f", "--force", "force")
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or messages on stderr.")
@ray_option
def convert(source: str, output: Path | None, outtype: str, dense: bool, predictors: Path | None, profile: Path | None,
            corpus: tuple[Path, ...], tokens: int, recall: float, budget: float, reorder: bool,
            target_sparsity: float | None, max_quality_loss: str | None, sparsity_rule: str, no_sparsity: bool,
            allow_nonfinite: bool, force: bool, quiet: bool, ray_address: str | None):
    """Convert SRC, a checkpoint folder, a Hugging Face hub id or a GGUF file, into one model file.

    ReLU-family models (ReluLLaMA, ProSparse, Bamboo/TurboSparse, OPT) are written
    in PowerInfer's layout: the PWRI magic, the down projection stored transposed
    as ffn_down_t, and per-layer neuron predictors. Unless given with --profile
    and --predictors, the model is first profiled on calibration text and its
    predictors trained (cached and resumable in OUTPUT.work/); neurons are stored
    hot-first and their firing frequencies recorded for `pitools solve`. A SiLU model
    with --target-sparsity is written in the same layout with, instead of predictors,
    thresholds calibrated on the same text (CATS, TEAL: docs/how-to/quality-budget.md); with
    --max-quality-loss, per-layer thresholds as sparse as held-out perplexity allows. Other models,
    and any model with --dense, are written as plain GGUF with llama.cpp's names,
    which llama.cpp loads (it runs LLaMA-family FFNs with SiLU whatever the
    model's activation; OPT loads only in PowerInfer's llama.cpp). The tokenizer
    is embedded as llama.cpp reads it.

    A GGUF file (llama.cpp's, Ollama's, LM Studio's: any family of
    docs/reference/supported-models.md, weights of any type gguf-py dequantizes) is
    read as the checkpoint it was made from: q/k rows back in the checkpoint's
    order, its tokenizer, chat template and general.* metadata carried over; the
    steps above run on it unchanged.

    Weights are read one tensor at a time from memory-mapped safetensors (or the
    GGUF file, dequantized to float32) and written as they are converted; the
    output appears only when complete. The output path is printed on stdout.

    \b
    Examples:
      pitools convert ./ReluLLaMA-7B --corpus calibration.txt
      pitools convert SparseLLM/ReluLLaMA-7B --outtype q4_0 --predictors ./predictors
      pitools convert ./TinyLlama --dense -o tinyllama.gguf
      pitools convert ./TinyLlama --target-sparsity 0.5 --outtype q4_0
      pitools convert SmolLM2-135M-Instruct.Q4_1.gguf --max-quality-loss 5% --corpus text.txt --outtype q4_0
      pitools convert SmolLM2-135M-Instruct.Q4_1.gguf --dense --outtype f16
    """
    for given, option in ((target_sparsity, "--target-sparsity"), (max_quality_loss, "--max-quality-loss")):
        if given is not None and no_sparsity:
            raise PitoolsError(f"{option} and --no-sparsity contradict each other")
    sparsify = None if no_sparsity else SparsifySettings(
        corpus=corpus, tokens=tokens, train=TrainSettings(recall=recall, budget=budget), reorder=reorder,
        target_sparsity=target_sparsity, rule=SparsityRule(sparsity_rule),
        max_quality_loss=None if max_quality_loss is None else quality_loss(max_quality_loss),
    )
    with ray_workers(ray_address) as workers:
        path, plan = convert_checkpoint(
            source, output, outtype=outtype, dense=dense, predictors=predictors, profile=profile, sparsify=sparsify,
            force=force, progress=not quiet, allow_nonfinite=allow_nonfinite, workers=workers,
        )
    if not quiet:
        _report(plan, outtype, path)
    click.echo(str(path))


def _report(plan: ConversionPlan, outtype: str, path: Path) -> None:
    """What was written, on stderr: the file, the sparsity chosen by quality, notes for PowerInfer's runtime and
    llama.cpp."""
    layout = "PowerInfer" if plan.powerinfer else "dense GGUF"
    click.echo(f"wrote {layout} {plan.architecture} model, {len(plan.tensors)} tensors, {outtype}: {path}", err=True)
    if plan.thresholds is not None and plan.thresholds.choice is not None:
        for line in describe(plan.thresholds):
            click.echo(line, err=True)
    for note in _powerinfer_runtime_notes(plan, plan.sparse_threshold is not None) + _llamacpp_notes(plan):
        click.echo(f"note: {note}", err=True)


def _llamacpp_notes(plan: ConversionPlan) -> list[str]:
    """What llama.cpp computes otherwise than the model in a dense file, which it loads: a ReLU family's FFN, in an
    architecture whose FFN it computes with SiLU."""
    computed = architecture_ffn(plan.spec.architecture, plan.architecture, plan.powerinfer)
    if plan.powerinfer or computed is plan.spec.ffn:
        return []
    ffn = plan.spec.ffn
    return [f"llama.cpp computes the FFN of a {plan.architecture} file with {computed.activation} ({computed.value}), "
            f"not with this model's {ffn.activation} ({ffn.value}): there it runs as another model; our runtime reads "
            f"{ffn.value} from {FFN_ACTIVATION_KEY}"]
