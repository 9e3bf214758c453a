"""``pitools inspect``: what a GGUF or PowerInfer model file holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import numpy as np
from gguf import GGMLQuantizationType, Keys

from powerinfer_tools.commands.spellings import model_argument
from powerinfer_tools.formats.constants import PowerInferTensor, block_part
from powerinfer_tools.formats.ffn_bundle import BundleLayout
from powerinfer_tools.formats.gguf_names import tensor_kind
from powerinfer_tools.formats.gguf_spec import predictor_quality
from powerinfer_tools.formats.model_check import check_predictors, sparse_layout
from powerinfer_tools.formats.model_file import ModelFile, open_model_file
from powerinfer_tools.models import gguf_family, spec_from_model_file
from powerinfer_tools.units import format_size

KINDS = ("embedding", "attention", "ffn", "predictor", "output", "other")
_ARRAY_HEAD = 8  # array values show this many items


def _summary(value: Any) -> Any:
    """Metadata values as JSON: long arrays (the vocabulary, merges) cut to their length and first items."""
    if isinstance(value, list) and len(value) > _ARRAY_HEAD:
        return {"length": len(value), "first": value[:_ARRAY_HEAD]}
    return value


def _predicted_ffn(name: str) -> tuple[str, str | None]:
    """(layer, expert or None) of a predictor tensor's name, ``blk.N.fc1.weight`` or ``blk.N.fc1.X.weight``."""
    parts = name.split(".")
    return parts[1], parts[3] if len(parts) == 5 else None


def describe(model: ModelFile) -> dict:
    """Everything ``inspect`` reports, as plain JSON-able data."""
    bundle = BundleLayout.of_file(model)

    def parameters(t) -> int:  # a bundled FFN row holds one row of each bundled matrix, in bytes
        if bundle is not None and tensor_kind(t.name) == "ffn" and t.qtype == GGMLQuantizationType.I8:
            return t.shape[0] * model.get(Keys.LLM.EMBEDDING_LENGTH) * len(bundle.parts)
        return int(np.prod(t.shape, dtype=np.int64))

    tensors = [
        {
            "name": t.name,
            "type": t.qtype.name,
            "shape": list(t.shape),
            "parameters": parameters(t),
            "bytes": t.nbytes,
            "kind": tensor_kind(t.name),
        }
        for t in model.tensors.values()
    ]
    totals = {kind: {"tensors": 0, "parameters": 0, "bytes": 0} for kind in KINDS}
    for t in tensors:
        total = totals[t["kind"]]
        total["tensors"] += 1
        total["parameters"] += t["parameters"]
        total["bytes"] += t["bytes"]
    # Predictors are per layer, or per expert of a mixture (blk.N.fc1.X): count the FFNs that have one.
    predicted = {_predicted_ffn(t["name"]) for t in tensors if t["kind"] == "predictor"}
    return {
        "path": str(model.path),
        "layout": "powerinfer" if model.powerinfer else "dense",
        "gguf_version": model.version,
        "architecture": model.architecture,
        "block_count": model.get(Keys.LLM.BLOCK_COUNT),
        "experts": model.get(Keys.LLM.EXPERT_COUNT, 0),
        "experts_used": model.get(Keys.LLM.EXPERT_USED_COUNT, 0),
        "predictor_layers": len(predicted),
        "predictor_quality": predictor_quality(model),
        "sparse_ffn": sparse_layout(model),
        "bundled_ffn": bundle is not None,
        "metadata": {key: _summary(value) for key, value in model.metadata.items()},
        "tensors": tensors,
        "totals": {kind: total for kind, total in totals.items() if total["tensors"]},
        "total_bytes": sum(t["bytes"] for t in tensors),
        "total_parameters": sum(total["parameters"] for total in totals.values()),
    }


def _layout_line(report: dict) -> str:
    if report["layout"] == "dense":
        return f"dense GGUF v{report['gguf_version']}"
    parts = [f"PowerInfer (PWRI magic, GGUF v{report['gguf_version']})"]
    if report["sparse_ffn"]:
        parts.append(f"{block_part(PowerInferTensor.FFN_DOWN_T)} for sparse axpy")
    if report["experts"]:
        parts.append(f"predictors in {report['predictor_layers']} of {report['block_count'] * report['experts']} experts")
    else:
        parts.append(f"predictors in {report['predictor_layers']} of {report['block_count']} layers")
    quality = report["predictor_quality"]
    if quality:
        parts.append(f"trained to recall >= {quality['worst_recall']:.1%} at precision {quality['mean_precision']:.1%}, "
                     f"computing {quality['mean_computed']:.1%} of the neurons (held-out profile pairs)")
    return ", ".join(parts)


def _metadata_value(value: Any) -> str:
    if isinstance(value, dict):  # a cut array
        head = ", ".join(repr(v) for v in value["first"])
        return f"[{value['length']} items: {head}, ...]"
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 100 else text[:97] + "..."


def render(report: dict) -> str:
    size = f"{format_size(report['total_bytes'])}, {report['total_parameters']:,} parameters, {len(report['tensors'])} tensors"
    lines = [
        f"file          {report['path']}",
        f"layout        {_layout_line(report)}",
        f"architecture  {report['architecture']}" + (f", a mixture of {report['experts']} experts per layer "
                                                     f"({report['experts_used']} per token)" if report["experts"] else ""),
        f"size          {size}",
        "",
        f"metadata ({len(report['metadata'])} keys)",
    ]
    width = max((len(k) for k in report["metadata"]), default=0)
    lines += [f"  {key:<{width}}  {_metadata_value(value)}" for key, value in report["metadata"].items()]
    lines += ["", "tensors (shape in rows x columns)"]
    width = max((len(t["name"]) for t in report["tensors"]), default=0)
    for t in report["tensors"]:
        shape = " x ".join(str(n) for n in t["shape"])
        lines.append(f"  {t['name']:<{width}}  {t['type']:<5}  {shape:<14}  {format_size(t['bytes']):>10}  {t['kind']}")
    lines += ["", "totals by kind", f"  {'kind':<10}  {'tensors':>7}  {'parameters':>14}  {'bytes':>10}  share"]
    for kind, total in report["totals"].items():
        share = total["bytes"] / report["total_bytes"] if report["total_bytes"] else 0.0
        lines.append(
            f"  {kind:<10}  {total['tensors']:>7}  {total['parameters']:>14,}  {format_size(total['bytes']):>10}  {share:6.1%}"
        )
    return "\n".join(lines)


@click.command("inspect", context_settings={"help_option_names": ["-h", "--help"]})
@model_argument(kind=click.Path(path_type=Path), required=True)  # open_model_file says what is wrong with a path
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def inspect(model: Path, as_json: bool) -> None:
    """Show what MODEL, a GGUF or PowerInfer model file, holds.

    Prints the layout (dense GGUF, or PowerInfer's: PWRI magic, transposed
    ffn_down_t, predictors), the metadata (long arrays such as the vocabulary cut
    to their first items), every tensor's type, shape and size, and totals per
    kind: embedding, attention, ffn, predictor, output.

    A file of a supported family (docs/reference/supported-models.md) whose hyperparameters
    are missing or invalid, or whose predictors do not fit them, is reported as that
    one error, not shown: `pitools run` would refuse it.
    """
    opened = open_model_file(model)
    if gguf_family(opened) is not None:
        # run's checks of the hyperparameters and predictors; a file missing other tensors is still shown
        check_predictors(opened, spec_from_model_file(opened))
    report = describe(opened)
    click.echo(json.dumps(report, indent=2) if as_json else render(report))
