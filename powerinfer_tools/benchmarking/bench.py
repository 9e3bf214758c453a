"""Benchmark our runtime (sparse and dense) against llama.cpp's dense model of the same weights, and
optionally against PowerInfer's own runtime on the PowerInfer file.

Each engine runs alone. Per round, every engine in turn gets a fresh process that loads the model,
makes one warm-up run (page faults, numba's compiled-code cache, llama.cpp's graph allocation) and
one measured run, and exits before the next engine's process starts: nothing is left idle, so no
waiting OpenMP thread spins on the cores the measured engine needs, and every engine runs at its
libraries' defaults. The order rotates every round. Figures are medians over the rounds; a ratio
between two engines is the median of their per-round ratios, which pairs runs made close together
in time on a machine whose load drifts. Peak RSS is the engine process's own, the largest over the
rounds; our kernels are compiled before the rounds, in a process of their own, where numba's cache lacks them
(a user's runs compile them once per machine), so that no engine's peak holds the compiler's memory.

Decoding is teacher-forced: every engine is fed the same text, one token at a time after the
prompt, and computes the logits of each step (the argmax is taken and discarded). A random model's
greedy output tends to repeat one token, which would keep the same neurons in cache and flatter the
sparse runtime. PowerInfer's ``main`` cannot be fed tokens: it reads the prompt's text and decodes
greedily (benchmarking/powerinfer_engine.py).

Settings: ``threads`` for every engine (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and NUMBA_NUM_THREADS,
llama.cpp's n_threads, PowerInfer's -t). Nothing else is set: OMP_WAIT_POLICY and the like are
whatever the caller's environment says (reported when set). llama.cpp runs at its defaults, its
weight repacking (CPU_REPACK) included; where its AMX path faults, found by a probe process before
the rounds, AMX alone is turned off (benchmarking/llamacpp.py). The report names each engine's
settings and the CPU model, and for our runtime its execution report (``RuntimeModel.execution_report``:
which path and kernels computed each layer), made by the engine's process once the model is loaded.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
import functools
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
from gguf import MODEL_TENSOR, Keys

from powerinfer_tools.benchmarking.llamacpp import (
    AmxStatus,
    Buffers,
    load_llama_cpp,
    probe_amx,
)
from powerinfer_tools.benchmarking.machine import cpu_description, peak_rss
from powerinfer_tools.benchmarking.memory_limit import MemoryLimit, MemoryLimitExceeded
from powerinfer_tools.benchmarking.powerinfer_engine import (
    check_executable,
    parse_timings,
    run_powerinfer,
)
from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.direct_io import forget_cached_pages
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.activation_thresholds import read_thresholds
from powerinfer_tools.formats.constants import neuron_frequency_key, predictor_names, tensor_name
from powerinfer_tools.formats.gguf_spec import predictor_quality
from powerinfer_tools.formats.model_check import routing_frequencies
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.models import spec_from_model_file
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.units import format_size

# The engines: our runtime in its FFN modes (named by them), llama.cpp, and PowerInfer's runtime.
SPARSE, DENSE, LLAMA_CPP, POWERINFER = FFNMode.SPARSE.value, FFNMode.DENSE.value, "llama.cpp", "powerinfer"
TEXT = BUNDLED_MODEL / "heldout.txt"  # what the engines read: the same token ids for all of them
TEXT_CHARS = 200_000
RSS_ALLOWANCE = 0.15  # the target: peak RSS within the model file plus the KV cache plus 15%


@dataclass(frozen=True)
class BenchSettings:
    prompt_tokens: int = 128
    generate: int = 64  # decoding steps per run
    runs: int = 5  # measured rounds, after one warm-up round
    threads: int = 2
    memory_limit: int | None = None  # bytes: each engine process in a memory cgroup of that size
    ram: int | None = None  # bytes: our runtime's weights budget (its --ram: neuron caches)
    quality_steps: int = 32  # decoding steps of the quality pass after the rounds (0: none; benchmarking/agreement.py)
    neuron_choice: str = "auto"  # what chooses a ReLU family's neurons in sparse mode (runtime.gate_choice)


@dataclass(frozen=True)
class EngineSpec:
    name: str  # SPARSE, DENSE, LLAMA_CPP or POWERINFER
    path: Path
    threads: int
    context: int  # tokens the KV cache must hold
    buffers: Buffers | None = None  # llama.cpp's weight buffers
    binary: Path | None = None  # PowerInfer's main
    ram: int | None = None  # our runtime's weights budget
    neuron_choice: str = "auto"  # our runtime's (runtime.gate_choice)


@dataclass
class Run:
    prompt_seconds: float
    generation_seconds: float
    bytes_per_token: float | None  # weight bytes read per decoding step (None: unknown, PowerInfer)
    density: float | None = None  # fraction of FFN neurons computed while decoding (our runtime)
    counts: tuple[int, int] | None = None  # prompt tokens and decoding steps, where not the settings' (PowerInfer)
    hit_rate: float | None = None  # under --ram, while decoding: cold neurons found in the neuron caches
    disk_bytes_per_token: float | None = None  # under --ram: bytes read from the file per decoding step
    resident_bytes: int | None = None  # under --ram: the weights in memory at the end of the run


@dataclass
class EngineResult:
    name: str
    path: str
    file_bytes: int
    kv_bytes: int  # KV cache allocated for the run's context
    peak_rss: int
    baseline_rss: int | None  # peak RSS with the engine's libraries loaded, before the model: its fixed cost
    settings: BenchSettings
    runs: list[Run] = field(default_factory=list)
    engine_settings: dict = field(default_factory=dict)  # threads, environment, buffer types: as reported
    execution: list[str] | None = None  # our runtime's execution report: which path and kernels ran what

    def prompt_rates(self) -> list[float]:
        return [(r.counts[0] if r.counts else self.settings.prompt_tokens) / r.prompt_seconds for r in self.runs]

    def generation_rates(self) -> list[float]:
        return [(r.counts[1] if r.counts else self.settings.generate) / r.generation_seconds for r in self.runs]

    @property
    def rss_budget(self) -> int:
        return int((self.file_bytes + self.kv_bytes) * (1 + RSS_ALLOWANCE))

    def summary(self, bandwidth_gbs: float | None) -> dict:
        generation = statistics.median(self.generation_rates())
        known = [r.bytes_per_token for r in self.runs if r.bytes_per_token is not None]
        bytes_per_token = statistics.median(known) if known else None
        densities = [r.density for r in self.runs if r.density is not None]
        implied_gbs = generation * bytes_per_token / 1e9 if bytes_per_token is not None else None
        return {
            "file": self.path,
            "settings": self.engine_settings,
            "prompt_tokens_per_s": statistics.median(self.prompt_rates()),
            "generation_tokens_per_s": generation,
            "bytes_per_token": bytes_per_token,
            "implied_gbs": implied_gbs,
            "bandwidth_fraction": implied_gbs / bandwidth_gbs if bandwidth_gbs and implied_gbs is not None else None,
            "density": statistics.median(densities) if densities else None,
            **_cache_summary(self.runs),
            "peak_rss": self.peak_rss,
            "baseline_rss": self.baseline_rss,
            "file_bytes": self.file_bytes,
            "kv_bytes": self.kv_bytes,
            "rss_budget": self.rss_budget,
            **({"execution": self.execution} if self.execution is not None else {}),
            "runs": [asdict(r) for r in self.runs],
        }


# Our runtime's memory besides its weights and KV cache: the interpreter, NumPy, numba's LLVM and ggml's
# library, the heap (examples/memory_breakdown.py: ~180 MiB on the 1B shape; 235 MB measured beside a
# 158 MiB budget on a 4-layer model, prompt buffers included), the caches' read
# buffers and bookkeeping: what a memory limit must leave it beyond --ram.
RUNTIME_FIXED_BYTES = 300 * 2**20


def ram_within_limit(model: Path, limit: int, context: int) -> int:
    """The weights budget our runtime gets under a memory limit of ``limit`` bytes: what is left of it after
    the runtime's fixed memory and its float32 KV cache for ``context`` tokens."""
    m = open_model_file(model)
    kv = 2 * f16_kv_bytes(m, context)  # ours is float32: twice llama.cpp's float16 cache
    ram = limit - RUNTIME_FIXED_BYTES - kv
    if ram <= 0:
        raise PitoolsError(f"--memory-limit {format_size(limit)} leaves nothing for {model}'s weights: our runtime "
                           f"needs ~{format_size(RUNTIME_FIXED_BYTES)} besides them and {format_size(kv)} of KV cache")
    return ram


