"""Whether activation sparsity will make a model decode faster here, and the one command to run: ``pitools advise``.

A decoded token on a CPU is bound by the weight bytes it reads, so the answer starts from them, by part
(``token_bytes``: the head, attention and FFN as the runtime's plans read them). Sparsity skips FFN rows only:
a ReLU family's neurons that do not fire (exact zeros: the whole gate finds them exactly, a predictor guesses
them), or a SiLU or GeGLU model's small activations (thresholds: CATS reads every gate row to choose, TEAL drops
small inputs; docs/how-to/quality-budget.md). Each way the file runs, or would run once converted, is priced:

* the bytes' promise: what a dense token reads over what a sparse one does;
* the prediction: that promise times the read rate, how fast sparse decoding reads its bytes against dense
  decoding reading its own: as measured here on the file (the promise of the way it runs over the measured
  speedup, ``read_rate``), else ``SPARSE_READ_RATE``;
* beside the quality the file records for it: exact for the gate's choice, the predictors' recall as trained,
  a thresholded file's held-out perplexity curve where ``convert --max-quality-loss`` wrote one.

Where the file runs sparse on the compiled kernels, ``sparse_verdict`` measures sparse against dense on it, as
``--mode auto`` does (and keeps the result for it). With a VRAM or RAM budget the solver places the file's
neurons and prices the placement with its cost model (``advice_budgets``): predictions, said to be. The
recommendation follows the measurement where there is one (sparse must gain ``sparse_verdict.MIN_GAIN``),
else the prediction.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from powerinfer_tools import kernels as compiled_kernels
from powerinfer_tools.formats.activation_thresholds import LayerThresholds
from powerinfer_tools.formats.ffn_bundle import BundleLayout
from powerinfer_tools.formats.model_check import sparse_layout
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.formats.model_spec import ModelSpec
from powerinfer_tools.models import spec_from_model_file
from powerinfer_tools.runtime import advice_budgets, ffn_plan, sparse_verdict, warmup
from powerinfer_tools.runtime.gate_choice import GATE_CHOOSES
from powerinfer_tools.runtime.llm import LLM, load_options
from powerinfer_tools.runtime.sparse_verdict import MIN_GAIN
from powerinfer_tools.runtime.token_bytes import FFNWay, Recorded, TokenBytes, chosen_by, dense_way, mean_share, priced, recorded
from powerinfer_tools.solver.hardware import DEFAULT_PRESET
from powerinfer_tools.units import format_size, parse_size

# How fast sparse decoding reads its bytes against dense decoding reading its own: a sparse token's rows are
# scattered and read by more, smaller kernel calls, so it decodes at this share of the speed its bytes promise.
# The median over `pitools bench` reports of the runtime as it decodes now (sparse_vs_dense_generation over the
# reports' dense / sparse bytes per token; docs/lab/bench: the realistic TinyLlama and 4- and 32-layer LLaMA-7B-shape
# files with the whole gate choosing, SmolLM2 and Gemma 3 with CATS; 19 reports, quartiles 0.81 and 0.90, all
# but two within 15% of it). examples/advise_calibration.py recomputes it from any set of bench reports.
SPARSE_READ_RATE = 0.85
BENCH_READ_RATE = "the median of pitools bench reports"  # where the read rate comes from: SPARSE_READ_RATE
MEASURED_READ_RATE = "measured here, this file"  # or ``read_rate`` from the measured check
# CATS and TEAL keep a model's quality up to about half its activations skipped (7B models; small ones lose more
# sooner, docs/how-to/quality-budget.md): the most sparsity a conversion is advised at without a quality curve to go by.
MAX_THRESHOLD_SPARSITY = 0.5
SPARSITIES = tuple(step / 10 for step in range(1, 10))  # the rows of a file that records no shares to price


@dataclass(frozen=True)
class Option:
    """One way to run the FFNs, priced against dense."""

    name: str  # "predictor in every layer", "CATS at 30%", ...
    computed: float  # mean share of the FFN neurons a token computes
    bytes: TokenBytes  # what a token reads
    promise: float  # dense bytes over these
    quality: str  # what the file records of its quality
    runs_now: bool  # the file runs it as it is; False: once converted
    sparsity: float | None = None  # a row of a sweep: every unit at this sparsity; None: the shares recorded
    flags: str = ""  # what `pitools run` needs beyond --mode sparse to run it
    read_rate: float = SPARSE_READ_RATE  # the share of its promise that sparse decoding reaches (``read_rate``)

    @property
    def predicted(self) -> float:
        """Sparse decoding's speed over dense's, as predicted."""
        return self.promise * self.read_rate


@dataclass(frozen=True)
class Sweep:
    """A rule choosing every FFN's neurons (a thresholded file's own, CATS, the whole gate, predictors) and what
    a token reads with it computing none of them and all of them: in between, in proportion."""

    rule: str
    way: FFNWay
    none: float
    every: float

    def pays_below(self, dense: float, read_rate: float) -> float:
        """The largest share of the neurons computed at which sparse is predicted to gain ``MIN_GAIN``."""
        return (read_rate * dense / MIN_GAIN - self.none) / (self.every - self.none)


@dataclass(frozen=True)
class Recommendation:
    verdict: str  # "dense", "sparse", "auto", "convert", "gpu", "ram" or "none"
    command: str  # the one command to run ("" where none runs it)
    why: tuple[str, ...]  # the numbers behind it, a sentence each


@dataclass(frozen=True)
class Advice:
    model: str
    about: str  # the family, layers, FFN
    exact_zeros: bool  # a ReLU family: its FFN neurons that do not fire are exactly zero
    dense: TokenBytes  # what a dense token reads (a checkpoint folder: its tensors as stored)
    options: tuple[Option, ...]
    measured: sparse_verdict.Verdict | None  # sparse against dense on this machine, this file
    not_measured: str  # why not, when ``measured`` is None
    gpu: dict | None  # with a VRAM budget: the solver's placement and predictions (or why none)
    ram: dict | None  # with a RAM budget: likewise, three tiers
    read_rate: float = SPARSE_READ_RATE  # sparse decoding's share of its promise: ``read_rate``
    read_rate_source: str = BENCH_READ_RATE
    recommendation: Recommendation | None = None

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for row, option in zip(out["options"], self.options):
            row["predicted"] = option.predicted
        if self.measured is not None:
            out["measured"]["sparse_vs_dense"] = self.measured.speedup
        return out | {"read_rate_source": self.read_rate_source, "min_gain": MIN_GAIN}


@dataclass(frozen=True)
class Budgets:
    """The budgets asked about, as given (for the command) and in bytes."""

    vram: str | None = None
    ram: str | None = None
    hardware: str = DEFAULT_PRESET
    ctx_size: int | None = None  # the KV caches' positions the solver sizes [default: its own]

    def bytes(self, which: str) -> int | None:
        text = getattr(self, which)
        return None if text is None else parse_size(text, f"--{which}")

    def context(self) -> str:
        """The context size as `pitools run` takes it, where one was given."""
        return "" if self.ctx_size is None else f" -c {self.ctx_size}"


def advise(path: Path, budgets: Budgets = Budgets(), kernels: warmup.Policy | str = warmup.Policy.BACKGROUND,
           measure: bool = True, notice: Callable[[str], None] | None = None) -> Advice:
    """The advice for the model file or checkpoint folder ``path``."""
    path = Path(path)
    if path.is_dir():
        return checkpoint_advice(path)
    vram, ram = budgets.bytes("vram"), budgets.bytes("ram")
    model_file = open_model_file(path)
    spec = spec_from_model_file(model_file)
    facts = recorded(model_file, spec)
    powerinfer = sparse_layout(model_file)
    ram_answer = None
    if ram is not None and ram < path.stat().st_size:
        ram_answer = (advice_budgets.ram_prediction(path, ram, vram, budgets.hardware, budgets.ctx_size)
                      if facts.thresholds is None else {"refused": "a thresholded model (CATS, TEAL) reads every gate "
                                                                   "row a token: it runs with its weights in memory"})
    # Where the weights do not all fit: loaded as `pitools run --ram` loads them, the solver pricing the rest.
    limited = ram_answer is not None and ram_answer.get("dense_disk_bytes_per_token", 0) > 0
    bundled = BundleLayout.of_file(model_file) is not None
    # A dense GGUF file has no sparse mode to measure: it is loaded on the NumPy reference, which keeps gate and up
    # in rows (the compiled kernels' interleaved up would be read whole by a rule's plan, where a converted file
    # reads its rows) and starts no build of kernels.
    llm = LLM.load(path, mode="sparse", kernels=kernels if powerinfer else warmup.Policy.REFERENCE,
                   ctx_size=budgets.ctx_size, ram=ram if limited else None, notice=notice)
    model = llm.engine
    dense = dense_way(model).bytes(model, facts.routing)
    sweep = _sweep(model, spec, facts)
    measured, not_measured = _measured(llm, limited, measure, notice)
    options = tuple(_options(model, spec, facts, dense, sweep))
    rate, rate_source = read_rate(options, measured)
    advice = Advice(
        str(path), _about(spec), spec.ffn.sparse, dense,
        tuple(dataclasses.replace(option, read_rate=rate) for option in options), measured, not_measured,
        gpu=None if vram is None else advice_budgets.gpu_prediction(path, vram, budgets.hardware, budgets.ctx_size),
        ram=ram_answer, read_rate=rate, read_rate_source=rate_source)
    why = _cpu(advice, spec, model.can_run_sparse, sweep)
    if ram is not None:
        why = _within_ram(advice, spec, why, budgets, powerinfer, bundled)
    elif advice.gpu is not None:
        why = _with_gpu(advice, why, budgets)
    return dataclasses.replace(advice, recommendation=why)


def _about(spec: ModelSpec) -> str:
    experts = f", {spec.n_experts} experts (top-{spec.n_experts_used})" if spec.moe else ""
    kind = ("exact zeros (a ReLU family)" if spec.ffn.sparse
            else "no exact zeros: sparsity needs thresholds (CATS/TEAL, docs/how-to/quality-budget.md)")
    return (f"{spec.architecture.gguf_name}, {spec.n_layers} layers{experts}, {spec.ffn.value} FFN "
            f"({spec.ffn.activation}): {kind}")


def _measured(llm: LLM, limited: bool, wanted: bool, notice) -> tuple[sparse_verdict.Verdict | None, str]:
    """``sparse_verdict``'s measurement of the loaded model (kept for ``--mode auto``), or why there is none."""
    if not llm.engine.can_run_sparse:
        return None, "the file has no sparse mode to run (no predictors or thresholds)"
    if not wanted:
        return None, "not asked for (--no-measure)"
    if limited:
        return None, "under a RAM budget the neuron caches read from disk: a few tokens tell nothing of their speed"
    if compiled_kernels.reference_chosen():
        return None, ("the compiled kernels are not built on this machine yet (a background build is under way): "
                      "advise again once it is done")
    verdict = sparse_verdict.verdict(llm.engine, llm.tokenizer, load_options(), compiled_kernels.get_threads(), notice)
    return verdict, ""


