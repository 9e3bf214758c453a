"""A predictor folder (written by ``pitools train-predictors``), opened for merging into a PowerInfer file.

Layout (ours: PowerInfer's own converter reads one ``model_N.pt`` torch pickle
per layer instead)::

    predictors/
      predictors.json           {"format": "pitools-predictors", "version": 1, "complete": true,
                                 "sparse_threshold": 0.0, "n_layers": ..., ...training provenance}
      predictors.safetensors    blk.N.fc1.weight  [hidden_N, n_embd]
                                blk.N.fc2.weight  [n_ff, hidden_N]     for N = 0 .. n_layers-1

Tensors are float32, float16 or bfloat16 in ``torch.nn.Linear`` orientation
``[out, in]``, which is also how PowerInfer's runtime expects them. The weights
are memory-mapped like a checkpoint's, so merging them streams too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from powerinfer_tools.checkpoint import Checkpoint
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.fileio import read_json
from powerinfer_tools.models.spec import ModelSpec
from powerinfer_tools.predictors import FORMAT, META_FILE, WEIGHTS_FILE

from .gguf_names import predictor_names


class _PredictorTensors(Checkpoint):
    """The folder's tensors, memory-mapped; its "config" is predictors.json."""

    def _read_config(self) -> dict:
        path = self.folder / META_FILE
        if not path.is_file():
            pickles = any(self.folder.glob("model_*.pt"))
            hint = " (PowerInfer's model_N.pt predictors are not supported)" if pickles else ""
            raise PitoolsError(f"{self.folder}: not a predictor folder: no {META_FILE}{hint}")
        meta = read_json(path)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise PitoolsError(f"{path}: not a pitools predictor folder (format is not {FORMAT!r})")
        if not meta.get("complete"):
            raise PitoolsError(f"{self.folder}: predictor training is not complete")
        if not (self.folder / WEIGHTS_FILE).is_file():
            raise PitoolsError(f"{self.folder}: predictor folder has no {WEIGHTS_FILE}")
        return meta


@dataclass(frozen=True)
class PredictorFolder:
    """Validated predictors: tensors by their GGUF names, and the firing threshold if one is set."""

    tensors: Checkpoint
    sparse_threshold: float | None


def read_predictor_folder(folder: str | Path, spec: ModelSpec) -> PredictorFolder:
    """Open ``folder`` and check it has one fc1/fc2 pair per layer of ``spec``, shaped to fit."""
    tensors = _PredictorTensors(folder)
    where = tensors.folder / WEIGHTS_FILE
    threshold = tensors.config.get("sparse_threshold")
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
        raise PitoolsError(f"{tensors.folder / META_FILE}: sparse_threshold must be a number, not {threshold!r}")
    expected = {name for layer in range(spec.n_layers) for name in predictor_names(layer)}
    extra = sorted(set(tensors) - expected)
    if extra:
        raise PitoolsError(f"{where}: unexpected tensor {extra[0]!r} (the model has {spec.n_layers} layers)")
    for layer in range(spec.n_layers):
        fc1, fc2 = (tensors.info(name) for name in predictor_names(layer))
        hidden = fc1.shape[0] if len(fc1.shape) == 2 else -1
        if fc1.shape != (hidden, spec.d_model) or fc2.shape != (spec.d_ff, hidden):
            raise PitoolsError(
                f"{where}: layer {layer} predictor has fc1 {list(fc1.shape)} and fc2 {list(fc2.shape)}; "
                f"expected [hidden, {spec.d_model}] and [{spec.d_ff}, hidden]"
            )
    return PredictorFolder(tensors, None if threshold is None else float(threshold))
