"""Turning a rotation source or a saved OSCAR setup (local path or Hugging Face Hub repo id) into a local folder, and
the pre-flight check of an upload (repo id and token, no network)."""

from __future__ import annotations

import os
import re

from oscar_hf.rotations.io import CONFIG_NAME, SAFETENSORS_NAME, ZOO_KEY_PATTERN, ZOO_VALUE_PATTERN

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def looks_like_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and ".." not in name


def resolve_rotation_folder(
    path_or_repo_id: str | os.PathLike,
    subfolder: str | None = None,
    revision: str | None = None,
    cache_dir: str | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    force_download: bool = False,
    what: str = "rotations",
) -> str:
    """A local path to the rotations: the argument itself if it exists, else a Hub download (cached). `what`
    names the files in error messages ("rotations", or "OSCAR setup" for `OscarCache.from_pretrained`).

    Offline mode (`HF_HUB_OFFLINE=1` or `local_files_only=True`) uses the local Hub cache only. A relative path
    such as `rotations/qwen3` also reads as a repo id, so when neither exists the error says first that there is
    no such local folder, then why the Hub did not have it: a mistyped local path should not look like a Hub outage.
    """
    source = os.fspath(path_or_repo_id)
    local = os.path.join(source, subfolder) if subfolder else source
    if os.path.exists(local):
        return local
    if os.path.exists(source):
        raise FileNotFoundError(f"{source} exists but has no subfolder {subfolder!r}")
    missing = f"{what} {source!r}: no such local folder or file ({os.path.abspath(local)})"
    if not looks_like_repo_id(source):
        raise FileNotFoundError(f"{missing}, and it is not a Hub repo id of the form 'owner/name'")
    try:
        return _download(source, subfolder, revision, cache_dir, token, local_files_only, force_download, what)
    except OSError as error:
        kind = FileNotFoundError if isinstance(error, FileNotFoundError) else OSError
        raise kind(f"{missing}; as a Hub repo id it is not available either: {error}") from error


def _download(repo_id, subfolder, revision, cache_dir, token, local_files_only, force_download, what) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    patterns = [prefix + SAFETENSORS_NAME, prefix + ZOO_KEY_PATTERN, prefix + ZOO_VALUE_PATTERN, prefix + "*.json"]
    where = f"Hub repo {repo_id!r}" + (f" (subfolder {subfolder!r})" if subfolder else "")
    try:
        root = snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only,
            force_download=force_download, allow_patterns=patterns,
        )
    except LocalEntryNotFoundError as e:
        raise OSError(
            f"could not fetch {what} from the {where}: the Hub is unreachable or offline mode is on "
            "(HF_HUB_OFFLINE=1 / local_files_only=True), and no copy is in the local Hub cache. Connect and retry, "
            "or pass a local folder."
        ) from e
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise OSError(
            f"the {where} does not exist or is private/gated: check the name, or log in with `hf auth login`"
        ) from e
    except RevisionNotFoundError as e:
        raise OSError(f"the {where} has no revision {revision!r}") from e
    except HfHubHTTPError as e:
        raise OSError(f"downloading {what} from the {where} failed: {e}") from e
    except HFValidationError as e:
        raise FileNotFoundError(f"{repo_id!r} is not a valid Hub repo id: {e}") from e
    folder = os.path.join(root, subfolder) if subfolder else root
    # a setup saved with named ("hadamard", "identity") rotations is its oscar_config.json alone
    if not os.path.isdir(folder) or not any(
        f.endswith((".safetensors", ".pt")) or f == CONFIG_NAME for f in os.listdir(folder)
    ):
        raise FileNotFoundError(
            f"the {where} holds no rotation files ({SAFETENSORS_NAME}, {ZOO_KEY_PATTERN}, {ZOO_VALUE_PATTERN}) "
            f"and no {CONFIG_NAME}"
        )
    return folder


def check_push_target(repo_id: str, token: str | bool | None = None) -> str:
    """The token an upload to `repo_id` would use, after checking without the network that `repo_id` is a valid Hub
    repo id and that a token is at hand (`token`, else `HF_TOKEN` or the one `hf auth login` stored).

    Raises ValueError naming what to fix, so that a long job fails before it starts rather than after.
    """
    from huggingface_hub import get_token
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ValueError(f"{repo_id!r} is not a valid Hub repo id ('owner/name' or 'name'): {e}") from e
    found = get_token() if token is None or token is True else token
    if not found:
        raise ValueError(
            f"uploading to {repo_id!r} needs a Hub token: run `hf auth login`, set HF_TOKEN, or pass a token"
        )
    return found