def read_rate(options: tuple[Option, ...], measured: sparse_verdict.Verdict | None) -> tuple[float, str]:
    """The share of the bytes' promise that sparse decoding reaches, and where it comes from: the measured
    speedup over the promise of the way the file runs (the first option, where it records the shares to price it),
    so that every other way is predicted at this machine's rate for this file's layout; without both,
    ``SPARSE_READ_RATE``."""
    loaded = options[0] if options and options[0].runs_now and options[0].sparsity is None else None
    if measured is None or loaded is None:
        return SPARSE_READ_RATE, BENCH_READ_RATE
    return measured.speedup / loaded.promise, MEASURED_READ_RATE


def _sweep(model, spec: ModelSpec, facts: Recorded) -> Sweep:
    """The rule that would choose the neurons of ``model``'s FFNs: a thresholded file's own; CATS on a SiLU or
    GeGLU FFN; the whole gate on a ReLU-gated one (not a mixture: each expert's predictor chooses); else
    predictors."""
    sparse = model.ffn_plans[model.mode]
    if model.can_run_sparse and facts.thresholds is not None:
        plans, rule = sparse, next(plan.choice_words for plan in sparse if plan.choice.thresholded)
    elif not spec.ffn.sparse:
        plans, rule = chosen_by(model, [LayerThresholds(cats=0.0)] * spec.n_layers), "CATS"
    elif spec.ffn.relu_gated and not spec.moe:
        plans, rule = chosen_by(model, [GATE_CHOOSES] * spec.n_layers), "whole gate (exact)"
    else:
        plans, rule = chosen_by(model, [None] * spec.n_layers), "predictors"
    way = FFNWay.of(plans)
    return Sweep(rule, way, way.at(0).bytes(model, facts.routing).total, way.bytes(model, facts.routing).total)


