"""llama.cpp's own checkpoint converter (``convert_hf_to_gguf.py``): an oracle no one here wrote.

It turns a Hugging Face checkpoint folder into the GGUF file a user would download. It is not in
llama-cpp-python's wheel, only in its source distribution (the vendored llama.cpp), so the sdist of the
installed llama-cpp-python (the llama.cpp that runs the files is the one that wrote them) is fetched
from the package registry once, with ``pip download``, into ``CACHE``, and only the converter is kept:
the script, its ``conversion`` package and the ``gguf`` package it brings along (``gguf-py``; the script
puts it ahead of the installed ``gguf``), with llama.cpp's licence. It runs in a subprocess of this
Python (torch, transformers, sentencepiece: the ``test`` extra).

A registry that cannot be reached is ``ConverterUnavailable``, which tests turn into a skip; a
converter that fails on a checkpoint is a plain ``RuntimeError``, a failing test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

CACHE = Path.home() / ".cache" / "pitools-tests"
# What the converter needs of the vendored llama.cpp, as paths under it ("x/" is a folder).
KEPT = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/", "LICENSE")
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # those of the converter's --outtype that name one type


class ConverterUnavailable(Exception):
    """llama.cpp's converter could not be fetched (no package registry, say)."""


def llama_cpp_version() -> str:
    return metadata.version("llama_cpp_python")


def converter_folder(cache: Path = CACHE) -> Path:
    """The folder that holds ``convert_hf_to_gguf.py`` of the installed llama-cpp-python's version, fetched
    into ``cache`` unless it is there already."""
    version = llama_cpp_version()
    target = Path(cache).expanduser() / f"llama-cpp-converter-{version}"
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        sdist = _download_sdist(version, Path(tmp))
        unpacked = Path(tmp) / "converter"
        _extract_converter(sdist, unpacked)
        try:
            unpacked.rename(target)  # whole or not at all: a folder is complete once it has its name
        except OSError:
            if not (target / "convert_hf_to_gguf.py").is_file():  # not another process's finished copy
                raise
    return target


def _download_sdist(version: str, folder: Path) -> Path:
    requirement = f"llama-cpp-python=={version}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
               "--dest", str(folder), requirement]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    found = list(folder.glob("llama_cpp_python-*.tar.gz"))
    if done.returncode != 0 or len(found) != 1:
        last = (done.stderr.strip().splitlines() or ["no source distribution downloaded"])[-1]
        raise ConverterUnavailable(f"cannot download {requirement}'s source from the package registry ({last})")
    return found[0]


def _extract_converter(sdist: Path, folder: Path) -> None:
    """The members of ``KEPT`` (under the sdist's vendor/llama.cpp/) written into ``folder``."""
    prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
    with tarfile.open(sdist) as archive:
        members = []
        for member in archive:
            path = member.name.removeprefix(prefix)
            kept = any(path == k or (k.endswith("/") and path.startswith(k)) for k in KEPT)
            if member.name.startswith(prefix) and kept:
                member.name = path
                members.append(member)
        archive.extractall(folder, members=members, filter="data")
    missing = [k for k in KEPT if not (folder / k).exists()]
    if missing:
        raise RuntimeError(f"{sdist.name}: no {', '.join(missing)} under {prefix}")


def convert_checkpoint(checkpoint: Path, out: Path, outtype: str = "f32", cache: Path = CACHE) -> Path:
    """``checkpoint`` (a Hugging Face folder) written to ``out`` by llama.cpp's converter, its weights in
    ``outtype`` (one of ``OUTTYPES``; norms and other 1-D tensors stay f32, as the converter decides)."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r} is not one of {OUTTYPES}")
    script = converter_folder(cache) / "convert_hf_to_gguf.py"
    command = [sys.executable, str(script), str(checkpoint), "--outfile", str(out), "--outtype", outtype]
    # Nothing from the Hugging Face hub: the checkpoint and its tokenizer are local.
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run(command, check=False, capture_output=True, text=True, env=env)
    if done.returncode != 0 or not Path(out).is_file():
        raise RuntimeError(f"llama.cpp's converter failed on {checkpoint} (exit {done.returncode}):\n"
                           + "\n".join(done.stderr.strip().splitlines()[-20:]))
    return Path(out)