def _cache_summary(runs: list[Run]) -> dict:
    """Medians of the neuron caches' figures over the runs made under --ram; nothing for other runs."""
    cached = [r for r in runs if r.hit_rate is not None]
    if not cached:
        return {}
    return {"hit_rate": statistics.median(r.hit_rate for r in cached),
            "disk_bytes_per_token": statistics.median(r.disk_bytes_per_token for r in cached),
            "resident_bytes": max(r.resident_bytes for r in cached)}


# --- the engines, each inside its worker process -------------------------------------------------


class _Runtime:
    """Our runtime on a model file, in one FFN mode, all on the CPU."""

    @staticmethod
    def import_libraries() -> None:
        from powerinfer_tools import kernels
        from powerinfer_tools.runtime import compiled_decode  # noqa: F401 - numba and the compiled decoding loops

        kernels.available()  # loads ggml's CPU library

    def __init__(self, spec: EngineSpec):
        from powerinfer_tools import kernels
        from powerinfer_tools.runtime.loader import load_runtime_model

        kernels.set_threads(spec.threads)
        self.model = load_runtime_model(spec.path, use_split=False, ram=spec.ram, neuron_choice=spec.neuron_choice)
        mode = FFNMode(spec.name)
        if mode is FFNMode.SPARSE and not self.model.can_run_sparse:
            raise PitoolsError(f"{spec.path}: no predictors (or thresholds) in the file, so no sparse run")
        self.model.mode = mode
        self.caches = self.model.new_cache()

    def execution_report(self) -> list[str]:
        return self.model.execution_report()

    def run(self, tokens: np.ndarray, n_prompt: int) -> Run:
        from powerinfer_tools.runtime.engine import TokenStats

        model = self.model
        self.caches = None  # the last run's KV cache freed before this one's is made: one at a time, as in a user's run
        self.caches = caches = model.new_cache()
        start = time.perf_counter()
        model.forward(tokens[:n_prompt], caches, all_logits=False).argmax()
        prompt_done = time.perf_counter()
        model.stats = stats = TokenStats()
        for token in tokens[n_prompt:]:
            model.forward(np.array([token]), caches, all_logits=False).argmax()
        end = time.perf_counter()
        if model.ram is None:
            return Run(prompt_done - start, end - prompt_done, stats.bytes_per_step, stats.density)
        return Run(prompt_done - start, end - prompt_done, stats.bytes_per_step, stats.density,
                   hit_rate=stats.hit_rate, disk_bytes_per_token=stats.disk_bytes / stats.steps,
                   resident_bytes=model.ram.resident_bytes)

    def kv_bytes(self) -> int:
        return sum(c.keys.nbytes + c.values.nbytes for c in self.caches)