def _options(model, spec: ModelSpec, facts: Recorded, dense: TokenBytes, sweep: Sweep):
    """The ways to run ``model``'s FFNs: as loaded and its alternatives, where the file records the shares to
    price them; the rule's sweep (a thresholded file's curve where it records one) where it does not, or where
    another sparsity means another conversion."""
    loaded = priced(model.ffn_plans[model.mode], facts) if model.can_run_sparse else None
    if loaded is not None:
        name = ffn_plan.gist(list(loaded.plans)).removeprefix("neurons: ")
        yield _option(name, model, loaded, facts, dense, _quality(facts, loaded), True)
        yield from _alternatives(model, spec, facts, dense, loaded)
        if facts.thresholds is None:
            return
    curve = facts.thresholds.choice if facts.thresholds is not None else None
    if curve is not None:  # quality against sparsity, as --max-quality-loss measured it
        for sparsity, perplexity in list(zip(curve.curve_sparsity, curve.curve_perplexity))[1:]:
            quality = f"held-out perplexity {perplexity:.4g} ({perplexity / curve.curve_perplexity[0] - 1:+.1%})"
            yield _option(f"{sweep.rule} at {sparsity:.0%}", model, sweep.way.at(1 - sparsity), facts, dense,
                          quality, False, sparsity)
        return
    quality = ("exact (what fires)" if sweep.rule.startswith("whole gate")
               else "not recorded (convert --max-quality-loss records it)" if not spec.ffn.sparse
               else "not recorded")
    for sparsity in SPARSITIES:
        yield _option(f"{sweep.rule} at {sparsity:.0%}", model, sweep.way.at(1 - sparsity), facts, dense, quality,
                      model.can_run_sparse and loaded is None, sparsity)


