"""Benchmark our runtime (sparse and dense) against llama.cpp's dense model of the same weights.

Each engine runs in its own process, so that its peak RSS is its own and one engine's memory does
not crowd another's, and the engines take turns: one run (a prompt, then token-by-token decoding)
each per round, the first round a discarded warm-up (page faults, numba's compiled-code cache,
llama.cpp's graph allocation). Figures are medians over the rounds; a ratio between two engines is
the median of their per-round ratios, which pairs runs made close together in time on a machine
whose load drifts.

Decoding is teacher-forced: every engine is fed the same text, one token at a time after the
prompt, and computes the logits of each step (the argmax is taken and discarded). A random model's
greedy output tends to repeat one token, which would keep the same neurons in cache and flatter the
sparse runtime.

Threads: the worker processes get ``OMP_WAIT_POLICY=passive`` (unless the caller set it) and
``threads`` for OpenMP, OpenBLAS, numba and llama.cpp. With libgomp's default spin-waiting, a
2-thread run on a busy 2-core machine loses a scheduler slice per parallel region
(docs/kernels.md); llama.cpp's OpenMP threads share the same libgomp, so both sides run under the
same setting.
"""

from __future__ import annotations

import os
import resource
import secrets
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Client, Listener
from pathlib import Path

import numpy as np
from gguf import MODEL_TENSOR, Keys

from powerinfer_tools.benchmarking.llamacpp import load_llama_cpp
from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.constants import tensor_name
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.interfaces import FFNMode

# The engines: our runtime in its FFN modes (named by them), and llama.cpp.
SPARSE, DENSE, LLAMA_CPP = FFNMode.SPARSE.value, FFNMode.DENSE.value, "llama.cpp"
TEXT = BUNDLED_MODEL / "heldout.txt"  # what the engines read: the same token ids for all of them
TEXT_CHARS = 200_000
RSS_ALLOWANCE = 0.15  # the target: peak RSS within the model file plus the KV cache plus 15%


@dataclass(frozen=True)
class BenchSettings:
    prompt_tokens: int = 128
    generate: int = 64  # decoding steps per run
    runs: int = 5  # measured rounds, after one warm-up round
    threads: int = 2


@dataclass(frozen=True)
class EngineSpec:
    name: str  # SPARSE, DENSE or LLAMA_CPP
    path: Path
    threads: int
    context: int  # tokens the KV cache must hold


@dataclass
class Run:
    prompt_seconds: float
    generation_seconds: float
    bytes_per_token: float  # weight bytes read per decoding step
    density: float | None = None  # fraction of FFN neurons computed while decoding (our runtime)


@dataclass
class EngineResult:
    name: str
    path: str
    file_bytes: int
    kv_bytes: int  # KV cache allocated for the run's context
    peak_rss: int
    baseline_rss: int  # peak RSS with the engine's libraries loaded, before the model: its fixed cost
    settings: BenchSettings
    runs: list[Run] = field(default_factory=list)

    def prompt_rates(self) -> list[float]:
        return [self.settings.prompt_tokens / r.prompt_seconds for r in self.runs]

    def generation_rates(self) -> list[float]:
        return [self.settings.generate / r.generation_seconds for r in self.runs]

    @property
    def rss_budget(self) -> int:
        return int((self.file_bytes + self.kv_bytes) * (1 + RSS_ALLOWANCE))

    def summary(self, bandwidth_gbs: float | None) -> dict:
        generation = statistics.median(self.generation_rates())
        bytes_per_token = statistics.median(r.bytes_per_token for r in self.runs)
        densities = [r.density for r in self.runs if r.density is not None]
        implied_gbs = generation * bytes_per_token / 1e9
        return {
            "file": self.path,
            "prompt_tokens_per_s": statistics.median(self.prompt_rates()),
            "generation_tokens_per_s": generation,
            "bytes_per_token": bytes_per_token,
            "implied_gbs": implied_gbs,
            "bandwidth_fraction": implied_gbs / bandwidth_gbs if bandwidth_gbs else None,
            "density": statistics.median(densities) if densities else None,
            "peak_rss": self.peak_rss,
            "baseline_rss": self.baseline_rss,
            "file_bytes": self.file_bytes,
            "kv_bytes": self.kv_bytes,
            "rss_budget": self.rss_budget,
            "runs": [asdict(r) for r in self.runs],
        }


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
        self.model = load_runtime_model(spec.path, use_split=False)
        mode = FFNMode(spec.name)
        if mode is FFNMode.SPARSE and not self.model.has_predictors:
            raise PitoolsError(f"{spec.path}: no predictors in the file, so no sparse run")
        self.model.mode = mode
        self.caches = self.model.new_cache()

    def run(self, tokens: np.ndarray, n_prompt: int) -> Run:
        from powerinfer_tools.runtime.engine import TokenStats

        model = self.model
        self.caches = caches = model.new_cache()
        start = time.perf_counter()
        model.forward(tokens[:n_prompt], caches, all_logits=False).argmax()
        prompt_done = time.perf_counter()
        model.stats = stats = TokenStats()
        for token in tokens[n_prompt:]:
            model.forward(np.array([token]), caches, all_logits=False).argmax()
        end = time.perf_counter()
        return Run(prompt_done - start, end - prompt_done, stats.bytes_per_step, stats.density)

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
        self.llm = load_llama_cpp(spec.path, n_ctx=spec.context, n_batch=512, n_threads=spec.threads,
                                  n_threads_batch=spec.threads)
        model = open_model_file(spec.path)
        self.bytes_per_token = _dense_bytes_per_token(model)
        self._kv_bytes = 2 * self.llm.n_ctx() * model.get(Keys.LLM.BLOCK_COUNT) * _kv_width(model) * 2  # f16

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


