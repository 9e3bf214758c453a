"""What a loaded model keeps of its file's memory map in the process: nothing once it is loaded, and at run time
only what it reads in place (``runtime/loader.py``, ``_release_mapped_pages``)."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from powerinfer_tools.runtime.loader import load_runtime_model

pytestmark = pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="reads Linux's /proc/self/pagemap")


def _mappings(model_path: Path) -> set[tuple[int, int]]:
    """This process's mappings of ``model_path``, as (first page, end page) numbers."""
    found = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[5] == str(model_path):
            start, end = (int(address, 16) // mmap.PAGESIZE for address in fields[0].split("-"))
            found.add((start, end))
    return found


def _resident_pages(mappings: set[tuple[int, int]]) -> int:
    """Pages of ``mappings`` that are present in this process's page tables."""
    present = 0
    with open("/proc/self/pagemap", "rb") as pagemap:
        for start, end in mappings:
            pagemap.seek(start * 8)
            entries = np.frombuffer(pagemap.read((end - start) * 8), np.uint64)
            present += int((entries >> np.uint64(63)).sum())  # bit 63: the page is present
    return present


def test_a_loaded_model_holds_no_page_of_its_file_until_it_reads_one(synthesized_tiny):
    path = synthesized_tiny.dense.resolve()
    earlier = _mappings(path)  # an earlier test's model of the same file, still alive, is not this one's
    model = load_runtime_model(path, use_split=False)
    own = _mappings(path) - earlier
    assert own, "the model maps its file"
    # Loading read the header and every matrix it copied; a whole page of each copied matrix was dropped after
    # its copy, but pages shared with a neighbour, and the header's, had stayed.
    assert _resident_pages(own) == 0
    model.forward(np.arange(1, 9), model.new_cache(), all_logits=False)
    assert _resident_pages(own) > 0  # the head and embedding rows are read in place: the measure sees pages


def test_norms_are_read_from_memory_of_the_runtimes_own(synthesized_tiny):
    """A norm read in place at every step would bring back the large folio of the page cache around it (2 MiB on
    ext4 under Linux 6.18), most of it neighbouring matrices already copied: 64 MiB at the TinyLlama shape."""
    model = load_runtime_model(synthesized_tiny.dense, use_split=False)
    norms = [norm for layer in model.layers for norm in (layer.dense.attn_norm, layer.dense.ffn_norm)]
    for array in [norm.weight for norm in norms] + [model.output_norm.weight]:
        base = array
        while base is not None and not isinstance(base, mmap.mmap):
            base = getattr(base, "base", None)
        assert base is None, "a norm's weights are a view of the file's memory map"