def _option(name: str, model, way: FFNWay, facts: Recorded, dense: TokenBytes, quality: str, runs_now: bool,
            sparsity: float | None = None, flags: str = "") -> Option:
    read = way.bytes(model, facts.routing)
    return Option(name, mean_share(way, facts.routing), read, dense.total / read.total, quality, runs_now, sparsity,
                  flags)


def _quality(facts: Recorded, way: FFNWay) -> str:
    """What the file records of the quality of ``way`` (its plans' choices)."""
    words, choices = [], {plan.choice_words for plan in way.plans}
    if "whole gate (exact)" in choices:
        words.append("exact where the whole gate chooses")
    if "predictor" in choices and facts.predictors is not None:
        words.append(f"predictors trained to recall >= {facts.predictors['worst_recall']:.1%} of the firing neurons")
    if facts.thresholds is not None and facts.thresholds.choice is not None:
        c = facts.thresholds.choice
        words.append(f"held-out perplexity {c.perplexity:.4g} ({c.loss:+.1%} over dense, limit {c.max_loss:.0%})")
    return "; ".join(words) or "not recorded"


def _alternatives(model, spec: ModelSpec, facts: Recorded, dense: TokenBytes, loaded: FFNWay):
    """Of a ReLU-gated file with predictors, each choice in every layer, where the loaded plans mix them or
    chose the other (``--neuron-choice``)."""
    if not (spec.ffn.relu_gated and not spec.moe and model.ram is None and facts.firing is not None
            and facts.computed is not None):
        return
    for name, thresholds, flag in (("whole gate (exact) in every layer", GATE_CHOOSES, "--neuron-choice gate"),
                                   ("predictor in every layer", None, "--neuron-choice predictor")):
        way = priced(chosen_by(model, [thresholds] * spec.n_layers), facts)
        if [p.choice for p in way.plans] != [p.choice for p in loaded.plans]:
            yield _option(name, model, way, facts, dense, _quality(facts, way), True, flags=flag)


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def _parts(d: TokenBytes) -> str:
    return (f"a dense token reads {mb(d.total)}: the output head {mb(d.head)} ({d.head / d.total:.0%}), attention "
            f"{mb(d.attention)} ({d.attention / d.total:.0%}), the FFNs {mb(d.ffn)} ({d.ffn / d.total:.0%})")


def _priced(option: Option, source: str) -> str:
    return (f"{option.name}: {option.computed:.1%} of the FFN neurons computed, {mb(option.bytes.total)} read a "
            f"token: the bytes promise {option.promise:.2f}x, predicted {option.predicted:.2f}x our dense decoding "
            f"(sparse decoding reads its bytes at {option.read_rate:.0%} of dense decoding's rate: {source})")


