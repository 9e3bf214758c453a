"""Resolving a checkpoint argument to a local folder: an existing folder, or a Hugging Face hub download.

Only what conversion reads is fetched: the config, the tokenizer and the weights
(safetensors when the repository has them, PyTorch ``.bin`` files otherwise).
Every failure, network or hub side, becomes one :class:`PitoolsError` line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterable

from powerinfer_tools.errors import PitoolsError

# Files beside the weights that conversion reads.
CONFIG_FILES = ["config.json", "generation_config.json"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt"]
SAFETENSORS_PATTERNS = ["*.safetensors", "model.safetensors.index.json"]
BIN_PATTERNS = ["*.bin", "pytorch_model.bin.index.json"]
# Conversion reads the top level only: never fetch weights from subfolders (onnx/, original/, ...).
# Mistral-style repositories also ship ``consolidated.safetensors``, a second full copy of the
# weights in another layout that transformers never loads; it is skipped when the usual files exist.
SUBFOLDER_PATTERN = "*/*"
CONSOLIDATED_PATTERN = "consolidated*.safetensors"

# Seconds to wait for the hub before giving up (connect and each read). HF_HUB_ETAG_TIMEOUT overrides it.
DEFAULT_TIMEOUT_S = 10.0

_OFFLINE_HINT = "download it elsewhere and pass the folder, or set HF_HUB_OFFLINE=1 to use the cache"
_LOGIN_HINT = "log in with `hf auth login` or set HF_TOKEN"


def download_patterns(repo_files: Iterable[str]) -> tuple[list[str], list[str]]:
    """Return ``(allow_patterns, ignore_patterns)`` for a repository holding ``repo_files``.

    Safetensors weights are preferred; ``*.bin`` files are fetched only when the top level of
    the repository has no ``*.safetensors`` file. Pure: no network, no file system.
    """
    top = [f for f in repo_files if "/" not in f]
    has_safetensors = any(f.endswith(".safetensors") for f in top)
    allow = CONFIG_FILES + TOKENIZER_FILES + (SAFETENSORS_PATTERNS if has_safetensors else BIN_PATTERNS)
    ignore = [SUBFOLDER_PATTERN]
    if {"model.safetensors", "model.safetensors.index.json"} & set(top):
        ignore.append(CONSOLIDATED_PATTERN)
    return allow, ignore


def check_repo_files(repo: str, repo_files: list[str]) -> None:
    """Fail before downloading anything when the repository cannot be a convertible checkpoint
    (``repo`` names it, with its revision)."""
    top = [f for f in repo_files if "/" not in f]
    if "config.json" not in top:
        raise PitoolsError(f"hub repository {repo} has no config.json: it is not a Hugging Face transformers checkpoint")
    if not any(f.endswith((".safetensors", ".bin")) for f in top):
        raise PitoolsError(f"hub repository {repo} has no *.safetensors or *.bin weights at its top level")


def looks_local(id_or_path: str) -> bool:
    """A path rather than a hub id: starts with '.', '/' or '~', or names something that exists."""
    return id_or_path.startswith((".", "/", "~")) or Path(id_or_path).exists()


def resolve_local(id_or_path: str) -> Path:
    """Check that ``id_or_path`` is a folder holding a config.json and return it (``~`` expanded)."""
    if not id_or_path:  # Path("") is the current folder: never what an empty argument meant
        raise PitoolsError("'': empty checkpoint path; give a checkpoint folder or a Hugging Face hub id")
    path = Path(id_or_path).expanduser()
    if not path.exists():
        raise PitoolsError(f"{id_or_path}: no such folder")
    if not path.is_dir():
        raise PitoolsError(f"{id_or_path}: not a folder; pass the folder holding the checkpoint's config.json and weights")
    if not (path / "config.json").is_file():
        raise PitoolsError(f"{id_or_path}: folder has no config.json; it is not a Hugging Face checkpoint folder")
    return path


def resolve_checkpoint(id_or_path: str, revision: str | None = None, local_dir: str | os.PathLike | None = None,
                       progress: bool = True) -> Path:
    """Return a local folder holding the checkpoint ``id_or_path``.

    An existing folder is returned as is (after checking it has a config.json). Anything else
    is a hub id (``org/name``): the files conversion needs are downloaded (resuming any partial
    download) into the Hugging Face cache, or into ``local_dir``, and that folder is returned.
    With ``HF_HUB_OFFLINE=1`` the cache (or ``local_dir``) is used and nothing is downloaded.
    """
    if looks_local(id_or_path):
        if revision is not None or local_dir is not None:
            raise PitoolsError(f"{id_or_path}: --revision and --local-dir apply to hub ids, not to local folders")
        return resolve_local(id_or_path)
    return _resolve_hub(_HubRequest(id_or_path, revision, local_dir), progress)


# --- hub side: huggingface_hub reads its environment once, at import; we read it per call --------


def _env(*names: str) -> str | None:
    return next((os.environ[name] for name in names if os.environ.get(name)), None)


class _HubRequest:
    """One hub lookup and the settings the environment gives it now."""

    def __init__(self, repo_id: str, revision: str | None, local_dir):
        from huggingface_hub import constants

        self.repo_id, self.revision, self.local_dir = repo_id, revision, local_dir
        offline = _env("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
        self.offline = offline.strip().upper() in {"1", "ON", "YES", "TRUE"} if offline else constants.HF_HUB_OFFLINE
        cache = _env("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")
        home = _env("HF_HOME")
        self.cache_dir = os.path.expanduser(os.path.expandvars(cache)) if cache else (
            os.path.join(os.path.expanduser(os.path.expandvars(home)), "hub") if home else None)
        self.endpoint = _env("HF_ENDPOINT")
        try:
            self.timeout = float(_env("HF_HUB_ETAG_TIMEOUT") or DEFAULT_TIMEOUT_S)
        except ValueError:
            self.timeout = DEFAULT_TIMEOUT_S
        self.timeout = self.timeout if self.timeout > 0 else DEFAULT_TIMEOUT_S
        self.name = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
        self.where = (f"--local-dir {local_dir}" if local_dir is not None
                      else f"the Hugging Face cache ({self.cache_dir or constants.HF_HUB_CACHE})")


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"pitools: {message}", file=sys.stderr, flush=True)


def _download(request: _HubRequest, progress: bool) -> Path:
    import huggingface_hub

    if request.offline:
        # No listing possible: ask for the safetensors set. A cached bin-only snapshot still
        # passes, since its cached tree listing has no safetensors to miss.
        allow, ignore = download_patterns(["model.safetensors"])
        _say(progress, f"HF_HUB_OFFLINE is set: looking up {request.name} in {request.where}")
        online = {"local_files_only": True}
    else:
        api = huggingface_hub.HfApi(endpoint=request.endpoint)
        info = api.model_info(request.repo_id, revision=request.revision, timeout=request.timeout)
        repo_files = [s.rfilename for s in (info.siblings or [])]
        check_repo_files(request.name, repo_files)
        allow, ignore = download_patterns(repo_files)
        kind = "safetensors" if "*.safetensors" in allow else "PyTorch .bin"
        _say(progress, f"fetching {request.name} (config, tokenizer, {kind} weights) into {request.where}")
        online = {"endpoint": request.endpoint, "etag_timeout": request.timeout}
    return Path(huggingface_hub.snapshot_download(
        request.repo_id, revision=request.revision, cache_dir=request.cache_dir, local_dir=request.local_dir,
        allow_patterns=allow, ignore_patterns=ignore, **online))


def _resolve_hub(request: _HubRequest, progress: bool) -> Path:
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    bars_were_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        path = _download(request, progress)
    except PitoolsError:
        raise
    except Exception as exc:  # noqa: BLE001 - every hub failure becomes one line
        raise _translate(exc, request) from exc
    finally:
        if not progress and not bars_were_disabled:
            enable_progress_bars()
    if not (path / "config.json").is_file():
        raise PitoolsError(f"{request.name} resolved to {path}, which has no config.json; re-run without HF_HUB_OFFLINE")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise PitoolsError(f"{request.name} resolved to {path}, which has no *.safetensors or *.bin weights; "
                           "re-run without HF_HUB_OFFLINE to complete the download")
    return path


def _network_errors() -> tuple[type[BaseException], ...]:
    """Connection and timeout errors of whichever HTTP library this huggingface_hub uses."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, names in (("httpx2", ("TransportError", "TimeoutException")),
                          ("httpx", ("TransportError", "TimeoutException")), ("requests", ("ConnectionError", "Timeout"))):
        try:
            mod = __import__(module)
        except Exception:  # noqa: BLE001 - absent or broken optional HTTP library
            continue
        errors.extend(getattr(mod, name) for name in names if isinstance(getattr(mod, name, None), type))
    return tuple(errors)


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    first = " ".join(lines[0].split()) if lines else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _translate(exc: Exception, request: _HubRequest) -> PitoolsError:
    """One clear line for a failure raised by huggingface_hub (or the HTTP library under it)."""
    from huggingface_hub import errors
    from huggingface_hub.utils import OfflineModeIsEnabled

    repo = f"{request.repo_id!r}"
    missing = (errors.LocalEntryNotFoundError, OfflineModeIsEnabled)
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, errors.HFValidationError):
        message = (f"{repo} is neither an existing folder nor a valid Hugging Face repository id "
                   "(expected org/name, or a path starting with ./ or /)")
    elif isinstance(exc, errors.GatedRepoError):
        message = (f"hub repository {repo} is gated: accept its terms at https://huggingface.co/{request.repo_id} "
                   f"and {_LOGIN_HINT}")
    elif isinstance(exc, errors.RevisionNotFoundError):
        message = f"revision {request.revision or 'main'!r} not found in hub repository {repo}"
    elif isinstance(exc, errors.RepositoryNotFoundError):
        message = f"hub repository {repo} not found (check the id; if it is private, {_LOGIN_HINT})"
    elif isinstance(exc, errors.DisabledRepoError):
        message = f"hub repository {repo} has been disabled by the Hugging Face hub"
    elif request.offline and isinstance(exc, missing):
        message = (f"{repo} is not (completely) in {request.where} and HF_HUB_OFFLINE=1 forbids downloading it; "
                   "unset HF_HUB_OFFLINE to download it, or pass a local checkpoint folder")
    elif isinstance(exc, missing + _network_errors()):
        # snapshot_download reports a lost connection as LocalEntryNotFoundError from the cache fallback.
        cause = exc.__cause__ if isinstance(exc, errors.LocalEntryNotFoundError) and exc.__cause__ else exc
        message = f"cannot reach the Hugging Face hub to fetch {repo} ({_one_line(cause)}); {_OFFLINE_HINT}"
    elif isinstance(exc, errors.HfHubHTTPError) and status == 401:
        message = f"hub repository {repo}: access denied (HTTP 401); {_LOGIN_HINT}"
    elif isinstance(exc, errors.HfHubHTTPError):
        message = f"the Hugging Face hub failed to serve {repo} ({_one_line(exc)}); try again later"
    elif isinstance(exc, OSError):
        target = request.where if request.local_dir is not None else "the Hugging Face cache"
        message = f"could not write {repo} into {target}: {exc.strerror or _one_line(exc)}"
    else:
        message = f"could not fetch {repo} from the Hugging Face hub ({_one_line(exc)})"
    return PitoolsError(message)
