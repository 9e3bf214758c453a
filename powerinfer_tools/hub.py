"""Resolving a checkpoint argument to a local folder: an existing folder, or a Hugging Face hub download.

Only what conversion reads is fetched: the config, the tokenizer and the weights
(safetensors when the repository has them, PyTorch ``.bin`` files otherwise).
Every failure, network or hub side, becomes one :class:`PitoolsError` line.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Iterable

from .errors import PitoolsError

# Files beside the weights that conversion reads.
CONFIG_FILES = ["config.json", "generation_config.json"]
TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
]
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
    if any(f == "model.safetensors" or f == "model.safetensors.index.json" for f in top):
        ignore.append(CONSOLIDATED_PATTERN)
    return allow, ignore


def check_repo_files(repo_id: str, revision: str | None, repo_files: list[str]) -> None:
    """Fail before downloading anything when the repository cannot be a convertible checkpoint."""
    at = f" at revision {revision!r}" if revision else ""
    top = [f for f in repo_files if "/" not in f]
    if "config.json" not in top:
        raise PitoolsError(
            f"hub repository {repo_id!r}{at} has no config.json: it is not a Hugging Face transformers checkpoint"
        )
    if not any(f.endswith((".safetensors", ".bin")) for f in top):
        raise PitoolsError(f"hub repository {repo_id!r}{at} has no *.safetensors or *.bin weights at its top level")


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
        raise PitoolsError(
            f"{id_or_path}: not a folder; pass the folder holding the checkpoint's config.json and weights"
        )
    if not (path / "config.json").is_file():
        raise PitoolsError(f"{id_or_path}: folder has no config.json; it is not a Hugging Face checkpoint folder")
    return path


def resolve_checkpoint(
    id_or_path: str,
    revision: str | None = None,
    local_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> Path:
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
    return _resolve_hub(id_or_path, revision, local_dir, progress)


# --- hub side -------------------------------------------------------------------------------


def _env_true(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None:
        return None
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _offline() -> bool:
    """HF_HUB_OFFLINE as set now (huggingface_hub reads it only once, at import)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = _env_true(name)
        if value is not None:
            return value
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cache_dir() -> str | None:
    """The hub cache named by the environment now (HF_HUB_CACHE, else HF_HOME/hub), else the library default."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return os.path.expanduser(os.path.expandvars(os.environ[name]))
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.path.expandvars(os.environ["HF_HOME"])), "hub")
    return None


def _timeout() -> float:
    try:
        value = float(os.environ.get("HF_HUB_ETAG_TIMEOUT", DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return value if value > 0 else DEFAULT_TIMEOUT_S


def _network_errors() -> tuple[type[BaseException], ...]:
    """Connection and timeout errors of whichever HTTP library this huggingface_hub uses."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, names in (
        ("httpx2", ("TransportError", "TimeoutException")),
        ("httpx", ("TransportError", "TimeoutException")),
        ("requests", ("ConnectionError", "Timeout")),
    ):
        try:
            mod = __import__(module)
        except Exception:  # noqa: BLE001 - absent or broken optional HTTP library
            continue
        errors.extend(getattr(mod, name) for name in names if isinstance(getattr(mod, name, None), type))
    return tuple(errors)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = re.sub(r"\s+", " ", text[0]).strip() if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"pitools: {message}", file=sys.stderr, flush=True)