def _floor(sweep: Sweep, advice: Advice) -> str:
    """Where the rule starts to pay, or that it never does."""
    dense = advice.dense
    share = sweep.pays_below(dense.total, advice.read_rate)
    if share <= 0:
        return (f"no sparsity pays: with {sweep.rule} computing no FFN neuron at all, a token would still read "
                f"{mb(sweep.none)} of {mb(dense.total)}: {dense.total / sweep.none:.2f}x promised, "
                f"{advice.read_rate * dense.total / sweep.none:.2f}x predicted, below the {MIN_GAIN:.2f}x sparse "
                "must gain")
    return (f"{sweep.rule} is predicted to gain {MIN_GAIN:.2f}x only where at most {share:.0%} of the FFN neurons "
            f"are computed (above {1 - share:.0%} sparsity): it reads {mb(sweep.none - dense.head - dense.attention)} "
            "of FFN rows a token even computing none")


def _cpu(advice: Advice, spec: ModelSpec, runs_sparse: bool, sweep: Sweep) -> Recommendation:
    """On this machine's CPU: sparse where it pays (measured, else predicted), a conversion that would, or dense."""
    m, why, source = advice.model, [_parts(advice.dense)], advice.read_rate_source
    recorded_ways = [o for o in advice.options if o.runs_now and o.sparsity is None]
    measured = advice.measured
    if measured is not None:
        measured_words = (f"measured on this machine, this file: {measured.describe()} ({sparse_verdict.STEPS} "
                          f"tokens each way, alternating by blocks of {sparse_verdict.BLOCK})")
    if runs_sparse and (recorded_ways or measured is not None):
        if recorded_ways:
            why.append(_priced(recorded_ways[0], source))
        pays = measured.pays if measured is not None else recorded_ways[0].predicted >= MIN_GAIN
        if measured is not None:
            why.append(measured_words)
        if pays:
            return Recommendation("sparse", f"pitools run {m} --mode sparse", tuple(why))
        return Recommendation("dense", f"pitools run {m} --mode dense", (*why, _floor(sweep, advice)))
    if runs_sparse:
        return Recommendation("auto", f"pitools run {m}", (*why, "the file records no firing shares to price its "
                                                           "sparse mode; --mode auto measures it on the first run"))
    if not spec.ffn.sparse:
        paying = [o for o in advice.options if o.sparsity is not None and o.sparsity <= MAX_THRESHOLD_SPARSITY + 1e-9
                  and o.predicted >= MIN_GAIN]
        if paying:
            return Recommendation("convert", f"pitools convert {m} --target-sparsity {paying[0].sparsity:g}",
                                  (*why, _priced(paying[0], source), "its quality is not recorded: measure it with "
                                   "pitools perplexity on the converted file, --mode sparse against --mode dense"))
        at_most = [o for o in advice.options if o.sparsity == MAX_THRESHOLD_SPARSITY]
        pays_somewhere = sweep.pays_below(advice.dense.total, advice.read_rate) > 0
        beyond = (f"; beyond the {MAX_THRESHOLD_SPARSITY:.0%} at which CATS and TEAL keep a model's quality "
                  "(docs/how-to/quality-budget.md)" if pays_somewhere else "")
        return Recommendation("dense", f"pitools run {m}",
                              (*why, *(_priced(o, source) for o in at_most), _floor(sweep, advice) + beyond))
    if sweep.pays_below(advice.dense.total, advice.read_rate) > 0:
        return Recommendation("convert", f"pitools convert {m}", (
            *why, _floor(sweep, advice), "converting profiles how many of its neurons fire and writes the "
            "PowerInfer file; pitools advise that file then prices it"))
    return Recommendation("dense", f"pitools run {m}", (*why, _floor(sweep, advice)))


def _with_gpu(advice: Advice, cpu: Recommendation, budgets: Budgets) -> Recommendation:
    """With a GPU: the solver's placement where its cost model predicts it gains on the CPU alone."""
    g, vram = advice.gpu, budgets.vram
    if "refused" in g:
        return dataclasses.replace(cpu, why=(*cpu.why, f"no GPU placement within --vram {vram}: {g['refused']}"))
    words = (f"within --vram {vram} the solver puts {g['gpu_neuron_share']:.0%} of the FFN neurons, "
             f"{g['layers_on_gpu']} of {g['layers']} layers' attention"
             f"{' and the output head' if g['head_on_gpu'] else ''} on the GPU "
             f"({format_size(g['vram_bytes']['total'])}); its cost model predicts (bandwidths of {g['hardware']}, not "
             f"measured) {g['tokens_per_s']:.1f} tokens/s, against {g['cpu_tokens_per_s']:.1f} on the CPU alone and "
             f"{g['llama_cpp_tokens_per_s']:.1f} for llama.cpp dense with -ngl {g['llama_cpp_n_gpu_layers']}")
    if g["tokens_per_s"] >= MIN_GAIN * g["cpu_tokens_per_s"]:
        return Recommendation("gpu", f"pitools run {advice.model} --device cuda --vram {vram}{budgets.context()}",
                              (*cpu.why, words))
    return dataclasses.replace(cpu, why=(*cpu.why, words))