def _kv_width(model) -> int:
    heads, kv_heads = model.get(Keys.Attention.HEAD_COUNT), model.get(Keys.Attention.HEAD_COUNT_KV) or 0
    return (kv_heads or heads) * model.get(Keys.LLM.EMBEDDING_LENGTH) // heads


def _dense_bytes_per_token(model) -> int:
    """Weight bytes a dense decoding step reads: every tensor but the embedding, of which one row."""
    embedding = model[tensor_name(MODEL_TENSOR.TOKEN_EMBD)]
    rest = sum(t.nbytes for t in model.tensors.values() if t.name != embedding.name)
    return rest + embedding.nbytes // embedding.shape[0]


def _peak_rss() -> int:
    """Peak resident set of this process's memory map. Linux keeps ``ru_maxrss`` across exec, so a
    worker would report its parent's size (the pitools process) when that is larger; VmHWM starts
    afresh with the new map."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def _serve(conn, spec: EngineSpec) -> None:
    """Worker process: load the engine, then run jobs until told to stop; reply with results or an error."""
    try:
        engine_class = _LlamaCpp if spec.name == LLAMA_CPP else _Runtime
        engine_class.import_libraries()
        baseline = _peak_rss()
        engine = engine_class(spec)
        conn.send(("ready", None))
        while (job := conn.recv()) is not None:
            conn.send(("run", engine.run(*job)))
        conn.send(("done", (_peak_rss(), baseline, engine.kv_bytes())))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it as one line
        conn.send(("error", f"{spec.name} ({spec.path}): {type(exc).__name__}: {exc}"))


class _Worker:
    """One engine in its own interpreter, ``python -m powerinfer_tools.benchmarking.bench``, driven over a socket.

    Not a multiprocessing child: those re-import the parent's main module, which for the ``pitools``
    command is every subcommand and its libraries, and that would count in the engine's RSS.
    """

    def __init__(self, spec: EngineSpec, env: dict[str, str]):
        self.spec = spec
        key = secrets.token_bytes(16)
        with Listener(family="AF_UNIX", authkey=key) as listener:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __spec__.name, listener.address],
                env={**os.environ, **env, _AUTHKEY_VARIABLE: key.hex()},
            )
            self.conn = listener.accept()
        self.conn.send(spec)

    def call(self, message, expect: str):
        self.conn.send(message)
        return self.receive(expect)

    def receive(self, expect: str):
        kind, payload = self.conn.recv()
        if kind == "error":
            raise PitoolsError(payload)
        assert kind == expect, (kind, expect)
        return payload

    def close(self) -> None:
        self.conn.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


_AUTHKEY_VARIABLE = "PITOOLS_BENCH_AUTHKEY"


def worker_main(address: str) -> None:
    """The engine worker process's entry point (``python -m`` this module with ADDRESS): serves the
    benchmark's requests on the connection at ``address``."""
    with Client(address, authkey=bytes.fromhex(os.environ[_AUTHKEY_VARIABLE])) as conn:
        _serve(conn, conn.recv())


# --- the benchmark -------------------------------------------------------------------------------


def worker_environment(threads: int) -> dict[str, str]:
    """Environment of the worker processes: passive OpenMP waiting, and ``threads`` everywhere."""
    env = {name: str(threads) for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")}
    env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "passive")
    return env


def bench_tokens(model_path: Path, count: int) -> np.ndarray:
    """The first ``count`` tokens of the benchmark text, in the model's own vocabulary."""
    from powerinfer_tools.runtime.tokenizer import GGUFTokenizer

    tokenizer = GGUFTokenizer(open_model_file(model_path).metadata)
    ids = tokenizer.encode(TEXT.read_text(encoding="utf-8")[:TEXT_CHARS], add_bos=False)[:count]
    if len(ids) < count:
        raise PitoolsError(f"the benchmark text is only {len(ids)} tokens long in {model_path}'s vocabulary")
    return np.array(ids, dtype=np.int64)


