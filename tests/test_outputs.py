"""What every command's outputs promise: never an input overwritten, nothing half-written on an
unwritable folder, Ctrl-C or SIGTERM, permissions from the umask, progress that reads well in a log."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cli_checks import fails, invoke
from gguf_fixtures import SMALL, make_model

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.fileio import atomic_output


@pytest.fixture(scope="module")
def model_file(small_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("outputs") / "m.powerinfer.gguf"
    result = invoke("convert", small_checkpoint, "-o", path, "--no-sparsity", "-q")
    assert result.exit_code == 0, result.stderr
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_convert_refuses_an_output_that_is_one_of_its_inputs(small_checkpoint, force):
    weights = small_checkpoint / "model.safetensors"
    before = digest(weights)
    fails("convert", small_checkpoint, "-o", weights, "--no-sparsity", "-q", *force, match="is the input")
    assert digest(weights) == before


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_solve_refuses_to_write_the_split_onto_the_model(model_file, force):
    before = digest(model_file)
    fails("solve", model_file, "--vram", "1MB", "--reserve", "0B", "-o", model_file, *force, match="is the input")
    assert digest(model_file) == before


def test_an_input_reached_through_a_symlink_is_still_an_input(model_file, tmp_path):
    link = tmp_path / "link.gguf"
    link.symlink_to(model_file)
    fails("solve", model_file, "--vram", "1MB", "--reserve", "0B", "-o", link, "--force", match="is the input")


def test_an_output_folder_that_cannot_be_written_is_one_error_line(small_checkpoint, tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    fails("convert", small_checkpoint, "-o", not_a_folder / "m.gguf", "--no-sparsity", "-q", match="cannot write output")
    stats = tmp_path / "stats.npz"
    np.savez(stats, freqs=np.full((2, 64), 0.1), neuron_bytes=96, dense_bytes=4096, predictor_bytes=0,
             kv_bytes_per_token=128, head_bytes=8192, hidden_bytes=128)
    fails("solve", "--stats", stats, "--vram", "1MB", "--reserve", "0B", "-o", not_a_folder / "m.gpuidx",
          match="cannot write output")


def test_a_denied_temporary_file_is_one_error(tmp_path, monkeypatch):
    # Root ignores folder permissions, so the refusal a user sees on a read-only folder is simulated.
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(PitoolsError, match="cannot write output: Permission denied"):
        with atomic_output(tmp_path / "out.bin"):
            pass


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_outputs_get_the_permissions_of_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        with atomic_output(tmp_path / "out.bin") as tmp:
            tmp.write_bytes(b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "out.bin").stat().st_mode & 0o777 == 0o666 & ~umask


def test_an_interrupt_just_after_the_temporary_file_is_made_removes_it(tmp_path, monkeypatch):
    """The window the signal test below hit now and then, made certain: Ctrl-C lands the moment the
    temporary file exists, before the call that created it has returned."""
    create = os.open

    def open_then_interrupt(*args, **kwargs):
        fd = create(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return fd

    monkeypatch.setattr(os, "open", open_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        with atomic_output(tmp_path / "out.bin") as tmp:
            tmp.write_bytes(b"x")
    assert list(tmp_path.iterdir()) == []


def _pitools(*args: str, cwd: Path) -> subprocess.Popen:
    code = "import sys; from powerinfer_tools.commands.cli import main; sys.argv[0] = 'pitools'; main()"
    # Bytes, not text: text mode would translate the carriage returns a progress bar writes.
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_writing_leaves_no_temporary_file(small_checkpoint, tmp_path, signum):
    out = tmp_path / "out"
    out.mkdir()
    # f32 output of a model with a large vocabulary: writing takes long enough to be caught midway.
    big = tmp_path / "big"
    make_model(big, "llama", extra_vocab=60000, **SMALL)
    process = _pitools("convert", str(big), "-o", str(out / "m.gguf"), "--no-sparsity", "--outtype", "f32",
                       cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not list(out.glob(".m.gguf.*")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert process.poll() is None, "the conversion ended before it could be interrupted"
    process.send_signal(signum)
    stderr = process.communicate(timeout=60)[1].decode()
    assert process.returncode == 128 + signum, stderr
    assert stderr.strip().splitlines()[-1] == "pitools: error: interrupted", stderr
    assert "Traceback" not in stderr and "Aborted" not in stderr, stderr
    assert list(out.iterdir()) == []


def test_progress_on_a_pipe_is_one_line_per_stage(small_checkpoint, tmp_path):
    process = _pitools("convert", str(small_checkpoint), "-o", str(tmp_path / "m.gguf"), "--no-sparsity", cwd=tmp_path)
    stderr = process.communicate(timeout=300)[1].decode()
    assert process.returncode == 0, stderr
    assert "\r" not in stderr, stderr
    assert any(line.startswith("wrote ") for line in stderr.splitlines()), stderr


def test_profiling_and_training_on_a_pipe_print_lines_not_bars(small_checkpoint, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 600)
    steps = [("profile", str(small_checkpoint), "--corpus", str(corpus), "--tokens", "2048", "--seq-len", "32",
              "-o", str(tmp_path / "profile")),
             ("train-predictors", str(tmp_path / "profile"), "-o", str(tmp_path / "predictors"), "--epochs", "1",
              "--budget", "0.5")]
    for step, stage in zip(steps, ("profile: ", "predictors: ")):
        stderr = _pitools(*step, cwd=tmp_path).communicate(timeout=300)[1].decode()
        assert "\r" not in stderr, stderr
        assert stderr.splitlines()[0].startswith(stage), stderr