def _within_ram(advice: Advice, spec: ModelSpec, cpu: Recommendation, budgets: Budgets, powerinfer: bool,
                bundled: bool) -> Recommendation:
    """Within a RAM budget: as without where the model fits; else the solver's three tiers, sparse against dense."""
    m, r, ram = advice.model, advice.ram, budgets.ram
    if r is None or r.get("dense_disk_bytes_per_token") == 0:
        return dataclasses.replace(cpu, why=(*cpu.why, f"the whole model fits within --ram {ram}: the budget changes "
                                                       "nothing"))
    if "refused" in r:
        why = (*cpu.why, f"within --ram {ram}: {r['refused']}")
        if spec.ffn.sparse and not powerinfer:  # --ram runs a PowerInfer file
            return Recommendation("convert", f"pitools convert {m}", why)
        return Recommendation("none", "", why)
    pays = r["tokens_per_s"] >= MIN_GAIN * r["dense_tokens_per_s"]
    hits = "" if r["cache_hit_rate"] is None else f", {r['cache_hit_rate']:.0%} of them found in the neuron caches"
    disk = "; disk figures: defaults for an unmeasured disk (pitools probe --disk)" if r["disk_defaulted"] else ""
    why = (*cpu.why, f"within --ram {ram} the solver keeps the hottest neurons in memory and reads "
                     f"{mb(r['disk_bytes_per_token'])} a token from disk sparse{hits}, "
                     f"{mb(r['dense_disk_bytes_per_token'])} dense; its cost model predicts (bandwidths of "
                     f"{r['hardware']}{disk}, not measured) {r['tokens_per_s']:.2f} tokens/s sparse against "
                     f"{r['dense_tokens_per_s']:.2f} dense")
    if not bundled:
        why = (*why, f"pitools bundle {m} first makes each cold neuron one disk read")
    return Recommendation("ram", f"pitools run {m} --ram {ram}{budgets.context()} --mode {'sparse' if pays else 'dense'}",
                          why)


def checkpoint_advice(folder: Path) -> Advice:
    """A checkpoint folder: its tensors' bytes as stored, by part, and the conversion that makes a file the runtime
    (and this advice) can judge."""
    from powerinfer_tools.checkpoints.checkpoint import Checkpoint
    from powerinfer_tools.formats.gguf_names import tensor_kind, tensor_names
    from powerinfer_tools.models import checkpoint_spec

    checkpoint = Checkpoint(folder)
    spec = checkpoint_spec(checkpoint)
    parts = {"output": 0.0, "attention": 0.0, "ffn": 0.0, "embedding": 0.0}
    for name in tensor_names(spec, powerinfer=False):
        kind = tensor_kind(name.target)
        if kind in parts and name.sources:
            info = checkpoint.info(name.sources[0])
            per_value = info.nbytes / max(1, math.prod(info.shape))
            routed = spec.n_experts_used / spec.n_experts if name.stacked else 1.0
            parts[kind] += per_value * math.prod(name.shape) * len(name.sources) * routed
    head = parts["output"] or parts["embedding"]  # tied: the logits read the embedding matrix
    dense = TokenBytes(head=head, attention=parts["attention"], ffn=parts["ffn"])
    advice = Advice(str(folder), _about(spec), spec.ffn.sparse, dense, (), None,
                    "a checkpoint runs on the NumPy reference engine only", None, None)
    command = f"pitools convert {folder}" + ("" if spec.ffn.sparse else " --dense")
    why = (f"{_parts(dense)}, as stored", "the runtime runs a GGUF file: convert it"
           + (" (profiling its firing and training predictors)" if spec.ffn.sparse else "")
           + ", then pitools advise the file")
    return dataclasses.replace(advice, recommendation=Recommendation("convert", command, why))