def measure_bandwidth(threads: int) -> float:
    """``pitools probe``'s CPU bandwidth (GB/s), measured in a fresh interpreter with the workers' environment."""
    code = "from powerinfer_tools.solver.hardware import measure_cpu_bandwidth; print(measure_cpu_bandwidth())"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **worker_environment(threads)},
                          capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def run_bench(model: Path, baseline: Path | None, settings: BenchSettings, modes=(SPARSE, DENSE),
              progress=lambda message: None) -> dict[str, EngineResult]:
    """Run every engine ``settings.runs`` times (after a warm-up), taking turns; results by engine name."""
    n_prompt, total = settings.prompt_tokens, settings.prompt_tokens + settings.generate
    tokens = bench_tokens(model, total)
    # Dense runs on the same dense GGUF as llama.cpp when there is one: an identical file for both,
    # and its ffn_down rows are read by vec_dot, ~10% faster per token than the axpy over ffn_down_t.
    files = {SPARSE: Path(model), DENSE: Path(baseline if baseline is not None else model)}
    specs = [EngineSpec(m, files[m], settings.threads, total) for m in modes]
    if baseline is not None:
        specs.append(EngineSpec(LLAMA_CPP, Path(baseline), settings.threads, total))
    env = worker_environment(settings.threads)
    workers = [_Worker(spec, env) for spec in specs]
    results = {}
    try:
        for w in workers:
            w.receive("ready")
            results[w.spec.name] = EngineResult(w.spec.name, str(w.spec.path), w.spec.path.stat().st_size, 0, 0, 0,
                                                settings)
        for round_ in range(settings.runs + 1):
            order = workers[round_ % len(workers):] + workers[: round_ % len(workers)]
            for w in order:
                run = w.call((tokens, n_prompt), "run")
                if round_:  # round 0 is the warm-up
                    results[w.spec.name].runs.append(run)
            progress(f"round {round_}/{settings.runs}" + (" (warm-up)" if not round_ else ""))
        for w in workers:
            r = results[w.spec.name]
            r.peak_rss, r.baseline_rss, r.kv_bytes = w.call(None, "done")
    finally:
        for w in workers:
            w.close()
    return results


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of ``a[i] / b[i]``."""
    return statistics.median(x / y for x, y in zip(a, b))


def report(results: dict[str, EngineResult], settings: BenchSettings, bandwidth_gbs: float | None,
           bandwidth_source: str = "") -> dict:
    """The JSON report: settings, every engine's summary and the ratios against llama.cpp."""
    out = {
        "settings": asdict(settings),
        "omp_wait_policy": worker_environment(settings.threads)["OMP_WAIT_POLICY"],
        "bandwidth_gbs": bandwidth_gbs,
        "bandwidth_source": bandwidth_source,
        "engines": {name: r.summary(bandwidth_gbs) for name, r in results.items()},
    }
    base = results.get(LLAMA_CPP)
    if base is not None:
        for name in (SPARSE, DENSE):
            if name in results:
                r = results[name]
                out[f"{name}_vs_llamacpp_generation"] = paired_ratio(r.generation_rates(), base.generation_rates())
                out[f"{name}_vs_llamacpp_prompt"] = paired_ratio(r.prompt_rates(), base.prompt_rates())
    return out


def format_report(rep: dict) -> str:
    s = rep["settings"]
    lines = [
        (f"{s['prompt_tokens']}-token prompt, {s['generate']} decoding steps, {s['threads']} threads, "
         f"medians of {s['runs']} runs (OMP_WAIT_POLICY={rep['omp_wait_policy']})"),
        (f"{'engine':10} {'prompt tok/s':>12} {'gen tok/s':>10} {'MB/token':>9} {'GB/s':>6} "
         f"{'of bw':>8} {'density':>7} {'peak RSS':>9} {'budget':>9} {'libs':>6}"),
    ]
    for name, e in rep["engines"].items():
        fraction = f"{e['bandwidth_fraction']:.0%}" if e["bandwidth_fraction"] is not None else "-"
        density = f"{e['density']:.1%}" if e["density"] is not None else "-"
        lines.append(f"{name:10} {e['prompt_tokens_per_s']:12.1f} {e['generation_tokens_per_s']:10.2f} "
                     f"{e['bytes_per_token'] / 1e6:9.1f} {e['implied_gbs']:6.1f} {fraction:>8} {density:>7} "
                     f"{e['peak_rss'] / 2**20:8.0f}M {e['rss_budget'] / 2**20:8.0f}M "
                     f"{e['baseline_rss'] / 2**20:5.0f}M")
    if rep["bandwidth_gbs"]:
        lines.append(f"memory bandwidth {rep['bandwidth_gbs']:.1f} GB/s ({rep['bandwidth_source']}); "
                     "GB/s = generation tokens/s x bytes read per token")
    lines.append("budget = (model file + KV cache) x 1.15; libs = peak RSS of the engine's libraries before "
                 "the model loads")
    ratios = [(k, v) for k, v in rep.items() if k.endswith(("_generation", "_prompt"))]
    if ratios:
        lines.append("ratios (median of per-round ratios): "
                     + ", ".join(f"{k.replace('_vs_llamacpp_', ' / llama.cpp ')} {v:.2f}x" for k, v in ratios))
    return "\n".join(lines)


if __name__ == "__main__":
    # Through the module proper, not this __main__ copy: results must pickle under its name.
    from powerinfer_tools.benchmarking.bench import worker_main

    worker_main(sys.argv[1])
