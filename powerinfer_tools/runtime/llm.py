"""The Python API: load a model once, then generate text as an iterator.

    from powerinfer_tools.runtime.llm import LLM
    llm = LLM.load("model.powerinfer.gguf", mode="sparse")
    for piece in llm.generate("def ", max_tokens=32):
        print(piece, end="", flush=True)

A ``.gguf`` file runs on the sparse runtime; a Hugging Face checkpoint folder
runs on the NumPy reference engine (dense, for checking).
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from powerinfer_tools import kernels as compiled_kernels
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.runtime import ffn_plan, kernel_handover, sparse_verdict, warmup
from powerinfer_tools.formats.gpu_split import default_split_path
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.interfaces import Engine, FFNMode, Tokenizer
from powerinfer_tools.models import load_model_and_tokenizer
from powerinfer_tools.runtime.backends import require_cupy
from powerinfer_tools.runtime.engine import RuntimeModel, TokenStats
from powerinfer_tools.runtime.gate_choice import NeuronChoice
from powerinfer_tools.runtime.generation import (
    Generation,
    NonFiniteLogits,
    Sampler,
    SamplingConfig,
    SettingError,
    check_prompt,
    context_window,
    generate,
    stream_text,
)
from powerinfer_tools.runtime.loader import load_runtime_model
from powerinfer_tools.runtime.neuron_cache import DEFAULT_POLICY
from powerinfer_tools.runtime.tokenizer import GGUFTokenizer
from powerinfer_tools.solver.hardware import DEFAULT_PRESET, load_profile
from powerinfer_tools.solver.problem import DEFAULT_RESERVE_BYTES
from powerinfer_tools.units import format_size


AUTO = "auto"  # LLM.load's mode: sparse where it pays on this machine (runtime.sparse_verdict), else dense


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    prompt_reused: int = 0  # of the prompt tokens, those a prompt cache held (not computed: ``runtime.prompt_cache``)
    generated_tokens: int = 0  # tokens sampled, EOS included (an API's completion tokens)
    decode_steps: int = 0  # forward passes after the prompt's (one per generated token but the last)
    generation_seconds: float = 0.0  # their time
    context_size: int = 0  # positions of the context window: prompt and generated tokens together
    stopped_at_window: bool = False  # generation ended because the window was full, not at max_tokens or EOS
    stopped_at_eos: bool = False  # the model produced its end-of-sequence token
    # how the generation moved from the NumPy reference kernels onto the compiled ones, built meanwhile; None where
    # it did not move
    handover: kernel_handover.Handover | None = None
    ffn: TokenStats = field(default_factory=TokenStats)  # runtime only: neurons and bytes per step

    @property
    def prompt_rate(self) -> float | None:
        """Prompt tokens per second; None when nothing was timed (no tokens, or a clock too coarse)."""
        return _rate(self.prompt_tokens, self.prompt_seconds)

    @property
    def generation_rate(self) -> float | None:
        """Generated tokens per second: forward passes of one token per second; None when nothing was timed."""
        return _rate(self.decode_steps, self.generation_seconds)


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if tokens and seconds > 0 else None


class LLM:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, description: str, context_size: int, source: str = "",
                 kernels_build: warmup.BackgroundBuild | None = None):
        self.engine = engine
        self.source = source  # the model's file or folder, named by errors about it
        self.tokenizer = tokenizer
        self.description = description
        self.context_size = context_size  # positions for prompt and generated tokens together
        self.last_stats = GenerationStats()
        # Where the engine runs on the NumPy reference while a background process builds the compiled kernels, that
        # build: a generation moves onto them once they are ready (runtime.kernel_handover); None once moved
        self.kernels_build = kernels_build

    @classmethod
    def load(
        cls,
        path: str | Path,
        mode: FFNMode | str = AUTO,
        split: str | Path | None = None,
        use_split: bool = True,
        device: str = "cpu",
        vram: int | None = None,
        hardware: str = DEFAULT_PRESET,
        ctx_size: int | None = None,
        ram: int | None = None,
        cache_policy: str = DEFAULT_POLICY,
        kernels: warmup.Policy | str = warmup.Policy.WAIT,
        notice: Callable[[str], None] | None = None,
        neuron_choice: str = "auto",
    ) -> "LLM":
        """``mode``: which FFN neurons a GGUF file's runtime computes: ``sparse`` (dense when the file has no
        predictors or thresholds), ``dense``, or ``auto``: sparse where that decodes faster than dense on this
        machine, else dense (``runtime.sparse_verdict``: measured once per file and machine, on the compiled
        kernels; sparse until they are built). ``device`` is where the split's hot neurons go: ``cuda``, or ``emulated`` for testing.
        ``ctx_size`` bounds the context window (default: the model's trained positions).

        With ``vram`` (bytes), the split file (``split``, default beside the model) is solved for that
        budget on ``hardware`` (a preset or profile file) unless the one there already serves it.
        With ``ram`` (bytes), the weights in memory stay within it (``runtime.ram_budget``): cold neurons are
        read from the file into neuron caches evicting by ``cache_policy``; ``neuron_choice``: ``runtime.gate_choice``.

        ``kernels``: when the compiled kernels this kind of model needs are not yet in numba's cache, ``wait``
        for them to compile (once per machine), start on the NumPy reference while a ``background`` process
        compiles them (a generation moves onto them as soon as they are ready: ``runtime.kernel_handover``), or
        keep to the ``reference`` (``runtime.warmup``); ``notice`` is told, in one line.
        """
        path = Path(path)
        if path.is_dir():
            if vram is not None or split is not None or ram is not None:
                raise PitoolsError(f"{path}: a checkpoint folder runs on the reference engine, which has no GPU split "
                                   "or RAM budget: convert it first (pitools convert)")
            engine, tokenizer = load_model_and_tokenizer(path)
            engine.context_size = context_window(engine.spec.max_positions, ctx_size)
            return cls(engine, tokenizer, "reference engine (NumPy)", engine.context_size, str(path))
        solved = ""
        if vram is not None:
            split, solved = _split_for_budget(path, split, use_split, device, vram, hardware)
        options = load_options(device, split, use_split, ram, cache_policy, neuron_choice)
        model_file = open_model_file(path)  # once: its header is read for the warm-up's key and for the model
        warm_up = warmup.prepare(model_file, options, kernels, notice)
        model = load_runtime_model(model_file, split=split, use_split=options.use_split,
                                   device="emulated" if device == "cpu" else device, context_size=ctx_size, ram=ram,
                                   cache_policy=cache_policy, cpu_only=device == "cpu", neuron_choice=neuron_choice)
        asked = FFNMode.SPARSE if mode == AUTO else FFNMode(mode)  # sparse: dense where the file has no sparse mode
        model.mode = FFNMode.DENSE if asked is FFNMode.SPARSE and not model.can_run_sparse else asked
        kernels_build = warm_up(model)
        tokenizer = GGUFTokenizer(model.metadata, source=str(path))
        chosen = _auto_mode(model, tokenizer, options, notice) if mode == AUTO else ""
        where = f", {ffn_plan.gist(model.ffn_plans[model.mode])}"  # each layer's: execution_report()
        if model.device is not None:
            where += f", split {model.split_path.name}{solved} on {model.device.name}"
        where += f", --ram {format_size(ram)} ({cache_policy} cache)" if model.ram is not None else ""
        return cls(model, tokenizer, f"runtime, {model.mode.value} FFN{chosen}{where}{_kernel_words(model)}",
                   model.context_size, str(path), kernels_build)

    def execution_report(self) -> list[str]:
        """Which path and kernels compute each part of the model (``RuntimeModel.execution_report``); a
        checkpoint folder's reference engine computes all of it in NumPy."""
        if isinstance(self.engine, RuntimeModel):
            return self.engine.execution_report()
        return [f"{self.description}: every layer, the output head and prompts"]

    @property
    def mode(self) -> str:
        return self.engine.mode.value if isinstance(self.engine, RuntimeModel) else FFNMode.DENSE.value

    def generate(
        self, prompt: str | Sequence[int], max_tokens: int = 64, sampling: SamplingConfig = SamplingConfig()
    ) -> Iterator[str]:
        """Text pieces as tokens are produced; ``last_stats`` is complete when the iterator ends.

        ``prompt``: text (encoded as the model's prompts start, BOS first where it has one), or token ids
        taken as they are. The prompt and ``max_tokens`` are checked now, before anything is computed:
        SettingError for text that is not valid UTF-8, an id outside the vocabulary or a prompt longer
        than the context window. Generation stops early when the window is full
        (``last_stats.stopped_at_window``).
        """
        stats = self.last_stats = GenerationStats(context_size=self.context_size)
        prompt_ids = self.prompt_ids(prompt)
        stats.prompt_tokens = len(prompt_ids)
        eos = self.engine.spec.eos_token_id
        if isinstance(self.engine, RuntimeModel):
            self.engine.stats = stats.ffn
        step = self.engine.step_fn()
        if self.kernels_build is not None:
            words = _kernel_words(self.engine)  # the description's end on the reference

            def moved(handover: kernel_handover.Handover) -> None:
                self.description = self.description.removesuffix(words) + _kernel_words(self.engine)
                self.kernels_build, stats.handover = None, handover

            step = kernel_handover.handing_over(step, self.kernels_build, moved)
        tokens = generate(_timed(step, stats), prompt_ids, max_tokens, Sampler(sampling),
                          [eos] if eos is not None else [], self.context_size)
        return self._stream(tokens, stats)

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The ids ``generate`` starts from: text encoded as the model's prompts start, or ids as they are;
        SettingError (PromptTooLong for one that does not fit the context window) when it cannot start."""
        ids = (self.tokenizer.encode(_checked_text(prompt)) if isinstance(prompt, str)
               else _checked_ids(prompt, self.tokenizer.vocab_size))
        check_prompt(ids, self.context_size)
        return ids

    def _stream(self, tokens: Generation, stats: GenerationStats) -> Iterator[str]:
        try:
            yield from stream_text(tokens, self.tokenizer.decode)
        except NonFiniteLogits as exc:
            raise NonFiniteLogits(f"{self.source}: {exc}") from None
        finally:  # also when the caller stops early (a stop string, a client gone)
            stats.generated_tokens = tokens.sampled
            stats.stopped_at_window, stats.stopped_at_eos = tokens.stopped_at_window, tokens.stopped_at_token


def load_options(device: str = "cpu", split: str | Path | None = None, use_split: bool = True, ram: int | None = None,
                 cache_policy: str = DEFAULT_POLICY, neuron_choice: str = "auto") -> warmup.LoadOptions:
    """What of ``LLM.load``'s arguments decides which compiled paths its runs take (``warmup.LoadOptions``)."""
    # On the CPU a split file matters only for its RAM tier (`pitools solve --ram`), under a RAM budget.
    use_split = use_split and (device != "cpu" or ram is not None)
    return warmup.LoadOptions(device, None if split is None else str(split), use_split, ram, cache_policy,
                              str(NeuronChoice(neuron_choice).value))


def _kernel_words(model: RuntimeModel) -> str:
    """The end of a GGUF file's description: the NumPy kernels where they are in use, and the path that decodes a
    token (the whole story: ``execution_report``)."""
    words = ", NumPy kernels" if compiled_kernels.reference_chosen() else ""
    return f"{words}, tokens decoded by the {model.decode_path()}"


def _auto_mode(model: RuntimeModel, tokenizer, options: warmup.LoadOptions, notice) -> str:
    """``--mode auto`` on a loaded, warmed-up ``model`` in its sparse mode where it can run one: dense where
    sparse does not pay on this machine (``runtime.sparse_verdict``); the words that say why, or "" where
    nothing was decided (no sparse mode to run, the NumPy reference kernels in use, or a context window too
    small to time decoding in)."""
    if (model.mode is not FFNMode.SPARSE or compiled_kernels.reference_chosen()
            or not sparse_verdict.can_measure(model)):
        return ""
    found = sparse_verdict.verdict(model, tokenizer, options, compiled_kernels.get_threads(), notice)
    model.mode = FFNMode.SPARSE if found.pays else FFNMode.DENSE
    return f" (auto: {found.describe()})"


def _split_for_budget(path: Path, split, use_split: bool, device: str, vram: int, hardware: str) -> tuple[Path, str]:
    """The split file solved for ``vram`` bytes on ``hardware`` (or the one there, if it serves that budget),
    and how it came to be, for the description."""
    if device == "cpu" or not use_split:
        raise PitoolsError("a VRAM budget places neurons on a GPU: use it with --device cuda (or emulated)")
    if device == "cuda":
        require_cupy()  # before solving: no split written for a GPU that is not there
    split = Path(split) if split is not None else default_split_path(path)
    # A CUDA device needs room for its context and scratch; the emulated one holds weights only.
    reserve = DEFAULT_RESERVE_BYTES if device == "cuda" else 0
    from powerinfer_tools.solver.split import ensure_split  # the ILP's modules: only a run that solves needs them

    report = ensure_split(path, split, vram, load_profile(hardware), reserve_bytes=reserve)
    return split, (f" (solved now for {format_size(vram)})" if report is not None
                   else f" (cached, for {format_size(vram)})")


def _checked_text(prompt: str) -> str:
    """``prompt``, refused when it cannot be UTF-8: on Linux, bytes that are not UTF-8 in a command line
    reach Python as lone surrogates (``-p $'\\xff'`` is ``'\\udcff'``)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SettingError(f"prompt (-p/--prompt): not valid UTF-8 (at character {exc.start})") from None
    return prompt


def _checked_ids(prompt: Sequence[int], vocab_size: int) -> list[int]:
    """Prompt token ids, refused unless each is a whole number naming a token of the vocabulary."""
    ids = list(prompt)
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)
                or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise SettingError(f"prompt: token id {bad!r} is not in the vocabulary (0 to {vocab_size - 1})")
    return [int(t) for t in ids]


def _timed(step, stats: GenerationStats):
    """``step``, timing the prompt's forward pass and then each generated token's into ``stats``."""

    prompt_done = False  # not prompt_seconds == 0: a coarse clock can time a step as no time at all

    def timed(tokens):
        nonlocal prompt_done
        t0 = time.perf_counter()
        logits = step(tokens)
        elapsed = time.perf_counter() - t0
        if not prompt_done:
            stats.prompt_seconds, prompt_done = elapsed, True
        else:
            stats.decode_steps += 1
            stats.generation_seconds += elapsed
        return logits

    return timed
