"""Reading a file past the operating system's page cache, as a disk delivers it.

`pitools probe --disk` measures a disk with these reads, and a memory budget (the neuron
cache's) is only honest if the bytes it reads do not also sit in the page cache. ``O_DIRECT`` does
both: the read goes from the device into the caller's buffer. It needs the buffer, the offset and
the length aligned to the device's logical block size (4096 covers every common device), so buffers
come from ``aligned_buffer``. Some filesystems refuse ``O_DIRECT`` (tmpfs, some network and overlay
filesystems); there the file is opened normally and its cached pages are dropped before each timed
pass (``forget_cached``), and ``DirectReader.direct`` says which happened.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path
from typing import Self

from powerinfer_tools.errors import PitoolsError

ALIGNMENT = 4096  # offsets, lengths and buffer addresses of direct reads are multiples of this
_READ_CHUNK = 1 << 30


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A zeroed, page-aligned buffer of ``nbytes`` rounded up to ``ALIGNMENT`` (anonymous memory)."""
    return mmap.mmap(-1, max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT))


class DirectReader:
    """A file opened for reads that bypass the page cache where the filesystem allows it."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            self.direct = True
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this filesystem has no direct I/O
                raise PitoolsError(f"{self.path}: cannot open: {exc.strerror}") from exc
            self._fd = os.open(self.path, os.O_RDONLY)
            self.direct = False
        self.size = os.fstat(self._fd).st_size

    @property
    def fileno(self) -> int:
        """The descriptor, for compiled readers (``kernels.row_reads``)."""
        return self._fd

    def read_into(self, buffer, offset: int) -> int:
        """Fill ``buffer`` (from ``aligned_buffer``; its length a multiple of ``ALIGNMENT``) from
        ``offset`` (a multiple of ``ALIGNMENT``); the byte count read, short at the end of the file."""
        try:
            return os.preadv(self._fd, [buffer], offset)
        except OSError as exc:
            raise PitoolsError(f"{self.path}: read of {len(buffer)} bytes at {offset} failed: {exc.strerror}") from exc

    def read_range(self, offset: int, nbytes: int) -> memoryview:
        """Bytes ``offset .. offset+nbytes`` of the file, at any alignment, in a new anonymous buffer (the
        aligned span around them is read; the view starts at ``offset``)."""
        start = offset // ALIGNMENT * ALIGNMENT
        view = memoryview(aligned_buffer(offset + nbytes - start))
        for at in range(0, offset + nbytes - start, _READ_CHUNK):  # one read() returns at most ~2 GiB
            chunk = view[at : at + _READ_CHUNK]
            if self.read_into(chunk, start + at) < min(len(chunk), offset + nbytes - start - at):
                raise PitoolsError(f"{self.path}: file ends before byte {offset + nbytes}: truncated")
        return view[offset - start : offset - start + nbytes]

    def forget_cached(self) -> None:
        """Drop this file's pages from the page cache (what a direct read never puts there)."""
        if not self.direct:
            _drop_cached(self._fd)

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def forget_cached_pages(path: str | os.PathLike) -> None:
    """Drop ``path``'s clean pages from the page cache: the next reader gets them from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _drop_cached(fd)
    finally:
        os.close(fd)


def _drop_cached(fd: int) -> None:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
