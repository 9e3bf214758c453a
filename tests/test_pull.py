"""`pitools pull`: local folders, download-pattern selection, hub failures as one line, offline cache."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import huggingface_hub.hf_api
import pytest
from click.testing import CliRunner

from powerinfer_tools.checkpoints.hub import download_patterns, resolve_checkpoint
from powerinfer_tools.commands.cli import cli
from powerinfer_tools.errors import PitoolsError

REPO = "pitools-test/tiny-relu"
# RFC 2606: names under .invalid never resolve, so no test here can reach a real hub.
UNREACHABLE = "https://pitools-no-such-host.invalid"


@pytest.fixture(autouse=True)
def _hub_env(monkeypatch, tmp_path):
    """Every test runs with a private, empty HF cache, online mode and an unreachable endpoint."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_ETAG_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_ENDPOINT", UNREACHABLE)


def run_pull(*args: str):
    return CliRunner().invoke(cli, ["pull", *args])


def error_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("pitools: error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def make_checkpoint(folder: Path, weights: str = "model.safetensors") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / weights).write_bytes(b"\0" * 8)
    return folder


# --- local folders --------------------------------------------------------------------------


def test_local_folder_is_returned_unchanged(tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt")
    assert resolve_checkpoint(str(folder)) == folder
    result = run_pull(str(folder))
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"{folder}\n"


def test_relative_folder_that_exists_is_local(tmp_path, monkeypatch):
    make_checkpoint(tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    # "ckpt" would also be a valid hub id; it exists, so it is the folder.
    assert resolve_checkpoint("ckpt") == Path("ckpt")


def test_missing_folder_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope"
    result = run_pull(str(missing))
    assert result.exit_code == 1
    line = error_line(result)
    assert str(missing) in line and "no such folder" in line
    assert "Traceback" not in result.output
    with pytest.raises(PitoolsError, match="no such folder"):
        resolve_checkpoint("./definitely-not-here")


def test_folder_without_config_json_is_a_clear_error(tmp_path):
    folder = tmp_path / "weights-only"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    result = run_pull(str(folder))
    assert result.exit_code == 1
    line = error_line(result)
    assert str(folder) in line and "config.json" in line


def test_file_instead_of_folder_is_a_clear_error(tmp_path):
    make_checkpoint(tmp_path / "ckpt")
    with pytest.raises(PitoolsError, match="not a folder"):
        resolve_checkpoint(str(tmp_path / "ckpt" / "config.json"))


def test_revision_with_a_local_folder_is_refused(tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt")
    with pytest.raises(PitoolsError, match="hub ids"):
        resolve_checkpoint(str(folder), revision="main")


def test_invalid_hub_id_is_a_clear_error():
    result = run_pull("a/b/c")
    assert result.exit_code == 1
    line = error_line(result)
    assert "'a/b/c' is neither an existing folder nor a valid Hugging Face repository id" in line


# --- which files are downloaded ---------------------------------------------------------------

TOKENIZER = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"]


def _selected(files: list[str]) -> set[str]:
    """The files of ``files`` that huggingface_hub would download under download_patterns(files)."""
    from huggingface_hub.utils import filter_repo_objects

    allow, ignore = download_patterns(files)
    return set(filter_repo_objects(files, allow_patterns=allow, ignore_patterns=ignore))


def test_safetensors_present_means_no_bin():
    files = [
        "config.json", "generation_config.json", *TOKENIZER, "README.md", ".gitattributes",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
        "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json",
        "onnx/model.onnx", "original/consolidated.00.pth", "flax_model.msgpack", "tf_model.h5",
    ]
    allow, _ = download_patterns(files)
    assert "*.safetensors" in allow and "*.bin" not in allow
    assert _selected(files) == {
        "config.json", "generation_config.json", *TOKENIZER,
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
    }


def test_only_bin_means_bin():
    files = ["config.json", "vocab.json", "merges.txt", "pytorch_model.bin", "README.md", "tf_model.h5"]
    allow, _ = download_patterns(files)
    assert "*.bin" in allow and "pytorch_model.bin.index.json" in allow
    assert _selected(files) == {"config.json", "vocab.json", "merges.txt", "pytorch_model.bin"}


def test_sharded_bin_index_is_fetched():
    files = ["config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
             "pytorch_model.bin.index.json"]
    assert _selected(files) == set(files)


def test_safetensors_only_in_a_subfolder_do_not_count():
    files = ["config.json", "pytorch_model.bin", "onnx/model.safetensors"]
    assert _selected(files) == {"config.json", "pytorch_model.bin"}


def test_mistral_consolidated_copy_is_skipped():
    files = ["config.json", "consolidated.safetensors", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "model.safetensors.index.json", "params.json"]
    assert "consolidated.safetensors" not in _selected(files)
    # ... but kept when it is the only copy of the weights.
    assert "consolidated.safetensors" in _selected(["config.json", "consolidated.safetensors"])


# --- the download path, up to the network boundary ---------------------------------------------


class FakeApi:
    files: list[str] = []
    calls: list[dict] = []

    def __init__(self, endpoint=None, **kwargs):
        self.endpoint = endpoint

    def model_info(self, repo_id, revision=None, timeout=None, **kwargs):
        FakeApi.calls.append({"repo_id": repo_id, "revision": revision, "timeout": timeout})
        return SimpleNamespace(siblings=[SimpleNamespace(rfilename=f) for f in FakeApi.files], sha="0" * 40)


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """Replace the listing and the download; the fake download writes what it was allowed to."""
    recorded: dict = {}
    FakeApi.calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        from huggingface_hub.utils import filter_repo_objects

        recorded.update(kwargs, repo_id=repo_id)
        target = Path(kwargs["local_dir"]) if kwargs.get("local_dir") else tmp_path / "snapshot"
        wanted = filter_repo_objects(FakeApi.files, allow_patterns=kwargs["allow_patterns"],
                                     ignore_patterns=kwargs.get("ignore_patterns"))
        for name in wanted:
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            (target / name).write_text("x")
        return str(target)

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    return recorded


def test_download_passes_patterns_revision_and_local_dir(fake_hub, tmp_path):
    FakeApi.files = ["config.json", "tokenizer.json", "model.safetensors", "pytorch_model.bin", "README.md"]
    local = tmp_path / "dl"
    result = run_pull(REPO, "--revision", "v1.0", "--local-dir", str(local))
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"{local}\n"  # only the path on stdout
    assert REPO in result.stderr  # progress on stderr
    assert FakeApi.calls == [{"repo_id": REPO, "revision": "v1.0", "timeout": 10.0}]
    assert fake_hub["repo_id"] == REPO
    assert fake_hub["revision"] == "v1.0"
    assert Path(fake_hub["local_dir"]) == local
    assert "*.safetensors" in fake_hub["allow_patterns"]
    assert "*.bin" not in fake_hub["allow_patterns"]
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= set(fake_hub["allow_patterns"])
    assert fake_hub.get("local_files_only", False) is False
    assert fake_hub["cache_dir"] == str(tmp_path / "hf_home" / "hub")  # HF_HOME read at call time
    assert sorted(p.name for p in local.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_download_of_bin_only_repo_into_cache(fake_hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "3")
    FakeApi.files = ["config.json", "pytorch_model.bin"]
    folder = resolve_checkpoint(REPO, progress=False)
    assert folder == tmp_path / "snapshot"
    assert "*.bin" in fake_hub["allow_patterns"] and "*.safetensors" not in fake_hub["allow_patterns"]
    assert fake_hub["revision"] is None and fake_hub["local_dir"] is None
    assert FakeApi.calls[0]["timeout"] == 3.0
    assert fake_hub["etag_timeout"] == 3.0


def test_repo_without_config_fails_before_downloading(fake_hub):
    FakeApi.files = ["model.safetensors", "README.md"]
    result = run_pull(REPO)
    assert result.exit_code == 1
    assert "config.json" in error_line(result) and REPO in error_line(result)
    assert fake_hub == {}  # snapshot_download never called


def test_repo_without_weights_fails_before_downloading(fake_hub):
    FakeApi.files = ["config.json", "model.gguf"]
    result = run_pull(REPO)
    assert result.exit_code == 1
    assert "no *.safetensors or *.bin" in error_line(result)
    assert fake_hub == {}


def _raising_api(monkeypatch, exc: Exception):
    class Api(FakeApi):
        def model_info(self, *args, **kwargs):
            raise exc

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)


def _http_error(cls, status: int):
    import httpx2  # the HTTP library under huggingface_hub 1.x+

    request = httpx2.Request("GET", f"https://huggingface.co/api/models/{REPO}")
    response = httpx2.Response(status, request=request)
    return cls("boom\nsecond line", response=response)


@pytest.mark.parametrize(
    ("error_name", "status", "expected"),
    [
        ("RepositoryNotFoundError", 404, "not found"),
        ("GatedRepoError", 403, "is gated"),
        ("RevisionNotFoundError", 404, "revision 'nope' not found"),
        ("HfHubHTTPError", 503, "failed to serve"),
    ],
)
def test_hub_errors_become_one_line(monkeypatch, error_name, status, expected):
    pytest.importorskip("httpx2")
    from huggingface_hub import errors

    _raising_api(monkeypatch, _http_error(getattr(errors, error_name), status))
    result = run_pull(REPO, "--revision", "nope")
    assert result.exit_code == 1
    line = error_line(result)
    assert expected in line and REPO in line
    assert "Traceback" not in result.output and "second line" not in result.output


# --- real failures: no network, no cache ------------------------------------------------------


def test_no_network_fails_at_once_with_one_line():
    """A real call: the endpoint does not resolve (the hub itself is unreachable from here too)."""
    start = time.monotonic()
    result = run_pull(REPO)
    elapsed = time.monotonic() - start
    assert elapsed < 10, elapsed
    assert result.exit_code == 1
    line = error_line(result)
    assert "cannot reach the Hugging Face hub" in line and repr(REPO) in line
    assert "HF_HUB_OFFLINE=1" in line
    assert "Traceback" not in result.output


def test_no_network_with_the_default_endpoint_fails_at_once(monkeypatch):
    """The real huggingface.co, as a user would call it; skipped where the hub is reachable."""
    monkeypatch.delenv("HF_ENDPOINT")
    try:
        socket.getaddrinfo("huggingface.co", 443)
    except OSError:
        pass
    else:
        pytest.skip("huggingface.co resolves here; this test is for machines without network")
    start = time.monotonic()
    result = run_pull("openai-community/gpt2")
    assert time.monotonic() - start < 10
    assert result.exit_code == 1
    assert "cannot reach the Hugging Face hub to fetch 'openai-community/gpt2'" in error_line(result)


def test_silent_hub_times_out_instead_of_hanging(tmp_path):
    """A hub that accepts the connection and never answers: the timeout must fire (run in a subprocess
    so that a regression fails the test instead of hanging the suite)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)  # never accept(): the kernel completes the handshake, nobody answers
        port = server.getsockname()[1]
        env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_ETAG_TIMEOUT": "1",
               "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
        code = "from powerinfer_tools.commands.cli import main; main()"
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", code, "pull", REPO], env=env, capture_output=True,
                              text=True, timeout=60)
        elapsed = time.monotonic() - start
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines()[-1].startswith("pitools: error: cannot reach the Hugging Face hub")
    assert "Traceback" not in proc.stderr
    assert elapsed < 15, elapsed


@pytest.fixture
def hub_calls(monkeypatch):
    """Records every hub API call (offline mode must make none)."""
    calls: list[str] = []
    for name in ("repo_info", "model_info", "list_repo_tree", "list_repo_files"):
        def record(self, *args, _name=name, **kwargs):
            calls.append(_name)
            raise ConnectionError("network call in offline mode")

        monkeypatch.setattr(huggingface_hub.hf_api.HfApi, name, record)
    return calls


def test_offline_with_empty_cache_is_a_clear_error(monkeypatch, tmp_path, hub_calls):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    result = run_pull(REPO)
    assert time.monotonic() - start < 10
    assert result.exit_code == 1
    line = error_line(result)
    assert "HF_HUB_OFFLINE=1" in line and REPO in line and str(tmp_path / "hf_home" / "hub") in line
    assert "cannot reach" not in line  # offline is not reported as a network failure
    assert hub_calls == []


def test_offline_with_local_dir_that_is_empty(monkeypatch, tmp_path, hub_calls):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = run_pull(REPO, "--local-dir", str(tmp_path / "empty"))
    assert result.exit_code == 1
    assert "--local-dir" in error_line(result)
    assert hub_calls == []


def test_offline_resolves_from_a_populated_cache(monkeypatch, tmp_path, hub_calls):
    """The real huggingface_hub cache lookup: refs/main -> snapshots/<sha>, no network touched."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sha = "a" * 40
    repo_dir = tmp_path / "hf_home" / "hub" / ("models--" + REPO.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(sha)
    snapshot = make_checkpoint(repo_dir / "snapshots" / sha)
    result = run_pull(REPO)
    assert result.exit_code == 0, result.stderr
    assert Path(result.stdout.strip()) == snapshot
    assert hub_calls == []
