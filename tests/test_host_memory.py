"""The runtime's allocator settings (``runtime/host_memory.py``): a prompt's layers reuse the memory the last one
freed instead of faulting in fresh pages."""

import platform
import subprocess
import sys

import pytest

# A prompt layer's pattern of allocations at SmolLM2's widths (128 tokens): activations [T, d_ff], a product of
# two, the block products' buffers; each of 30 layers frees what it made. Prints the page faults of the layers.
LAYERS = """
import resource, sys
import numpy as np
if sys.argv[1] == "kept":
    from powerinfer_tools.runtime.backends import CpuBackend
    CpuBackend()  # what every runtime model's host is made with

def layer():
    gate, up = np.ones((128, 1536), np.float32), np.ones((128, 1536), np.float32)
    activated = gate * up
    del gate, up
    buffers = np.ones((2, 512, 576), np.float32)
    out = activated[:, :576] + buffers[0, :128]
    del activated, buffers
    return out

layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    layer()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(setting: str) -> int:
    run = subprocess.run([sys.executable, "-c", LAYERS, setting], capture_output=True, text=True, check=True)
    return int(run.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's mallopt")
def test_a_runtime_host_keeps_freed_memory_for_the_next_layer():
    default, kept = _page_faults("default"), _page_faults("kept")
    # glibc's own settings: each layer's arrays are fresh pages (30 layers x ~4.5 MB: ~33,000 faults here)
    assert default > 10_000, "the pattern no longer makes glibc give memory back: the test shows nothing"
    assert kept < default / 100, (kept, default)


def test_keep_freed_memory_is_set_once_and_says_whether_it_took():
    from powerinfer_tools.runtime.host_memory import keep_freed_memory

    took = keep_freed_memory()
    assert took is keep_freed_memory()
    if platform.libc_ver()[0] == "glibc":
        assert took
