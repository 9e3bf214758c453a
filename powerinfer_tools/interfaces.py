"""What the pipeline's stages need of an engine and of a tokenizer, and the FFN modes they share.

Two engines compute a model: the reference engine (``DecoderModel``, NumPy, from a checkpoint
folder) and the runtime (``runtime.engine.RuntimeModel``, from a GGUF file). Their users ask for
little, and each interface below is the least one kind of user asks for:

* ``Engine`` -- logits for tokens that follow a cache: the Python API (``llm.LLM``) and perplexity.
* ``FFNTracer`` -- a forward pass that shows every layer's FFN to ``ffn_hook``: profiling
  (``profiling.Profiler``); ``synth.PlantedActivations`` provides it without computing logits.
* ``Tokenizer`` -- text to ids and back: the checkpoint's Hugging Face tokenizer
  (``tokenizer.CheckpointTokenizer``) and the one embedded in a GGUF file
  (``runtime.tokenizer.GGUFTokenizer``).
* ``Workers`` -- where the pipeline's parallel work runs when not in this process (``--ray``):
  ``convert`` and ``synth`` pass it to the profiler and the predictor trainer.

Implementations name the interfaces they provide as base classes, so the type checker holds them
to it.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional, Protocol

import numpy as np

if TYPE_CHECKING:  # names for annotations only: every stage imports this module, it imports none
    from powerinfer_tools.formats.model_spec import ModelSpec
    from powerinfer_tools.models.layers import FFNHook
    from powerinfer_tools.predictors.trainer import Candidates
    from powerinfer_tools.profiling.profiler import WindowRecorder
    from powerinfer_tools.runtime.generation import StepFn


class FFNMode(str, enum.Enum):
    """Which FFN neurons an engine computes; the values are the words ``run``, ``bench``,
    ``perplexity`` and ``LLM.load`` take."""

    DENSE = "dense"  # every neuron
    SPARSE = "sparse"  # the neurons the trained predictors select
    ORACLE = "oracle"  # exactly the neurons that fire (needs every gate row: for measurements and tests)

    @classmethod
    def _missing_(cls, value: object) -> Optional[FFNMode]:
        # `pitools perplexity --sparse predicted` (its old spelling of --mode sparse) predates this vocabulary.
        return cls.SPARSE if value == "predicted" else None


class Engine(Protocol):
    """Logits for tokens that follow what a cache holds."""

    spec: ModelSpec

    def new_cache(self) -> Any:
        """An empty cache: the state of a fresh sequence."""
        ...

    def forward(self, tokens: np.ndarray, cache: Any) -> np.ndarray:
        """Logits ``[len(tokens), vocab]`` for ``tokens`` following what ``cache`` holds; extends the cache."""
        ...

    def step_fn(self) -> StepFn:
        """A fresh sequence: called with the next tokens, returns the last one's logits."""
        ...


class FFNTracer(Protocol):
    """A forward pass that calls ``ffn_hook`` (when set) with every layer's ``FFNTrace``, and runs a SiLU model's
    ``activation_thresholds`` (when set); with ``compute_logits`` off it skips the output head."""

    spec: ModelSpec
    ffn_hook: Optional[FFNHook]
    activation_thresholds: Optional[Any]
    compute_logits: bool

    def new_cache(self) -> Any:
        ...

    def forward(self, tokens: np.ndarray, cache: Any) -> Any:
        """Runs ``tokens`` through every layer, showing each FFN to ``ffn_hook``; what it returns is unused."""
        ...


class Tokenizer(Protocol):
    """Text <-> token ids of a model's vocabulary, and its special tokens."""

    bos_token_id: Optional[int]
    eos_token_id: Optional[int]
    chat_template: Optional[str]  # Jinja source, as Hugging Face tokenizers carry it; None when the model has none

    @property
    def vocab_size(self) -> int:
        ...

    def encode(self, text: str, add_bos: Optional[bool] = None, special: Optional[bool] = None) -> list[int]:
        """Ids of ``text``, BOS first when ``add_bos`` (default: as the model's prompts start); with
        ``special``, text spelling a control token (``<|im_start|>``) is that token."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        ...

    def token_text(self, token_id: int) -> str:
        """The vocabulary's spelling of one token (a special token's literal text)."""
        ...


@dataclass(frozen=True)
class Workers:
    """Where predictor candidates are trained and profile windows recorded, when not in this process
    (``cluster.workers.ray_workers``); each is a pure function of its input, so the output is the same."""

    candidates: Candidates
    windows: WindowRecorder


@contextlib.contextmanager
def tracing(model: FFNTracer, hook: FFNHook, thresholds=None):
    """Within: ``model``'s forward passes show every FFN to ``hook``, run ``thresholds`` (a SiLU model's
    ``ActivationThresholds``; None: dense) and compute no logits (what is traced is read through the hook)."""
    model.ffn_hook, model.activation_thresholds, model.compute_logits = hook, thresholds, False
    try:
        yield model
    finally:
        model.ffn_hook, model.activation_thresholds, model.compute_logits = None, None, True