class _LlamaCpp:
    """llama.cpp (through llama-cpp-python) on a dense GGUF."""

    @staticmethod
    def import_libraries() -> None:
        import llama_cpp  # noqa: F401

    def __init__(self, spec: EngineSpec):
        import llama_cpp

        self._llama_cpp = llama_cpp
        self.llm = load_llama_cpp(spec.path, spec.buffers, n_ctx=spec.context, n_batch=512, n_threads=spec.threads,
                                  n_threads_batch=spec.threads)
        model = open_model_file(spec.path)
        self.bytes_per_token = _dense_bytes_per_token(model)
        self._kv_bytes = f16_kv_bytes(model, self.llm.n_ctx())

    def execution_report(self) -> None:
        """None: which kernels llama.cpp runs is its own affair (its settings are reported)."""
        return None

    def run(self, tokens: np.ndarray, n_prompt: int) -> Run:
        llm, vocab = self.llm, self.llm.n_vocab()

        def logits() -> np.ndarray:
            return np.ctypeslib.as_array(self._llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))

        llm.reset()
        start = time.perf_counter()
        llm.eval(tokens[:n_prompt].tolist())
        logits().argmax()
        prompt_done = time.perf_counter()
        for token in tokens[n_prompt:]:
            llm.eval([int(token)])
            logits().argmax()
        end = time.perf_counter()
        return Run(prompt_done - start, end - prompt_done, self.bytes_per_token)

    def kv_bytes(self) -> int:
        return self._kv_bytes


def f16_kv_bytes(model, context: int) -> int:
    """Bytes of a float16 KV cache of ``context`` tokens (llama.cpp's and PowerInfer's default type)."""
    heads, kv_heads = model.get(Keys.Attention.HEAD_COUNT), model.get(Keys.Attention.HEAD_COUNT_KV) or 0
    width = (kv_heads or heads) * model.get(Keys.LLM.EMBEDDING_LENGTH) // heads
    return 2 * context * model.get(Keys.LLM.BLOCK_COUNT) * width * 2


def _dense_bytes_per_token(model) -> int:
    """Weight bytes a dense decoding step reads: every tensor but the embedding, of which one row; of a
    mixture's stacked experts ([experts, rows, cols]) the routed ones', as llama.cpp reads them."""
    embedding = model[tensor_name(MODEL_TENSOR.TOKEN_EMBD)]
    experts, used = model.get(Keys.LLM.EXPERT_COUNT, 0), model.get(Keys.LLM.EXPERT_USED_COUNT, 0)

    def read(t) -> int:
        return t.nbytes * used // experts if experts and len(t.shape) == 3 and t.shape[0] == experts else t.nbytes

    rest = sum(read(t) for t in model.tensors.values() if t.name != embedding.name)
    return rest + embedding.nbytes // embedding.shape[0]


