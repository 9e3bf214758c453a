"""The neuron cache under a RAM budget (``pitools run --ram``) and the bundled FFN layout (``pitools bundle``):
the cache's bookkeeping on a file of known rows, and whole models computing exactly what they compute
unconstrained, in both layouts."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from cli_checks import fails, invoke
from gguf import MODEL_TENSOR

from powerinfer_tools.benchmarking.synth import Planting, Shape, synthesize
from powerinfer_tools.commands.inspect import describe
from powerinfer_tools.conversion.bundle import bundle_model
from powerinfer_tools.direct_io import ALIGNMENT
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.formats.constants import PowerInferTensor, tensor_name
from powerinfer_tools.formats.ffn_bundle import BundleLayout
from powerinfer_tools.formats.gpu_split import default_split_path, read_gpu_split
from powerinfer_tools.formats.model_file import open_model_file
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.runtime.llm import LLM
from powerinfer_tools.runtime.loader import load_runtime_model
from powerinfer_tools.kernels.row_reads import plan_reads
from powerinfer_tools.runtime.neuron_cache import MAX_READ_BYTES, NeuronCache, NeuronFile, RowSource, stream_in_order

# --- the cache on a file whose rows say who they are --------------------------------------------------

ROW = 48  # bytes per row of each of the two matrices
N = 64  # neurons


@pytest.fixture
def row_file(tmp_path):
    """A file of N rows of two 48-byte parts; part m of neuron n is filled with the byte (n + 100 m) % 256."""
    rows = np.array([[(n + 100 * m) % 256] * ROW for n in range(N) for m in range(2)], dtype=np.uint8)
    path = tmp_path / "rows.bin"
    path.write_bytes(bytes(ALIGNMENT) + rows.tobytes())  # the rows start at an aligned offset
    return path


def _cache(path, capacity, policy="lru", pinned=()):
    source = RowSource(ALIGNMENT, 2 * ROW, 2 * ROW, ((0, 0, ROW), (1, ROW, ROW)))
    return NeuronCache(NeuronFile(path), [source], [ROW, ROW], N, np.array(pinned, dtype=np.int64), capacity, policy)


def _step(cache, neurons):
    """One step as the runtime takes it: hits first, then the misses loaded; the misses."""
    neurons = np.asarray(neurons)
    resident = cache.resident(neurons)
    cache.new_step(neurons[resident])
    cache.load(neurons[~resident])()
    return sorted(neurons[~resident].tolist())


def _holds(cache, neuron):
    row = cache.row_of[neuron]
    return row >= 0 and (cache.rows[0][row] == neuron).all() and (cache.rows[1][row] == (neuron + 100) % 256).all()


def test_misses_are_read_into_slots_and_hits_are_counted(row_file):
    cache = _cache(row_file, capacity=4, pinned=[0, 1])
    assert _holds(cache, 0) and _holds(cache, 1)  # pinned at load
    assert _step(cache, [0, 5, 9]) == [5, 9]
    assert _step(cache, [5, 9, 12]) == [12]
    assert all(_holds(cache, n) for n in (0, 1, 5, 9, 12))
    assert (cache.counters.hits, cache.counters.misses) == (2, 3)  # pinned neurons are not cache hits
    assert cache.counters.disk_bytes > 0


def test_lru_evicts_the_slot_used_longest_ago(row_file):
    cache = _cache(row_file, capacity=3)
    for neurons in ([1], [2], [3], [1]):  # 2 is now the least recently used
        _step(cache, neurons)
    _step(cache, [4])
    assert cache.row_of[2] == -1 and all(_holds(cache, n) for n in (1, 3, 4))


def test_lfu_evicts_the_slot_used_least_often(row_file):
    cache = _cache(row_file, capacity=3, policy="lfu")
    for neurons in ([1], [2], [3], [1], [3], [3]):  # uses: 1 twice, 2 once (and longest ago), 3 three times
        _step(cache, neurons)
    _step(cache, [4])
    assert cache.row_of[2] == -1
    _step(cache, [5])  # 4 (one use) goes before 1 (two), though 1 was used longer ago
    assert cache.row_of[4] == -1 and _holds(cache, 1) and _holds(cache, 3)


def test_a_step_never_evicts_what_it_uses(row_file):
    cache = _cache(row_file, capacity=3)
    _step(cache, [1, 2, 3])
    cache.new_step(np.array([1, 2]))
    assert cache.free_slots() == 1
    with pytest.raises(RuntimeError):
        cache.load(np.array([7, 8]))


def test_a_step_larger_than_the_cache_streams_through_it_in_order(row_file):
    cache = _cache(row_file, capacity=4, pinned=[0, 1])
    _step(cache, [7])  # one slot holds a neuron already
    neurons = np.array([0, 1, 3, 5, 6, 7, 9, 12, 20, 21, 30, 40, 41, 50])
    ranges, misses_at_yield = [], []
    for first, stop in stream_in_order(cache, neurons):
        assert all(_holds(cache, n) for n in neurons[first:stop])
        assert np.count_nonzero(~cache.pinned(neurons[first:stop])) <= 2  # half the slots: the rest are read meanwhile
        ranges.append((first, stop))
        misses_at_yield.append(cache.counters.misses)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(neurons)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and len(ranges) > 2
    # while a range is computed, the next one's misses are already being read
    assert all(m == 1 + np.count_nonzero(~np.isin(neurons[: ranges[i + 1][1]], [0, 1, 7]))
               for i, m in enumerate(misses_at_yield[:-1]))
    assert cache.counters.hits == 1  # neuron 7, from its slot


def test_a_step_that_fits_the_cache_is_one_range(row_file):
    cache = _cache(row_file, capacity=4, pinned=[0, 1])
    assert list(stream_in_order(cache, np.array([0, 1, 3, 5, 6, 9]))) == [(0, 6)]


def _runs(neurons, source, max_bytes=MAX_READ_BYTES):
    """The reads ``plan_reads`` makes for ``neurons`` as (index of the first, count) of the rows each brings."""
    plan = plan_reads(np.array(neurons), [source], np.arange(len(neurons)), max_bytes)
    counts = np.diff(plan.copy_start) // len(source.parts)
    return list(zip((np.cumsum(counts) - counts).tolist(), counts.tolist()))


def test_neighbouring_rows_share_a_read():
    source = RowSource(0, 1000, 1000, ((0, 0, 1000),))
    assert _runs([1, 2, 3, 40, 41], source) == [(0, 3), (3, 2)]
    bundled = RowSource(0, ALIGNMENT, 3000, ((0, 0, 3000),))  # aligned rows: neighbours touch, far ones do not
    assert _runs([0, 1, 5], bundled) == [(0, 2), (2, 1)]
    small = RowSource(0, 256, 216, ((0, 0, 216),))  # 16 rows to a block: one read for the block's rows
    assert _runs([0, 3, 15, 16], small) == [(0, 4)]
    assert _runs(list(range(40)), bundled, max_bytes=8 * ALIGNMENT) == [(0, 8), (8, 8), (16, 8), (24, 8), (32, 8)]


def test_a_read_plan_is_aligned_and_copies_every_part_of_every_row():
    source = RowSource(100, 700, 650, ((0, 0, 300), (1, 300, 350)))  # rows not aligned, two parts each
    neurons, slots = np.array([0, 1, 9, 30, 31, 200]), np.array([5, 4, 3, 2, 1, 0])
    plan = plan_reads(neurons, [source], slots, MAX_READ_BYTES)
    assert (plan.reads[:, 0] % ALIGNMENT == 0).all() and (plan.reads[:, 1] % ALIGNMENT == 0).all()
    assert plan.total == plan.reads[:, 1].sum()
    for k, (offset, length, at, needed) in enumerate(plan.reads):
        assert needed <= length
        for src, matrix, slot, nbytes in plan.copies[plan.copy_start[k] : plan.copy_start[k + 1]]:
            neuron = neurons[slots == slot][0]
            part_offset = source.parts[matrix][1]
            assert src - at == 100 + neuron * 700 + part_offset - offset  # where the part lies in the read
            assert nbytes == source.parts[matrix][2] and src - at + nbytes <= needed
    assert sorted(map(tuple, plan.copies[:, 1:3].tolist())) == sorted((m, s) for s in slots for m in (0, 1))


def test_a_truncated_file_is_one_clear_error(row_file):
    cache = _cache(row_file, capacity=4)
    os.truncate(row_file, ALIGNMENT + 10 * 2 * ROW)
    with pytest.raises(PitoolsError, match="rows.bin.*truncated"):
        _step(cache, [30])


# --- whole models ----------------------------------------------------------------------------------------

# A synthetic model whose FFN is most of its file (test-tiny's is not: its embeddings are), so that half
# the file leaves room for only part of the FFN.
WIDE = Shape(d_model=128, d_ff=2048, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, context=256,
             rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """(split layout, bundled layout) of the WIDE synthetic model, q4_0, with predictors."""
    from gguf_fixtures import FAST_TRAINING

    folder = tmp_path_factory.mktemp("wide")
    path = synthesize(WIDE, folder / "wide.powerinfer.gguf", "q4_0", Planting(density=0.1), profile_tokens=800,
                      train=FAST_TRAINING, progress=False).powerinfer
    bundled = folder / "wide.bundled.powerinfer.gguf"
    bundle_model(path, bundled, progress=False)
    return path, bundled


def _logits(model, tokens, prompt):
    caches = model.new_cache()
    out = [model.forward(tokens[:prompt], caches)]
    out += [model.forward(tokens[i : i + 1], caches) for i in range(prompt, len(tokens))]
    return np.concatenate(out)


@pytest.mark.parametrize("layout", [0, 1], ids=["split-layout", "bundled-layout"])
def test_half_the_file_in_memory_computes_what_the_whole_file_does(wide_model, layout):
    path = wide_model[layout]
    budget = os.path.getsize(wide_model[0]) // 2  # of PowerInfer's layout: the bundled file adds padding
    tokens = np.random.default_rng(0).integers(0, 4096, 48)
    reference = load_runtime_model(path, neuron_choice="predictor")  # as under a RAM budget (runtime.gate_choice)
    reference.mode = FFNMode.SPARSE
    model = load_runtime_model(path, ram=budget)
    model.mode = FFNMode.SPARSE
    assert model.compiled_decoder() is not None  # the one-token steps take the compiled path, cache and all
    np.testing.assert_allclose(_logits(model, tokens, 16), _logits(reference, tokens, 16), rtol=0, atol=1e-5)
    assert model.ram.resident_bytes <= budget
    held = {name: t.nbytes for name, t in open_model_file(path).tensors.items()
            if not any(f".{kind}" in name for kind in ("ffn_gate", "ffn_up", "ffn_down", "ffn_bundle"))}
    del held[tensor_name(MODEL_TENSOR.TOKEN_EMBD)]  # read a row a token instead
    assert model.ram.plan.dense_bytes == sum(held.values())
    stats = model.stats
    assert stats.cache_misses > 0 and stats.cache_hits > 0 and stats.disk_bytes > 0
    assert max(model.ram.plan.capacity) > 0 and min(len(p) for p in model.ram.plan.pinned) < WIDE.d_ff


def test_bundled_file_holds_the_same_rows(wide_model):
    source, bundled = (open_model_file(p) for p in wide_model)
    layout = BundleLayout.of_file(bundled)
    assert layout.stride == 256 and len(layout.parts) == 3  # 3 rows of 72 bytes, to a power of two
    for layer in range(WIDE.n_layers):
        stored = bundled[tensor_name(PowerInferTensor.FFN_BUNDLE, layer)]
        assert stored.offset % ALIGNMENT == 0
        for part in layout.parts:
            assert np.array_equal(layout.view(stored.data, part, WIDE.d_model), source[tensor_name(part.tensor, layer)].data)
    assert source.metadata.keys() <= bundled.metadata.keys()
    described = describe(bundled)  # `pitools inspect`: the same parameters, bundled or not
    assert described["bundled_ffn"] and described["total_parameters"] == describe(source)["total_parameters"]


def test_dense_mode_streams_the_ffn_through_a_small_cache(bundled_gguf):
    """The shipped model without predictors: every neuron every step, more than the cache holds (chunks)."""
    path = bundled_gguf("f32")  # float32 rows: no q8_0 encoding of inputs, whose rounding a chunked sum can flip
    model = load_runtime_model(path, ram=_dense_part(path) + 1024 * 1024)
    assert max(model.ram.plan.capacity) < model.spec.d_ff
    tokens = np.random.default_rng(1).integers(0, model.spec.vocab_size, 12)
    reference = load_runtime_model(path)
    # Dense steps under a cache take the general path (the compiled one computes one set of rows per
    # layer); compared with the same path unconstrained, only the chunks' summation order differs. (With
    # quantized rows that order can flip the q8_0 rounding of a later layer's input: ~1e-3 in the logits.)
    reference.compiled_decoding = False
    np.testing.assert_allclose(_logits(model, tokens, 8), _logits(reference, tokens, 8), rtol=0, atol=1e-5)
    assert model.stats.cache_misses > model.spec.d_ff * model.spec.n_layers  # re-read: it cannot hold them


def _dense_part(path) -> int:
    model = open_model_file(path)
    return sum(t.nbytes for name, t in model.tensors.items() if ".ffn_" not in name)


@pytest.mark.parametrize("which", ["synthetic, sparse", "shipped, dense"])
def test_run_with_ram_prints_the_same_text_and_its_memory(wide_model, bundled_gguf, which):
    if which == "synthetic, sparse":
        path, budget = wide_model[1], os.path.getsize(wide_model[0]) // 2
    else:
        path = bundled_gguf("f32")
        budget = _dense_part(path) + 1024 * 1024
    args = ["run", path, "-p", "def add(a, b):", "-n", "24", "--temp", "0"]
    plain, limited = invoke(*args), invoke(*args, "--ram", f"{budget}B")
    assert plain.exit_code == limited.exit_code == 0 and plain.stdout == limited.stdout
    assert "weights in memory" in limited.stderr and "cache hit rate" in limited.stderr


def test_a_model_truncated_under_the_cache_is_one_clear_error(wide_model, tmp_path):
    path = tmp_path / "m.powerinfer.gguf"
    shutil.copy(wide_model[1], path)
    model = load_runtime_model(path, ram=os.path.getsize(wide_model[0]) // 2)
    model.mode = FFNMode.SPARSE
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(PitoolsError, match=r"m\.powerinfer\.gguf.*truncated"):
        _logits(model, np.arange(40), 4)


def test_budgets_and_files_the_cache_cannot_serve(wide_model, bundled_gguf, tmp_path):
    path = wide_model[0]
    assert "give at least" in fails("run", path, "--ram", "100KiB", "-n", "1", match="too small for this model")
    model = load_runtime_model(path, ram=os.path.getsize(path) // 2)
    model.mode = FFNMode.ORACLE
    with pytest.raises(PitoolsError, match="oracle"):
        model.forward(np.arange(3), model.new_cache())
    fails("bundle", wide_model[1], "-o", tmp_path / "x.gguf", match="already in the bundled layout")
    fails("bundle", path, "-o", path, "--force", match="is the input")
    fails("run", bundled_gguf("q8_0").parent, "--ram", "1GB", match="no GPU split or RAM budget")


def test_the_least_ram_the_error_names_is_enough(bundled_gguf):
    """Its "give at least" figure, given back, runs: the figure is rounded up (for this file it had been rounded
    down to 8.79 MiB, which was then refused as too small)."""
    path = bundled_gguf("f32")
    least = fails("run", path, "--ram", "100KiB", "-n", "1", match="give at least").rsplit("give at least ", 1)[1]
    result = invoke("run", path, "--ram", least, "-n", "1", "-p", "def ")
    assert result.exit_code == 0, result.stderr


def test_perplexity_with_ram_matches(wide_model, tmp_path):
    corpus = tmp_path / "text.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    args = ["perplexity", wide_model[1], "--mode", "sparse", "--corpus", corpus, "--tokens", "200", "--json", "-q"]
    plain, limited = invoke(*args), invoke(*args, "--ram", f"{os.path.getsize(wide_model[0]) // 2}B")
    assert plain.exit_code == limited.exit_code == 0, limited.stderr
    assert json.loads(limited.stdout)["perplexity"] == pytest.approx(json.loads(plain.stdout)["perplexity"], rel=1e-4)


def test_a_split_solved_with_ram_decides_what_is_pinned(wide_model, tmp_path):
    path = tmp_path / "w.powerinfer.gguf"
    shutil.copy(wide_model[0], path)
    budget = os.path.getsize(path) * 3 // 5  # the solver's RAM holds the KV cache too: more than half the file
    assert invoke("solve", path, "--ram", f"{budget}B", "--ctx-size", "64").exit_code == 0
    split = read_gpu_split(default_split_path(path))
    model = LLM.load(path, ram=budget).engine
    for layer, pinned in enumerate(model.ram.plan.pinned):
        assert np.array_equal(pinned, np.flatnonzero(split.ram_masks[layer]))
    reference = load_runtime_model(path, use_split=False, neuron_choice="predictor")  # as under a RAM budget
    reference.mode = FFNMode.SPARSE
    tokens = np.arange(1, 30)
    np.testing.assert_allclose(_logits(model, tokens, 8), _logits(reference, tokens, 8), rtol=0, atol=1e-5)
    fails("run", path, "--ram", f"{budget * 9 // 10}B", match="solve again with this budget")
