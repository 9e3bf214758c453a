"""The predictor folder (written by ``pitools train-predictors``): its files, its one class, its
readers and writer and its report (the rule its predictors are applied with: ``predictor_rule.py``).

Layout (ours: PowerInfer's own converter reads one ``model_N.pt`` torch pickle
per layer instead)::

    predictors/
      predictors.json           {"format": "pitools-predictors", "version": 1, "complete": true,
                                 "sparse_threshold": 0.0, "n_layers": ..., ...training provenance}
      predictors.safetensors    blk.N.fc1.weight  [hidden_N, n_embd]
                                blk.N.fc2.weight  [n_ff, hidden_N]     for N = 0 .. n_layers-1

A mixture of experts (``"experts": E``) has one predictor per expert, ``blk.N.fc1.X.weight`` and
``blk.N.fc2.X.weight`` (the names its sparse GGUF layout uses), and predictors.json one entry per
expert, in layer then expert order.

Tensors are float32, float16 or bfloat16 in ``torch.nn.Linear`` orientation
``[out, in]``, which is also how PowerInfer's runtime expects them. predictors.json
is written after the weights: it is what says which layers are finished, so a
training run resumes from it. Merged into a model file, the weights are
memory-mapped like a checkpoint's, so merging them streams too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from powerinfer_tools.formats.constants import predictor_names
from powerinfer_tools.formats.json_fields import check_fields, check_format
from powerinfer_tools.formats.model_spec import FLOAT32_MAX, FFNUnit, ModelSpec, ffn_units
from powerinfer_tools.formats.safetensors_file import SafetensorsTensors
from safetensors.numpy import save_file

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.fileio import atomic_output, read_json, write_json

FORMAT = "pitools-predictors"
VERSION = 1
WEIGHTS_FILE = "predictors.safetensors"
META_FILE = "predictors.json"


@dataclass
class PredictorFolder:
    """What ``predictors.json`` records (``meta``) and the finished layers' tensors by their GGUF
    names: a dict in memory while training, memory-mapped when read from a folder."""

    meta: dict
    tensors: dict[str, np.ndarray] | SafetensorsTensors = field(default_factory=dict)

    @property
    def sparse_threshold(self) -> float | None:
        threshold = self.meta.get("sparse_threshold")
        return None if threshold is None else float(threshold)

    @property
    def units(self) -> list[FFNUnit]:
        """The FFNs predicted, finished or not: the layers, or each layer's experts."""
        return ffn_units(self.meta["n_layers"], self.meta.get("experts", 0))

    def unit(self, unit: FFNUnit) -> tuple[np.ndarray, np.ndarray]:
        """The (fc1, fc2) of one layer, or one expert of it."""
        fc1, fc2 = predictor_names(unit.layer, unit.expert)
        return self.tensors[fc1], self.tensors[fc2]

    def set_unit(self, unit: FFNUnit, fc1: np.ndarray, fc2: np.ndarray) -> None:
        for name, weight in zip(predictor_names(unit.layer, unit.expert), (fc1, fc2)):
            self.tensors[name] = weight

    def save(self, folder: Path) -> None:
        # Weights first: predictors.json, written last, is what says which layers are finished.
        with atomic_output(folder / WEIGHTS_FILE, overwrite=True) as tmp:
            tensors = {name: np.ascontiguousarray(self.tensors[name]) for name in self.tensors}
            save_file(tensors, str(tmp), metadata={"format": FORMAT})
        write_json(folder / META_FILE, self.meta)


def read_predictors(folder: str | Path, spec: ModelSpec | None = None,
                    require_complete: bool = True) -> PredictorFolder:
    """The folder, predictors.json checked in full and its finished layers' weights memory-mapped;
    with ``spec``, also checked to hold one fc1/fc2 pair per layer of that model, shaped to fit."""
    folder = Path(folder)
    meta_path = folder / META_FILE
    if not meta_path.is_file():
        pickles = any(folder.glob("model_*.pt"))
        hint = " (PowerInfer's model_N.pt predictors are not supported)" if pickles else ""
        raise PitoolsError(f"{folder}: not a predictor folder: no {META_FILE}{hint}")
    meta = _checked_meta(meta_path, read_json(meta_path))
    units = ffn_units(meta["n_layers"], meta.get("experts", 0))
    if require_complete and not meta["complete"]:
        raise PitoolsError(
            f"{folder}: predictors exist for {len(meta['layers'])} of {len(units)} {_units_word(meta)}; training is "
            "not complete: run `pitools train-predictors` again to finish"
        )
    weights = folder / WEIGHTS_FILE
    if meta["layers"] and not weights.is_file():
        raise PitoolsError(f"{folder}: predictor folder has no {WEIGHTS_FILE}")
    tensors = SafetensorsTensors([weights] if meta["layers"] else [], where=weights)
    finished = {name for unit in units[: len(meta["layers"])] for name in predictor_names(unit.layer, unit.expert)}
    for name in finished:
        tensors.info(name)  # each finished layer's tensors are there
    if spec is not None:
        _check_fits(tensors, spec)
    return PredictorFolder(meta, tensors)