def _serve(conn, spec: EngineSpec) -> None:
    """Worker process: load the engine, then run jobs until told to stop; reply with results or an error."""
    try:
        engine_class = _LlamaCpp if spec.name == LLAMA_CPP else _Runtime
        engine_class.import_libraries()
        baseline = peak_rss() or 0
        engine = engine_class(spec)
        conn.send(("ready", engine.execution_report()))
        while (job := conn.recv()) is not None:
            conn.send(("run", engine.run(*job)))
        conn.send(("done", (peak_rss() or 0, baseline, engine.kv_bytes())))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it as one line
        conn.send(("error", f"{spec.name} ({spec.path}): {type(exc).__name__}: {exc}"))


class _Worker:
    """One engine in its own interpreter, ``python -m powerinfer_tools.benchmarking.bench``, driven over
    one end of a socket pair it inherits: when the process dies, even before it has read anything,
    the next read here ends (EOFError) instead of waiting for ever.

    Not a multiprocessing child: those re-import the parent's main module, which for the ``pitools``
    command is every subcommand and its libraries, and that would count in the engine's RSS.
    """

    def __init__(self, spec: EngineSpec, env: dict[str, str], launch=list):
        self.spec = spec
        ours, theirs = socket.socketpair()
        with theirs:
            self.process = subprocess.Popen(launch([sys.executable, "-m", __spec__.name, str(theirs.fileno())]),
                                            env={**os.environ, **env}, pass_fds=(theirs.fileno(),))
        self.conn = Connection(ours.detach())
        self.send(spec)

    def call(self, message, expect: str):
        self.send(message)
        return self.receive(expect)

    def send(self, message) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, ConnectionResetError):
            self._died()

    def receive(self, expect: str):
        try:
            kind, payload = self.conn.recv()
        except (EOFError, ConnectionResetError):
            self._died()
        if kind == "error":
            raise PitoolsError(payload)
        assert kind == expect, (kind, expect)
        return payload

    def _died(self):
        """The process is gone (a fault in a library, a signal, killed): one error line saying how."""
        status = self.process.wait(timeout=10)
        how = f"signal {signal.Signals(-status).name}" if status < 0 else f"exit status {status}"
        raise PitoolsError(f"{self.spec.name} ({self.spec.path}): the engine's process died ({how})") from None

    def close(self) -> None:
        self.conn.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def worker_main(fd: int) -> None:
    """The engine worker process's entry point (``python -m`` this module with FD): serves the
    benchmark's requests on the inherited socket ``fd``."""
    with Connection(fd) as conn:
        _serve(conn, conn.recv())


# --- the benchmark -------------------------------------------------------------------------------


def worker_environment(threads: int) -> dict[str, str]:
    """What the engine processes' environment adds to the caller's: ``threads`` for OpenMP, OpenBLAS
    and numba, nothing else (each library's defaults hold unless the caller set its variables)."""
    return {name: str(threads) for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")}


def omp_wait_policy() -> str:
    """The caller's OMP_WAIT_POLICY, passed through to every engine, or "unset" (libgomp's default)."""
    return os.environ.get("OMP_WAIT_POLICY") or "unset"


def bench_tokens(model_path: Path, count: int) -> np.ndarray:
    """The first ``count`` tokens of the benchmark text, in the model's own vocabulary."""
    ids = _tokenizer(model_path).encode(TEXT.read_text(encoding="utf-8")[:TEXT_CHARS], add_bos=False)[:count]
    if len(ids) < count:
        raise PitoolsError(f"the benchmark text is only {len(ids)} tokens long in {model_path}'s vocabulary")
    return np.array(ids, dtype=np.int64)


def _tokenizer(model_path: Path):
    from powerinfer_tools.runtime.tokenizer import GGUFTokenizer

    return GGUFTokenizer(open_model_file(model_path).metadata, source=str(model_path))


def measure_bandwidth(threads: int) -> float:
    """``pitools probe``'s CPU bandwidth (GB/s), measured in a fresh interpreter with the workers' environment."""
    code = "from powerinfer_tools.solver.hardware import measure_cpu_bandwidth; print(measure_cpu_bandwidth())"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **worker_environment(threads)},
                          capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def engine_specs(model: Path, baseline: Path | None, settings: BenchSettings, modes, powerinfer: Path | None,
                 progress) -> list[tuple[EngineSpec, dict]]:
    """The engines to run, each with the settings the report names."""
    if powerinfer is not None:
        check_executable(Path(powerinfer))
    total = settings.prompt_tokens + settings.generate
    reported = {"threads": settings.threads} | ({"omp_wait_policy": omp_wait_policy()}
                                                 if "OMP_WAIT_POLICY" in os.environ else {})
    # Dense runs on the same dense GGUF as llama.cpp when there is one: an identical file for both,
    # and its ffn_down rows are read by vec_dot, faster per token than the axpy over ffn_down_t.
    files = {SPARSE: Path(model), DENSE: Path(baseline if baseline is not None else model)}
    ours = reported | ({"ram": settings.ram} if settings.ram is not None else {})
    specs = [(EngineSpec(m, files[m], settings.threads, total, ram=settings.ram, neuron_choice=settings.neuron_choice),
              ours | ({"neuron_choice": settings.neuron_choice} if m == SPARSE and settings.neuron_choice != "auto"
                      else {})) for m in modes]
    if baseline is not None:
        buffers, buffer_settings = llama_cpp_buffers(Path(baseline), settings.threads, progress)
        specs.append((EngineSpec(LLAMA_CPP, Path(baseline), settings.threads, total, buffers),
                      reported | buffer_settings))
    if powerinfer is not None:
        specs.append((EngineSpec(POWERINFER, Path(model), settings.threads, 2 * total, binary=Path(powerinfer)),
                      reported | {"binary": str(powerinfer), "decoding": "its own greedy tokens"}))
    return specs


