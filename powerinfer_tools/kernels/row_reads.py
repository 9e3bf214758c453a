"""Reading scattered rows of a file into the arrays that hold them, compiled: a neuron cache's misses.

A token's misses under a tight RAM budget are tens of thousands of small direct reads (~29,000
of 8 KiB a token on the 7B shape), each row then cut into the matrices it feeds. In Python the bookkeeping
and the copies took as long as the disk (NumPy's fancy-indexed copy alone a large part of a token), and every read
held the GIL between system calls. Here ``plan_reads`` turns sorted neurons into aligned reads (a run of
rows whose aligned blocks touch is one read) and a table of row copies; ``read_rows`` does a share of the
reads with libc's ``pread`` and copies each read's rows into place, without the GIL, so that several
threads keep the disk's queue full while the caller computes.

A read table row is ``(file offset, length, position in the staging buffer, bytes needed)``; a copy row
``(position in the buffer, target matrix, target row, bytes)``, grouped by read
(``copy_start[k]`` .. ``copy_start[k+1]``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from powerinfer_tools.direct_io import ALIGNMENT
from powerinfer_tools.kernels.numba_cache import prepare_cache

PREAD = ctypes.cast(ctypes.CDLL(None).pread, ctypes.c_void_p).value  # ssize_t pread(int, void *, size_t, off_t)
_I32, _I64 = ir.IntType(32), ir.IntType(64)


@intrinsic
def _pread(typingctx, fn, fd, address, count, offset):
    """Call ``pread(fd, address, count, offset)`` at address ``fn``; the bytes read, or -1."""
    sig = types.int64(types.intp, types.intp, types.intp, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        fn_addr, fd_, buf, n, at = args
        ptr = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(_I64, [_I32, ptr, _I64, _I64])
        callee = builder.inttoptr(fn_addr, fnty.as_pointer())
        return builder.call(callee, [builder.trunc(fd_, _I32), builder.inttoptr(buf, ptr), n, at])

    return sig, codegen


@dataclass(frozen=True)
class ReadPlan:
    reads: np.ndarray  # int64 [k, 4]
    copies: np.ndarray  # int64 [c, 4]
    copy_start: np.ndarray  # int64 [k + 1]
    total: int  # staging bytes: the reads' lengths, each a multiple of ALIGNMENT

    def __len__(self) -> int:
        return len(self.reads)


def plan_reads(neurons: np.ndarray, sources, slots: np.ndarray, max_bytes: int) -> ReadPlan:
    """The reads and copies that bring sorted ``neurons``' rows from each of ``sources`` (``RowSource``:
    row n at ``base + n * stride``, ``nbytes`` of it read, cut into ``parts``) into row ``slots[i]`` of the
    target matrices; a read spans at most ``max_bytes`` (beyond one row's own)."""
    neurons, slots = np.asarray(neurons, np.int64), np.asarray(slots, np.int64)
    n_parts = sum(len(s.parts) for s in sources)
    reads = np.empty((len(neurons) * len(sources), 4), np.int64)
    copies = np.empty((len(neurons) * n_parts, 4), np.int64)
    copy_start = np.empty(len(reads) + 1, np.int64)
    k = c = total = 0
    for s in sources:
        parts = np.array(s.parts, np.int64).reshape(-1, 3)
        k, c, total = _plan_source(neurons, slots, s.base, s.stride, s.nbytes, parts, max_bytes // ALIGNMENT,
                                   reads, copies, copy_start, k, c, total)
    copy_start[k] = c
    return ReadPlan(reads[:k], copies[:c], copy_start[: k + 1], total)


@njit(cache=True)
def _plan_source(neurons, slots, base, stride, nbytes, parts, max_blocks, reads, copies, copy_start, k, c, at):
    """Append one source's reads and copies (after ``k`` reads, ``c`` copies and ``at`` staging bytes);
    returns the new counts. Rows join a read while their aligned blocks touch or overlap the read's (no
    whole block read in vain) and the read stays within ``max_blocks`` blocks."""
    i, n = 0, len(neurons)
    while i < n:
        start = base + neurons[i] * stride
        first_block, last_block = start // ALIGNMENT, (start + nbytes - 1) // ALIGNMENT
        j = i + 1
        while j < n:
            row = base + neurons[j] * stride
            end_block = (row + nbytes - 1) // ALIGNMENT
            if row // ALIGNMENT > last_block + 1 or end_block - first_block >= max_blocks:
                break
            last_block = end_block
            j += 1
        offset = first_block * ALIGNMENT
        length = (last_block + 1 - first_block) * ALIGNMENT
        reads[k, 0], reads[k, 1], reads[k, 2] = offset, length, at
        reads[k, 3] = base + neurons[j - 1] * stride + nbytes - offset
        copy_start[k] = c
        for r in range(i, j):
            row_at = at + base + neurons[r] * stride - offset
            for p in range(parts.shape[0]):
                copies[c, 0], copies[c, 1] = row_at + parts[p, 1], parts[p, 0]
                copies[c, 2], copies[c, 3] = slots[r], parts[p, 2]
                c += 1
        at += length
        k += 1
        i = j
    return k, c, at


@njit(nogil=True, cache=True)
def read_rows(fn, fd, buffer, reads, copies, copy_start, targets, got, first, step):
    """Do reads ``first``, ``first + step``, ... of the table into ``buffer`` with ``pread`` at ``fn`` and
    copy each read's rows into ``targets`` (a tuple of uint8 matrices); ``got[k]``: the bytes read (-1 on
    an error). A read that comes back short of its needed bytes copies nothing."""
    base = buffer.ctypes.data
    for k in range(first, reads.shape[0], step):
        offset, length, at, needed = reads[k, 0], reads[k, 1], reads[k, 2], reads[k, 3]
        got[k] = _pread(fn, fd, base + at, length, offset)
        if got[k] < needed:
            continue
        for c in range(copy_start[k], copy_start[k + 1]):
            src, matrix, row, nbytes = copies[c, 0], copies[c, 1], copies[c, 2], copies[c, 3]
            targets[matrix][row, :nbytes] = buffer[src : src + nbytes]


prepare_cache(globals())  # stale machine code flushed, the rest loaded without the compiler (kernels.numba_cache)
