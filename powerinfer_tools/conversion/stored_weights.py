"""A checkpoint's weights as a conversion will store them, for the reference engine that calibrates thresholds
and measures ``--max-quality-loss``: each weight rounded through its type in the output file
(``formats.quantization.tensor_type``) in its stored layout (PowerInfer's ``ffn_down_t`` is quantized by
neuron, the dense layout's ``ffn_down`` across neurons), so that the loss measured is that of the file's
weights, sparse against dense, not of the source's. Rounding and sparsity compound: Gemma 3 270M converted from
its Q4_K_M file to q4_0 at the thresholds chosen for 5% on the source's weights lost 11.6% on held-out text
(docs/lab/real-models.md).
"""

from __future__ import annotations

import numpy as np

from powerinfer_tools.formats.gguf_names import logits_tensor, tensor_names
from powerinfer_tools.formats.model_spec import ModelSpec
from powerinfer_tools.formats.quantization import OutType, decode, encode, tensor_type
from powerinfer_tools.formats.weight_types import F16, F32

ROWS_AT_ONCE = 8192  # rows rounded per pass: bounds the quantizer's temporaries (262k-token embeddings)


class StoredWeights:
    """``checkpoint`` (a checkpoint folder or a GGUF source) whose ``tensor`` gives each weight as the file of
    ``outtype`` (``powerinfer``: in the PowerInfer layout) holds it; everything else is the checkpoint's."""

    def __init__(self, checkpoint, spec: ModelSpec, outtype: OutType, powerinfer: bool):
        self._checkpoint = checkpoint
        names = tensor_names(spec, powerinfer)
        logits = logits_tensor(t.target for t in names)
        self._stored: dict[str, tuple] = {}  # checkpoint name -> (type, stored transposed)
        for t in names:
            stored = (tensor_type(t.target, t.stored_shape, outtype, is_output=t.target == logits), t.transpose)
            for source in t.sources:
                # a tied embedding is stored twice (token_embd, output); the engine has one matrix for both:
                # the logits' rounding, which decides the tokens
                if source not in self._stored or t.target == logits:
                    self._stored[source] = stored

    def __getattr__(self, name):
        return getattr(self._checkpoint, name)

    def __contains__(self, name: str) -> bool:
        return name in self._checkpoint

    def __iter__(self):
        return iter(self._checkpoint)

    def tensor(self, name: str, dtype=np.float32) -> np.ndarray:
        values = self._checkpoint.tensor(name, np.float32)
        qtype, transposed = self._stored.get(name, (F32, False))
        if qtype is not F32:
            values = rounded(values.T, qtype).T if transposed else rounded(values, qtype)
        return values.astype(dtype, copy=False)


def rounded(rows: np.ndarray, qtype) -> np.ndarray:
    """``rows`` (2-D, quantization blocks along each row) stored as ``qtype`` and read back as float32."""
    if qtype is F16:
        return rows.astype(np.float16).astype(np.float32)
    out = np.empty(rows.shape, np.float32)
    for start in range(0, rows.shape[0], ROWS_AT_ONCE):
        part = np.ascontiguousarray(rows[start:start + ROWS_AT_ONCE], dtype=np.float32)
        out[start:start + ROWS_AT_ONCE] = decode(encode(part, qtype), qtype).reshape(part.shape)
    return out