def llama_cpp_buffers(baseline: Path, threads: int, progress) -> tuple[Buffers, dict]:
    """llama.cpp's weight buffers: its defaults, less AMX where the probe finds that AMX faults."""
    status, offered, detail = probe_amx(baseline, threads)
    buffers = Buffers.REPACK if status is AmxStatus.FAULTS else Buffers.DEFAULT
    if status is AmxStatus.FAULTS:
        progress(f"llama.cpp: its AMX path faults on this machine ({detail}): it runs with AMX off, CPU_REPACK on")
    used = [name for name in offered if name != "AMX" or status is AmxStatus.ON]
    return buffers, {"extra_buffer_types": used, "repack": "CPU_REPACK" in used,
                     "amx": status.value + (f" ({detail})" if detail else "")}


def _run_alone(spec: EngineSpec, env: dict[str, str], tokens: np.ndarray, n_prompt: int,
               launch=list) -> tuple[Run, int, int, int, list[str] | None]:
    """One engine process, alone: start, load, a warm-up run, the measured run, exit.
    Returns the measured run, the process's peak RSS, its libraries' RSS, its KV cache bytes and its
    execution report (our runtime's; None for llama.cpp)."""
    worker = _Worker(spec, env, launch)
    try:
        execution = worker.receive("ready")
        worker.call((tokens, n_prompt), "run")  # the warm-up
        run = worker.call((tokens, n_prompt), "run")
        peak, libraries, kv_bytes = worker.call(None, "done")
    finally:
        worker.close()
    return run, peak, libraries, kv_bytes, execution


def _run_powerinfer(spec: EngineSpec, env: dict[str, str], prompt_text: str, generate: int, launch=list
                    ) -> tuple[Run, int, None, int, None]:
    """One run of PowerInfer's main (which warms up by itself), timed by its own printed timings."""
    output, peak = run_powerinfer(spec.binary, spec.path, prompt_text, generate, spec.threads, spec.context, env,
                                  launch)
    prompt_seconds, prompt_count, decode_seconds, decode_count = parse_timings(output, spec.binary)
    run = Run(prompt_seconds, decode_seconds, None, counts=(prompt_count, decode_count))
    return run, peak, None, f16_kv_bytes(open_model_file(spec.path), spec.context), None


def _within_limit(spec: EngineSpec, limit_bytes: int | None, run_once):
    """``run_once(launch)`` with the engine's process (its command line passed through ``launch``) in a
    memory cgroup of ``limit_bytes`` (none when None), its model file's cached pages dropped first so
    that no engine inherits another's."""
    if limit_bytes is None:
        return run_once(list)
    limit = MemoryLimit(limit_bytes)
    try:
        forget_cached_pages(spec.path)
        return run_once(limit.command)
    except PitoolsError as exc:
        if limit.oom_kills():
            raise MemoryLimitExceeded(f"{spec.name} ({spec.path}): killed by the kernel for exceeding "
                                      f"--memory-limit {limit.describe()}") from exc
        raise
    finally:
        limit.close()


PLAIN_UNDER_LIMIT = {"extra_buffer_types": [], "repack": False,
                     "memory_limit": "killed under it at its defaults (repacked weights in anonymous memory): "
                                     "runs with repacking off, its weights memory-mapped"}