def _check_fits(tensors: SafetensorsTensors, spec: ModelSpec) -> None:
    expected = {name for unit in spec.ffn_units for name in predictor_names(unit.layer, unit.expert)}
    extra = sorted(set(tensors) - expected)
    if extra:
        experts = f" of {spec.n_experts} experts" if spec.moe else ""
        raise PitoolsError(f"{tensors.where}: unexpected tensor {extra[0]!r} (the model has {spec.n_layers} layers"
                           f"{experts})")
    for unit in spec.ffn_units:
        fc1, fc2 = (tensors.info(name) for name in predictor_names(unit.layer, unit.expert))
        hidden = fc1.shape[0] if len(fc1.shape) == 2 else -1
        if fc1.shape != (hidden, spec.d_model) or fc2.shape != (spec.d_ff, hidden):
            raise PitoolsError(
                f"{tensors.where}: {unit} predictor has fc1 {list(fc1.shape)} and fc2 {list(fc2.shape)}; "
                f"expected [hidden, {spec.d_model}] and [{spec.d_ff}, hidden]"
            )


def load_predictors(folder: Path) -> tuple[float, list[tuple[np.ndarray, np.ndarray]]]:
    """The sparse threshold and every FFN's (fc1, fc2) of a finished predictor folder, in unit order."""
    predictors = read_predictors(folder)
    return predictors.sparse_threshold, [predictors.unit(unit) for unit in predictors.units]


def predictor_report(meta: dict) -> dict:
    """What ``pitools train-predictors --report`` shows of a predictors.json: each finished layer's
    quality and size, and the share of the FFN weights all of them take."""
    layers = meta["layers"]
    total_bytes = sum(e["bytes"] for e in layers)
    ffn_bytes = 4 * meta["ffn_params"]
    recall = meta["settings"]["recall"]
    return {
        "model": meta.get("model"),
        "complete": meta["complete"],
        "recall_target": recall,
        "budget": meta["settings"]["budget"],
        "layers": [{k: e[k] for k in ("layer", "hidden", "recall", "precision", "predicted_density",
                                      "true_density", "bytes")} for e in layers],
        "total_bytes": total_bytes,
        "ffn_bytes": ffn_bytes,
        "budget_used": total_bytes / ffn_bytes,
        # Judged as the search judged it, on the tuning split (``recall`` is the reporting split's: it may fall
        # a little short where the tuning split just reached the target). A file from before the split has one.
        "all_layers_reach_recall": all(e.get("tuning", e)["recall"] >= recall for e in layers),
    }


def format_predictor_report(report: dict) -> str:
    lines = [f"predictors of {report['model']} (recall target {report['recall_target']:.0%}, "
             f"budget {report['budget']:.1%} of the FFN weights)"]
    if not report["complete"]:
        lines.append("INCOMPLETE: run `pitools train-predictors` again to finish")
    lines.append("layer   hidden   recall   precision   computed   fire    bytes")
    for e in report["layers"]:
        lines.append(f"{e['layer']:>5}   {e['hidden']:6d}   {e['recall']:6.1%}   {e['precision']:9.1%}   "
                     f"{e['predicted_density']:8.1%}   {e['true_density']:5.1%}   {e['bytes']:6d}")
    lines.append(f"total {report['total_bytes']} bytes = {report['budget_used']:.1%} of the FFN weights "
                 f"({report['ffn_bytes']} bytes, both float32); recall on held-out rows nothing was tuned on; "
                 f"every layer at the recall target on the rows it was tuned on: "
                 f"{'yes' if report['all_layers_reach_recall'] else 'NO'}")
    return "\n".join(lines)


# What readers of predictors.json rely on: key -> (type, least value or None); float: any number.
_META_FIELDS = {"n_layers": (int, 1), "complete": (bool, None), "layers": (list, None), "ffn_params": (int, 1),
                "sparse_threshold": (float, None), "settings": (dict, None)}
_SETTINGS_FIELDS = {"recall": (float, None), "budget": (float, None)}
_LAYER_FIELDS = {"layer": (int, 0), "hidden": (int, 1), "recall": (float, None), "precision": (float, None),
                 "predicted_density": (float, None), "true_density": (float, None), "bytes": (int, 0)}


def _checked_meta(path: Path, meta) -> dict:
    """predictors.json, checked to hold what its readers use, its finished layers in order."""
    check_format(path, meta, FORMAT, "a pitools predictor folder")
    check_fields(path, meta, _META_FIELDS)
    check_fields(path, meta["settings"], _SETTINGS_FIELDS, "settings.")
    if "experts" in meta:  # a mixture's predictors; absent: none
        check_fields(path, meta, {"experts": (int, 0)})
    threshold = meta["sparse_threshold"]
    if not (math.isfinite(threshold) and abs(threshold) <= FLOAT32_MAX):  # it is written as a float32
        raise PitoolsError(f"{path}: sparse_threshold is {threshold!r}; it must be a finite float32")
    layers, units = meta["layers"], ffn_units(meta["n_layers"], meta.get("experts", 0))
    for i, entry in enumerate(layers):
        check_fields(path, entry if isinstance(entry, dict) else {}, _LAYER_FIELDS, f"layers[{i}].")
        if i >= len(units) or FFNUnit(entry["layer"], entry.get("expert")) != units[i]:
            raise PitoolsError(f"{path}: layers[{i}] is layer {entry['layer']}{_expert_of(entry)}; finished "
                               "layers (and experts) must be in order")
    if meta["complete"] != (len(layers) == len(units)):
        raise PitoolsError(f"{path}: {len(layers)} of {len(units)} {_units_word(meta)} finished, "
                           f"yet complete is {str(meta['complete']).lower()}")
    return meta


def _units_word(meta: dict) -> str:
    return "experts" if meta.get("experts") else "layers"


def _expert_of(entry: dict) -> str:
    return f" expert {entry['expert']!r:.20}" if "expert" in entry else ""
