"""What every command's outputs promise: never an input overwritten, nothing half-written on an
unwritable folder, Ctrl-C or SIGTERM, permissions from the umask, progress that reads well in a log."""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cli_checks import fails, invoke
from gguf_fixtures import SMALL, make_model

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.fileio import atomic_output, remove_stale_temporaries


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
    fails("convert", small_checkpoint, "-o", not_a_folder / "m.gguf", "--no-sparsity", "-q", match="is not a folder")
    stats = tmp_path / "stats.npz"
    np.savez(stats, freqs=np.full((2, 64), 0.1), neuron_bytes=96, dense_bytes=4096, predictor_bytes=0,
             kv_bytes_per_token=128, head_bytes=8192, hidden_bytes=128)
    fails("solve", "--stats", stats, "--vram", "1MB", "--reserve", "0B", "-o", not_a_folder / "m.gpuidx",
          match="is not a folder")


def test_a_denied_temporary_file_is_one_error(tmp_path, monkeypatch):
    # Root ignores folder permissions, so the refusal a user sees on a read-only folder is simulated.
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(PitoolsError, match="cannot write output: Permission denied"):
        with atomic_output(tmp_path / "out.bin", overwrite=False):
            pass


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_outputs_get_the_permissions_of_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        with atomic_output(tmp_path / "out.bin", overwrite=False) as tmp:
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
    # Ctrl-C's handler, as in a terminal: a suite run in the background has SIGINT ignored (_default_signals).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with atomic_output(tmp_path / "out.bin", overwrite=False) as tmp:
                tmp.write_bytes(b"x")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert list(tmp_path.iterdir()) == []


def _default_signals() -> None:
    """In the child, before Python starts: Ctrl-C as a terminal delivers it. A suite run in the background
    (``pytest &`` in a script, nohup) has SIGINT ignored, the child inherits that, and Python then installs
    no KeyboardInterrupt handler: the signal would do nothing, as the shell meant for background jobs."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _pitools(*args: str, cwd: Path) -> subprocess.Popen:
    code = "import sys; from powerinfer_tools.commands.cli import main; sys.argv[0] = 'pitools'; main()"
    # Bytes, not text: text mode would translate the carriage returns a progress bar writes.
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=_default_signals)


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


# --- outputs that are not regular files, missing folders, races, stale temporary files ---------------


def _private_device(folder: Path) -> Path:
    """A character device node of the test's own (the null device's numbers), never a real one; a FIFO where
    this process may not make device nodes (not root)."""
    node = folder / "node"
    try:
        os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        os.mkfifo(node)
    return node


def _special_outputs(tmp_path: Path) -> dict[str, Path]:
    fifo, link = tmp_path / "fifo", tmp_path / "link"
    os.mkfifo(fifo)
    device = _private_device(tmp_path)
    link.symlink_to(device)
    return {"fifo": fifo, "device": device, "link to a device": link}


def _kind(path: Path) -> tuple[int, int]:
    return stat.S_IFMT(path.lstat().st_mode), path.lstat().st_rdev


@pytest.mark.parametrize("which", ["fifo", "device", "link to a device"])  # a folder is click's usage error
def test_no_command_replaces_an_output_that_is_not_a_regular_file(model_file, small_checkpoint, tmp_path, which):
    target = _special_outputs(tmp_path)[which]
    before = _kind(target)
    commands = [("convert", small_checkpoint, "--dense", "-q"), ("solve", model_file, "--vram", "1MB", "--reserve", "0B"),
                ("probe", "--size", "4MiB", "--repeats", "1")]
    for command in commands:
        fails(*command, "-o", target, "--force", match="not a regular file", names=target)
        assert _kind(target) == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("overwrite", [False, True])
def test_the_final_move_never_replaces_a_special_file_made_during_the_work(tmp_path, overwrite):
    """The output path was free when the command checked it, and became a FIFO while it worked."""
    out = tmp_path / "out.bin"
    with pytest.raises(PitoolsError, match="not a regular file" if overwrite else "output exists"):
        with atomic_output(out, overwrite=overwrite) as tmp:
            tmp.write_bytes(b"x")
            os.mkfifo(out)
    assert stat.S_ISFIFO(out.lstat().st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_an_output_in_a_missing_folder_is_refused_and_no_folder_made(model_file, small_checkpoint, tmp_path):
    missing = tmp_path / "missing" / "deeper"
    fails("convert", small_checkpoint, "--dense", "-q", "-o", missing / "m.gguf", match="does not exist", names=missing)
    fails("solve", model_file, "--vram", "1MB", "--reserve", "0B", "-o", missing / "m.gpuidx", match="does not exist")
    fails("profile", small_checkpoint, "-o", missing / "profile", match="does not exist")
    assert list(tmp_path.iterdir()) == []


def test_an_output_folder_that_is_a_special_file_is_refused(small_checkpoint, tmp_path):
    taken = tmp_path / "profile"
    os.mkfifo(taken)  # (a regular file is click's usage error: '-o' is a folder option)
    fails("profile", small_checkpoint, "-o", taken, match="not a folder", names=taken)
    fails("train-predictors", tmp_path, "-o", taken, match="not a folder", names=taken)


def test_of_two_runs_writing_one_new_output_the_second_fails_rather_than_replace_the_first(tmp_path):
    out = tmp_path / "out.bin"
    with pytest.raises(PitoolsError, match="output exists"):
        with atomic_output(out, overwrite=False) as first:
            first.write_bytes(b"first run")
            with atomic_output(out, overwrite=False) as second:  # a second run, started later, ends first
                second.write_bytes(b"second run")
    assert out.read_bytes() == b"second run"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def _writer_killed_while_writing(out: Path) -> Path:
    """A process that writes ``out`` through atomic_output, killed with SIGKILL midway; its temporary file."""
    code = ("import sys, time; from pathlib import Path; from powerinfer_tools.fileio import atomic_output\n"
            "with atomic_output(Path(sys.argv[1]), overwrite=False) as tmp:\n"
            "    tmp.write_bytes(b'half'); print(tmp, flush=True); time.sleep(600)\n")
    writer = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    tmp = Path(writer.stdout.readline().strip())
    writer.kill()
    writer.wait(timeout=60)
    writer.stdout.close()
    return tmp


def test_a_temporary_file_left_by_a_killed_run_is_removed_by_the_next(tmp_path):
    out = tmp_path / "out.bin"
    stale = _writer_killed_while_writing(out)
    assert stale.parent == tmp_path and stale.read_bytes() == b"half"
    old = time.time() - 60
    os.utime(stale, (old, old))
    with atomic_output(out, overwrite=False) as tmp:
        tmp.write_bytes(b"done")
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_a_temporary_file_being_written_is_left_alone(tmp_path):
    out = tmp_path / "out.bin"
    with atomic_output(out, overwrite=False) as live:  # held by this run, however old it looks
        live.write_bytes(b"half")
        old = time.time() - 60
        os.utime(live, (old, old))
        assert remove_stale_temporaries(out) == []
        assert live.exists()
    assert out.read_bytes() == b"half"