def _measure(spec: EngineSpec, env: dict[str, str], tokens: np.ndarray, prompt_text: str, settings: BenchSettings):
    """One measured run of ``spec``'s engine, under the settings' memory limit if any."""
    if spec.name == POWERINFER:
        run_once = partial(_run_powerinfer, spec, env, prompt_text, settings.generate)
    else:
        run_once = partial(_run_alone, spec, env, tokens, settings.prompt_tokens)
    return _within_limit(spec, settings.memory_limit, run_once)


def run_bench(model: Path, baseline: Path | None, settings: BenchSettings, modes=(SPARSE, DENSE),
              progress=lambda message: None, powerinfer: Path | None = None) -> dict[str, EngineResult]:
    """Run every engine ``settings.runs`` times, each alone in its own process, taking turns in an order
    that rotates every round; results by engine name."""
    n_prompt, total = settings.prompt_tokens, settings.prompt_tokens + settings.generate
    tokens = bench_tokens(model, total)
    prompt_text = _tokenizer(model).decode(tokens[:n_prompt].tolist()) if powerinfer is not None else ""
    specs = engine_specs(model, baseline, settings, modes, powerinfer, progress)
    env = worker_environment(settings.threads)
    _compile_before_the_rounds([spec for spec, _ in specs if spec.name in (SPARSE, DENSE)], progress)
    results = {spec.name: EngineResult(spec.name, str(spec.path), spec.path.stat().st_size, 0, 0, None, settings,
                                       engine_settings=reported) for spec, reported in specs}
    measure = partial(_measure, env=env, tokens=tokens, prompt_text=prompt_text, settings=settings)
    for round_ in range(settings.runs):
        for i in ((round_ + k) % len(specs) for k in range(len(specs))):
            spec = specs[i][0]
            try:
                run, peak, libraries, kv_bytes, execution = measure(spec)
            except MemoryLimitExceeded:
                if spec.name != LLAMA_CPP or spec.buffers is Buffers.PLAIN:
                    raise
                # Its repacked copy of the weights is anonymous memory, which no limit below its size holds:
                # its best under the limit is its plain load, weights memory-mapped like everyone's.
                spec = replace(spec, buffers=Buffers.PLAIN)
                specs[i] = (spec, specs[i][1])
                results[spec.name].engine_settings.update(PLAIN_UNDER_LIMIT)
                progress(f"llama.cpp: {PLAIN_UNDER_LIMIT['memory_limit']}")
                run, peak, libraries, kv_bytes, execution = measure(spec)
            r = results[spec.name]
            r.runs.append(run)
            r.peak_rss, r.kv_bytes, r.execution = max(r.peak_rss, peak), kv_bytes, execution
            if libraries is not None:  # PowerInfer's is not known
                r.baseline_rss = max(r.baseline_rss or 0, libraries)
        progress(f"round {round_ + 1}/{settings.runs}")
    return results


def _compile_before_the_rounds(specs: list[EngineSpec], progress) -> None:
    """Our kernels for each of ``specs``' files compiled now, in a process of their own, where numba's cache
    lacks them: else the first round's engine would compile them, and its peak RSS (the largest of the rounds)
    would hold the compiler's memory, which a user's runs pay once per machine."""
    # (Imported here: the engine processes that import this module must not load more than they use.)
    from powerinfer_tools.runtime.llm import load_options
    from powerinfer_tools.runtime.warmup import build_elsewhere_and_wait

    for spec in specs:
        if build_elsewhere_and_wait(spec.path, load_options(use_split=False, ram=spec.ram,
                                                            neuron_choice=spec.neuron_choice)):
            progress(f"{spec.name}: compiled the kernels for {spec.path.name} (once on this machine)")


