"""The C allocator's settings for the runtime's arrays: memory a prompt's layer frees is kept for the next layer.

A prompt allocates and frees arrays of 0.3-30 MB at every step of every layer (a block's activations
``[T, d_ff]``, products, the block products' buffers). glibc's malloc serves such sizes from the heap once its
dynamic mmap threshold has risen, but gives the top of the heap back to the kernel whenever more than twice
that threshold is free there, so the next layer's arrays are fresh pages that the kernel zeroes on first touch.
A 128-token prompt of SmolLM2-135M's CATS file took ~30,000 page faults that way, a TinyLlama-shaped model's
~60,000 (none with the settings below, which make those prompts faster); Gemma 3 never met it:
its 262k-entry logits raise the threshold past every layer's arrays early on.
(``docs/lab/kernels.md``, "Page faults in prompts".)

So the runtime fixes the threshold at glibc's largest (arrays up to 32 MiB come from the heap) and keeps up
to ``KEPT_FREE`` at the heap's top. The peak RSS does not change (what a prompt allocates it uses, at its peak,
either way); memory freed after the peak is kept for the next prompt instead of going back to the kernel, as
llama.cpp keeps its compute buffers. Process-wide, set once; a C library without ``mallopt`` (macOS, some
musl builds) keeps its own behaviour.
"""

from __future__ import annotations

import ctypes
import functools

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
HEAP_ARRAYS_UP_TO = 32 << 20  # glibc's upper bound for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2)
KEPT_FREE = 256 << 20


@functools.cache
def keep_freed_memory() -> bool:
    """Set the allocator so, once per process; whether the C library took the settings."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # (mallopt returns 1 on success; setting either also stops glibc adjusting the other)
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_ARRAYS_UP_TO)) and bool(mallopt(M_TRIM_THRESHOLD, KEPT_FREE))
