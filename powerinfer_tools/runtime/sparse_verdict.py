"""Whether sparse FFNs pay on this machine for a model file: ``--mode auto`` (the default) runs sparse only
where a decoded token takes less time sparse than dense, and dense otherwise, and says so.

Whether skipping neurons pays depends on the machine as much as on the file: a SiLU model's CATS reads every gate
row to choose and then scattered rows of up and down, which on a small model or a CPU whose gather of rows is slow
can cost more than the dense path's contiguous products (SmolLM2-135M at 50% decodes slower sparse than dense:
docs/lab/real-models.md). Bytes alone cannot tell: the kernels' efficiency differs by layout. So it is measured: the
loaded model decodes a short English text greedily in both modes, alternating modes by short blocks of steps so that
other load on the machine falls on both alike, and the medians are compared: sparse runs where it is at least
``MIN_GAIN`` times as fast.
The verdict is kept in the kernel cache folder (``warmup.marker_folder``), keyed by the file's fingerprint,
the load options, the thread count, this CPU and the kernels' sources (``warmup.warm_key``), so it is taken
once; ``--mode sparse`` or ``dense`` skips it. It is not taken on the NumPy reference kernels (a
background build under way): their speeds say nothing about the compiled ones.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from powerinfer_tools.fileio import write_json
from powerinfer_tools.interfaces import FFNMode
from powerinfer_tools.runtime import warmup
from powerinfer_tools.runtime.engine import TokenStats

STEPS = 16  # decoded tokens timed in each mode
# The modes alternate by blocks of this many timed steps, each block after one untimed step: a step right after the
# other mode's is slower (sparse most: its scattered rows find the caches and TLB holding dense's), which
# alternating step by step would time at every step, where decoding in one mode never pays it.
BLOCK = 4
# A prompt token, then the steps, each adding one position: a smaller context window cannot be measured.
MIN_CONTEXT = STEPS + STEPS // BLOCK + 1
# Sparse runs only where it decodes at least this much faster: a smaller gain is within the measurement's
# noise on a shared machine, and not worth sparsity's quality cost.
MIN_GAIN = 1.05
TEXT = ("The river town grew slowly through the nineteenth century, as merchants built warehouses along the "
        "docks and farmers brought their grain to market")


@dataclass(frozen=True)
class Verdict:
    sparse_step_s: float  # median seconds per decoded token, sparse
    dense_step_s: float  # and dense

    @property
    def speedup(self) -> float:
        """Sparse decoding's tokens per second over dense's."""
        return self.dense_step_s / self.sparse_step_s

    @property
    def pays(self) -> bool:
        return self.sparse_step_s * MIN_GAIN <= self.dense_step_s

    def describe(self) -> str:
        """``sparse <ratio>x dense's decoding speed here``: the ratio of tokens per second."""
        return f"sparse {self.speedup:.2f}x dense's decoding speed here"


def can_measure(model) -> bool:
    """Whether ``model``'s context window leaves room for ``measure``'s steps."""
    return model.context_size >= MIN_CONTEXT


def verdict(model, tokenizer, options: warmup.LoadOptions, threads: int, notice=None) -> Verdict:
    """The verdict for ``model`` (a loaded ``RuntimeModel`` that can run sparse, ``can_measure``) as loaded with
    ``options`` on ``threads`` threads: kept from an earlier run, or measured now (saying so through
    ``notice``) and kept."""
    key = warmup.warm_key({"file": model.fingerprint, "threads": threads, "steps": [STEPS, BLOCK]}, options)
    kept = warmup.marker_folder() / f"pitools-sparse-{key}.json"
    try:
        return Verdict(**json.loads(kept.read_text()))
    except (OSError, ValueError, TypeError):  # none yet (or unreadable): measure it again
        pass
    if notice is not None:
        notice("measuring whether sparse FFNs pay on this machine for this model (once)")
    found = measure(model, tokenizer.encode(TEXT))
    kept.parent.mkdir(parents=True, exist_ok=True)
    write_json(kept, asdict(found))
    return found


def measure(model, prompt: list[int]) -> Verdict:
    """Median time per decoded token of ``model`` sparse and dense, each greedily continuing ``prompt`` (cut to
    leave room in the context window) in its own KV cache, the modes alternating by blocks (``BLOCK``), in the
    order sparse, dense, dense, sparse, ... The model's mode and statistics are as they were afterwards."""
    prompt = np.asarray(prompt[: max(1, model.context_size - MIN_CONTEXT)], dtype=np.int64)
    saved = model.mode, model.stats
    model.stats = TokenStats()  # (forward adds to it) this run's figures are not the user's
    times: dict[FFNMode, list[float]] = {FFNMode.SPARSE: [], FFNMode.DENSE: []}
    caches, last = {}, {}
    try:
        for mode in times:
            model.mode = mode
            caches[mode] = model.new_cache()
            last[mode] = int(np.argmax(model.forward(prompt, caches[mode], all_logits=False)[-1]))
        blocks = STEPS // BLOCK
        for block in range(2 * blocks):
            model.mode = mode = (FFNMode.SPARSE, FFNMode.DENSE)[(block + block // 2) % 2]
            for step in range(BLOCK + 1):
                start = time.perf_counter()
                logits = model.forward(np.array([last[mode]]), caches[mode], all_logits=False)
                if step:  # the block's first step pays for the switch
                    times[mode].append(time.perf_counter() - start)
                last[mode] = int(np.argmax(logits[-1]))
    finally:
        model.mode, model.stats = saved
    return Verdict(statistics.median(times[FFNMode.SPARSE]), statistics.median(times[FFNMode.DENSE]))