def bench_quality(model: Path, settings: BenchSettings, progress=lambda message: None) -> dict | None:
    """Off the clock, after the rounds: the sparse file's decoding of the bench's first
    ``settings.quality_steps`` steps against dense (``agreement.measure_agreement``); None when the settings
    ask for none."""
    # (Imported here: it loads the runtime, which the engine processes that import this module must not.)
    from powerinfer_tools.benchmarking.agreement import measure_agreement

    steps = min(settings.quality_steps, settings.generate)
    if not steps:
        return None
    progress(f"quality: {steps} decoding steps sparse against dense, off the clock ...")
    tokens = bench_tokens(model, settings.prompt_tokens + settings.generate)
    return measure_agreement(model, tokens, settings.prompt_tokens, steps, settings.threads,
                             settings.neuron_choice).as_dict()


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of ``a[i] / b[i]``."""
    return statistics.median(x / y for x, y in zip(a, b))


def report(results: dict[str, EngineResult], settings: BenchSettings, bandwidth_gbs: float | None,
           bandwidth_source: str = "", predictors: dict | None = None, quality: dict | None = None) -> dict:
    """The JSON report: the CPU, settings, every engine's summary and settings, and the ratios against
    llama.cpp (and of sparse against PowerInfer's runtime); ``predictors``: the sparse model's
    ``predictor_summary``; ``quality``: its ``bench_quality``."""
    out = {
        "cpu": cpu_description(),
        "settings": asdict(settings),
        "omp_wait_policy": omp_wait_policy(),
        "bandwidth_gbs": bandwidth_gbs,
        "bandwidth_source": bandwidth_source,
        "engines": {name: r.summary(bandwidth_gbs) for name, r in results.items()},
    }
    if predictors is not None:
        out["predictors"] = predictors
    if quality is not None:
        out["quality"] = quality
    for base_name, key in ((LLAMA_CPP, "llamacpp"), (POWERINFER, "powerinfer")):
        base = results.get(base_name)
        names = (SPARSE, DENSE, POWERINFER) if base_name == LLAMA_CPP else (SPARSE,)
        for name in names if base is not None else ():
            if name in results:
                r = results[name]
                out[f"{name}_vs_{key}_generation"] = paired_ratio(r.generation_rates(), base.generation_rates())
                out[f"{name}_vs_{key}_prompt"] = paired_ratio(r.prompt_rates(), base.prompt_rates())
    if SPARSE in results and DENSE in results:  # whether sparsity pays here (--mode auto's question)
        out["sparse_vs_dense_generation"] = paired_ratio(results[SPARSE].generation_rates(),
                                                         results[DENSE].generation_rates())
    return out


def predictor_summary(path: Path) -> dict:
    """The predictability of the model the sparse engine ran on: its predictors' quality as trained
    (when the file records it) and the bytes read per token: all of them, or of a mixture the routed
    experts' (each expert's weighted by its profiled routing frequency). A thresholded SiLU model has
    no predictors: its rule, target and the share of neurons its calibration computed instead."""
    model = open_model_file(path)
    spec = spec_from_model_file(model)
    read = 0.0
    for unit in spec.ffn_units:
        read += _read_share(model, spec, unit) * sum(model[name].nbytes for name in predictor_names(unit.layer, unit.expert)
                                                     if name in model)
    summary = {"trained": predictor_quality(model), "bytes_per_token": read}
    thresholds = read_thresholds(model.get, spec.n_layers, str(path))
    if thresholds is not None:
        frequencies = [model.get(neuron_frequency_key(layer)) for layer in range(spec.n_layers)]
        summary["thresholds"] = {"rule": thresholds.rule.value, "target": thresholds.target,
                                 "calibrated_density": float(np.mean(frequencies)) if all(frequencies) else None}
    return summary


def _read_share(model, spec, unit) -> float:
    """How often an FFN runs per token: a layer's always; an expert when routed to (its profiled routing
    frequency, or the experts used over the experts when the file records none)."""
    if unit.expert is None:
        return 1.0
    routing = routing_frequencies(model, spec, unit.layer)
    return spec.n_experts_used / spec.n_experts if routing is None else float(routing[unit.expert])


def format_report(rep: dict) -> str:
    s, cpu = rep["settings"], rep["cpu"]
    lines = [
        f"CPU: {cpu['model']} ({'with' if cpu['amx'] else 'no'} AMX)",
        (f"{s['prompt_tokens']}-token prompt, {s['generate']} decoding steps, {s['threads']} threads, "
         f"medians of {s['runs']} runs, each engine alone in its own process "
         f"(OMP_WAIT_POLICY {rep['omp_wait_policy']})"),
        (f"{'engine':10} {'prompt tok/s':>12} {'gen tok/s':>10} {'MB/token':>9} {'GB/s':>6} "
         f"{'of bw':>8} {'density':>7} {'peak RSS':>9} {'budget':>9} {'libs':>6}"),
    ]
    if s.get("memory_limit"):
        lines.insert(2, f"memory limit {format_size(s['memory_limit'])} per engine process (a memory cgroup, page "
                        "cache counted; each run starts with its model file out of the cache)")
    for name, e in rep["engines"].items():
        lines.append(f"{name:10} {e['prompt_tokens_per_s']:12.1f} {e['generation_tokens_per_s']:10.2f} "
                     f"{_field(e['bytes_per_token'], 9, '.1f', 1e-6)} {_field(e['implied_gbs'], 6, '.1f')} "
                     f"{_field(e['bandwidth_fraction'], 8, '.0%')} {_field(e['density'], 7, '.1%')} "
                     f"{e['peak_rss'] / 2**20:8.0f}M {e['rss_budget'] / 2**20:8.0f}M "
                     f"{_field(e['baseline_rss'], 5, '.0f', 2**-20, 'M')}")
    if rep["bandwidth_gbs"]:
        lines.append(f"memory bandwidth {rep['bandwidth_gbs']:.1f} GB/s ({rep['bandwidth_source']}); "
                     "GB/s = generation tokens/s x bytes read per token")
    lines.append("budget = (model file + KV cache) x 1.15; libs = peak RSS of the engine's libraries before "
                 "the model loads")
    for name, e in rep["engines"].items():
        if "hit_rate" in e:
            lines.append(f"{name}: --ram {format_size(e['settings']['ram'])}: weights in memory "
                         f"{format_size(e['resident_bytes'])}, neuron cache hit rate {e['hit_rate']:.1%}, "
                         f"{e['disk_bytes_per_token'] / 1e6:.2f} MB read from disk per token")
    for name, e in rep["engines"].items():
        if "execution" in e:
            lines.append(f"{name}: how it computed:")
            lines += [f"  {line}" for line in e["execution"]]
    for name, e in rep["engines"].items():
        if set(e["settings"]) - {"threads"}:
            lines.append(f"{name}: " + ", ".join(f"{k} {_setting(v)}" for k, v in e["settings"].items()))
    predictors = rep.get("predictors")
    if predictors and predictors.get("thresholds"):
        t = predictors["thresholds"]
        calibrated = "" if t["calibrated_density"] is None else f", {t['calibrated_density']:.1%} of neurons read"
        lines.append(f"thresholds: {t['rule']} at {t['target']:.0%} sparsity (calibrated{calibrated})")
    elif predictors:
        trained = predictors["trained"]
        quality = (f"trained to recall >= {trained['worst_recall']:.1%} at precision {trained['mean_precision']:.1%}, "
                   f"computing {trained['mean_computed']:.1%} of the neurons; " if trained else "")
        lines.append(f"predictors: {quality}{predictors['bytes_per_token'] / 1e6:.2f} MB read per token")
    if rep.get("quality"):
        lines.append(_quality_line(rep["quality"]))
    ratios = [(k, v) for k, v in rep.items() if k.endswith(("_generation", "_prompt"))]
    names = {"_vs_llamacpp_": " / llama.cpp ", "_vs_powerinfer_": " / powerinfer ", "_vs_dense_": " / our dense "}
    if ratios:
        lines.append("ratios (median of per-round ratios): " + ", ".join(
            f"{functools.reduce(lambda text, pair: text.replace(*pair), names.items(), k)} {v:.2f}x"
            for k, v in ratios))
    if "sparse_vs_dense_generation" in rep:
        lines.append(_sparsity_verdict(rep["sparse_vs_dense_generation"]))
    return "\n".join(lines)


def _quality_line(q: dict) -> str:
    """What the sparse engine's speed costs, as the quality pass measured it."""
    rise = q["sparse_perplexity"] / q["dense_perplexity"] - 1
    recall = ""
    if q["selection"]:
        s = q["selection"]
        worst = min(layer["recall"] for layer in s["layers"])
        recall = (f"; predictors' recall {s['recall']:.1%} (worst layer {worst:.1%}), computing "
                  f"{s['computed_density']:.1%} of the neurons where {s['fired_density']:.1%} fire")
    return (f"quality (off the clock, {q['steps']} decoding steps, sparse against dense on the same file): "
            f"top-1 agreement {q['top1']:.1%}, KL {q['kl_mean']:.2g} nats (max {q['kl_max']:.2g}){recall}; "
            f"perplexity of the {q['scored']} next tokens {q['sparse_perplexity']:.3g} against "
            f"{q['dense_perplexity']:.3g} ({rise:+.1%})")


def _sparsity_verdict(gain: float) -> str:
    """Whether sparse generation, ``gain`` times our dense's, pays here, as ``--mode auto`` decides."""
    from powerinfer_tools.runtime.sparse_verdict import MIN_GAIN  # (the runtime: only where it reports)

    return (f"sparsity {'pays' if gain >= MIN_GAIN else 'does not pay'} on this machine for this model "
            f"(sparse {gain:.2f}x our dense generation); `pitools run` (--mode auto) measures it on MODEL itself "
            f"and runs sparse only where it decodes at least {MIN_GAIN - 1:.0%} faster than dense")


def _field(value: float | None, width: int, spec: str, scale: float = 1.0, unit: str = "") -> str:
    """A number in the report's table, or "-" when it is unknown (PowerInfer's bytes, for one)."""
    return format(value * scale, f">{width}{spec}") + unit if value is not None else "-".rjust(width + len(unit))


def _setting(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return (", ".join(value) or "none") if isinstance(value, list) else str(value)


if __name__ == "__main__":
    # Through the module proper, not this __main__ copy: results must pickle under its name.
    from powerinfer_tools.benchmarking.bench import worker_main

    worker_main(int(sys.argv[1]))