def _resolve_hub(repo_id: str, revision: str | None, local_dir, progress: bool) -> Path:
    import huggingface_hub
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    offline = _offline()
    cache_dir = _cache_dir()
    endpoint = os.environ.get("HF_ENDPOINT") or None
    timeout = _timeout()
    where = f"--local-dir {local_dir}" if local_dir is not None else f"the Hugging Face cache ({_cache_label(cache_dir)})"
    at = f" at revision {revision!r}" if revision else ""

    bars_were_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        if offline:
            # No listing possible: ask for the safetensors set. A cached bin-only snapshot still
            # passes, since its cached tree listing has no safetensors to miss.
            allow, ignore = download_patterns(["model.safetensors"])
            _say(progress, f"HF_HUB_OFFLINE is set: looking up {repo_id!r}{at} in {where}")
            folder = huggingface_hub.snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache_dir,
                local_dir=local_dir,
                allow_patterns=allow,
                ignore_patterns=ignore,
                local_files_only=True,
            )
        else:
            api = huggingface_hub.HfApi(endpoint=endpoint)
            info = api.model_info(repo_id, revision=revision, timeout=timeout)
            repo_files = [s.rfilename for s in (info.siblings or [])]
            check_repo_files(repo_id, revision, repo_files)
            allow, ignore = download_patterns(repo_files)
            kind = "safetensors" if "*.safetensors" in allow else "PyTorch .bin"
            _say(progress, f"fetching {repo_id!r}{at} (config, tokenizer, {kind} weights) into {where}")
            folder = huggingface_hub.snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache_dir,
                local_dir=local_dir,
                allow_patterns=allow,
                ignore_patterns=ignore,
                endpoint=endpoint,
                etag_timeout=timeout,
            )
    except PitoolsError:
        raise
    except Exception as exc:  # noqa: BLE001 - every hub failure becomes one line
        raise _translate(exc, repo_id, revision, offline, where) from exc
    finally:
        if not progress and not bars_were_disabled:
            enable_progress_bars()

    path = Path(folder)
    if not (path / "config.json").is_file():
        raise PitoolsError(f"{repo_id!r}{at} resolved to {path}, which has no config.json; re-run without HF_HUB_OFFLINE")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise PitoolsError(
            f"{repo_id!r}{at} resolved to {path}, which has no *.safetensors or *.bin weights; "
            "re-run without HF_HUB_OFFLINE to complete the download"
        )
    return path


def _cache_label(cache_dir: str | None) -> str:
    if cache_dir is not None:
        return cache_dir
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _translate(exc: Exception, repo_id: str, revision: str | None, offline: bool, where: str) -> PitoolsError:
    """One clear line for a failure raised by huggingface_hub (or the HTTP library under it)."""
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import OfflineModeIsEnabled

    detail = _one_line(exc)
    if isinstance(exc, HFValidationError):
        return PitoolsError(
            f"{repo_id!r} is neither an existing folder nor a valid Hugging Face repository id "
            f"(expected org/name, or a path starting with ./ or /)"
        )
    if isinstance(exc, GatedRepoError):
        return PitoolsError(
            f"hub repository {repo_id!r} is gated: accept its terms at https://huggingface.co/{repo_id} "
            f"and {_LOGIN_HINT}"
        )
    if isinstance(exc, RevisionNotFoundError):
        return PitoolsError(f"revision {revision or 'main'!r} not found in hub repository {repo_id!r}")
    if isinstance(exc, RepositoryNotFoundError):
        return PitoolsError(
            f"hub repository {repo_id!r} not found (check the id; if it is private, {_LOGIN_HINT})"
        )
    if isinstance(exc, DisabledRepoError):
        return PitoolsError(f"hub repository {repo_id!r} has been disabled by the Hugging Face hub")
    if offline and isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        return PitoolsError(
            f"{repo_id!r} is not (completely) in {where} and HF_HUB_OFFLINE=1 forbids downloading it; "
            "unset HF_HUB_OFFLINE to download it, or pass a local checkpoint folder"
        )
    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled) + _network_errors()):
        # snapshot_download reports a lost connection as LocalEntryNotFoundError from the cache fallback.
        cause = exc.__cause__ if isinstance(exc, LocalEntryNotFoundError) and exc.__cause__ else exc
        return PitoolsError(f"cannot reach the Hugging Face hub to fetch {repo_id!r} ({_one_line(cause)}); {_OFFLINE_HINT}")
    if isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status == 401:
            return PitoolsError(f"hub repository {repo_id!r}: access denied (HTTP 401); {_LOGIN_HINT}")
        return PitoolsError(f"the Hugging Face hub failed to serve {repo_id!r} ({detail}); try again later")
    if isinstance(exc, OSError):
        target = where if where.startswith("--local-dir") else "the Hugging Face cache"
        return PitoolsError(f"could not write {repo_id!r} into {target}: {exc.strerror or detail}")
    return PitoolsError(f"could not fetch {repo_id!r} from the Hugging Face hub ({detail})")
