"""Quality beside speed: how far sparse decoding is from dense on the same file, measured off the clock.

The bench's timed runs discard their logits; a speedup means little without what it costs. After
the timed rounds, the sparse model file is run teacher-forced as the bench runs it (the same prompt,
then the same tokens one at a time) three times:

1. dense, every neuron computed: the reference the others are compared with;
2. sparse, on the path the timed runs took (the compiled decoder where it runs): per decoding step,
   whether its top logit is dense's (top-1 agreement), the KL divergence of its next-token
   distribution from dense's, and both engines' log-likelihood of the text's actual next token;
3. sparse again on the general path with the runtime's ``firing_meter``, which also computes every
   neuron to count which firing ones the predictors left out: the recall they achieved on this text,
   per layer. A SiLU file with thresholds instead of predictors has no firing to miss: no recall.

Recall, agreement and KL cover decoding steps only, as the generation speed does; the prompt is
computed as the timed runs compute it, sparse included, so that the steps see the same cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.profiling.perplexity import log_probabilities
from powerinfer_tools.runtime.selection_meter import SelectionMeter


@dataclass
class Agreement:
    steps: int  # decoding steps compared
    top1: float  # share of steps whose top logit is dense's
    kl_mean: float  # KL(dense || sparse) of the next-token distributions, nats, mean over the steps
    kl_max: float
    scored: int  # steps whose next token is in the text: the log-likelihoods below
    dense_perplexity: float
    sparse_perplexity: float
    selection: dict | None  # SelectionMeter.summary() of the predictors (None: a thresholded file)

    def as_dict(self) -> dict:
        return asdict(self)


def measure_agreement(path: Path, tokens: np.ndarray, n_prompt: int, steps: int, threads: int,
                      neuron_choice: str = "auto") -> Agreement:
    """Load the sparse model file ``path`` on the CPU (its neurons chosen as ``neuron_choice`` says,
    ``runtime.gate_choice``) and compare its sparse decoding of ``tokens[n_prompt : n_prompt + steps]`` with
    dense (``decode_agreement``)."""
    from powerinfer_tools import kernels
    from powerinfer_tools.runtime.loader import load_runtime_model

    kernels.set_threads(threads)
    return decode_agreement(load_runtime_model(path, use_split=False, neuron_choice=neuron_choice), tokens, n_prompt,
                            steps)


def decode_agreement(model, tokens: np.ndarray, n_prompt: int, steps: int) -> Agreement:
    """Sparse against dense on ``model`` (a ``RuntimeModel`` that can run sparse), teacher-forced: the
    prompt ``tokens[:n_prompt]``, then ``steps`` tokens one at a time."""
    if steps < 1 or n_prompt < 1 or n_prompt + steps > len(tokens):
        raise ValueError(f"{steps} steps after a {n_prompt}-token prompt need more than {len(tokens)} tokens")
    dense = log_probabilities(_decode(model, FFNMode.DENSE, tokens, n_prompt, steps))
    sparse = log_probabilities(_decode(model, FFNMode.SPARSE, tokens, n_prompt, steps))
    kl = (np.exp(dense) * (dense - sparse)).sum(axis=1)
    targets = tokens[n_prompt + 1 : n_prompt + steps + 1]  # the text's next token, where the text goes on

    def perplexity(steps_log_probabilities: np.ndarray) -> float:
        chosen = steps_log_probabilities[np.arange(len(targets)), targets]
        return float(np.exp(-chosen.mean())) if len(targets) else float("nan")

    selection = None
    if model.can_meter_firing:
        meter = SelectionMeter.zeros(len(model.layers))
        _decode(model, FFNMode.SPARSE, tokens, n_prompt, steps, meter)
        selection = meter.summary()
    return Agreement(steps, float((dense.argmax(axis=1) == sparse.argmax(axis=1)).mean()), float(kl.mean()),
                     float(kl.max()), len(targets), perplexity(dense), perplexity(sparse), selection)


def _decode(model, mode: FFNMode, tokens: np.ndarray, n_prompt: int, steps: int,
            meter: SelectionMeter | None = None) -> np.ndarray:
    """Each decoding step's logits ``[steps, vocab]`` in ``mode``; with ``meter``, the steps'
    choices of neurons counted against the neurons that fire (the general path)."""
    model.mode, caches = mode, model.new_cache()
    model.forward(tokens[:n_prompt], caches, all_logits=False)
    model.firing_meter = meter
    try:
        return np.stack([model.forward(tokens[i : i + 1], caches, all_logits=False)[-1]
                         for i in range(n_prompt, n_prompt + steps)])
    finally:
        model.firing_meter = None

