"""Model card and Hub upload for a folder of calibrated rotations (`huggingface_hub` cards and upload APIs).

`oscar-calibrate --push-to-hub` checks the repo id and the token before calibrating (`preflight`), saves the folder
whatever happens, and reports a failed upload in one line that says how to upload the saved folder later
(`push_later_command`).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping

from transformers.utils import logging

from oscar_hf.rotations.card import model_card
from oscar_hf.rotations.hub import check_push_target

CARD_NAME = "README.md"

logger = logging.get_logger(__name__)

__all__ = ["CARD_NAME", "check_push_target", "model_card", "one_line", "preflight", "push_later_command",
           "push_to_hub", "write_model_card"]


def write_model_card(folder: str | os.PathLike, metadata: Mapping[str, str], repo_id: str | None = None,
                     subfolder: str | None = None) -> str:
    """Write (or overwrite) `folder/README.md`; returns its path."""
    path = os.path.join(folder, CARD_NAME)
    model_card(metadata, repo_id, subfolder, local_folder=folder).save(path)
    return path


def preflight(repo_id: str, token: str | None = None, api=None) -> str | None:
    """Check an upload before a long job: the repo id and the token (`check_push_target`, raises ValueError), then
    whether the Hub accepts the token (raises ValueError when it refuses it).

    Returns None when the Hub answered, or a one-line reason when it could not be reached (offline, no network):
    the job can still run and save its folder, and the upload is tried at the end.
    """
    token = check_push_target(repo_id, token)
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    from huggingface_hub.errors import HfHubHTTPError

    try:
        api.whoami(token=token)
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status == 401:
            raise ValueError(f"the Hub refuses the token for uploading to {repo_id!r} (401): run `hf auth login` "
                             "again or pass another token") from e
        return one_line(e)
    except Exception as e:  # offline mode, DNS or connection errors: whatever the HTTP client raises
        return one_line(e)
    return None


def push_to_hub(folder: str | os.PathLike, repo_id: str, metadata: Mapping[str, str], subfolder: str | None = None,
                private: bool | None = None, token: str | bool | None = None, revision: str | None = None,
                commit_message: str | None = None, api=None) -> str:
    """Upload `folder` (rotation files + model card) to `repo_id` (created if missing); returns the commit URL.

    The card goes to the repo root when `subfolder` is None, else into the subfolder next to the files.
    """
    token = check_push_target(repo_id, token)
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    write_model_card(folder, metadata, repo_id, subfolder)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    info = api.upload_folder(
        repo_id=repo_id, folder_path=os.fspath(folder), path_in_repo=subfolder or "", revision=revision,
        commit_message=commit_message or f"OSCAR rotations for {metadata.get('model', 'a model')}",
        repo_type="model",
    )
    return str(getattr(info, "commit_url", info))


def push_later_command(folder: str | os.PathLike, repo_id: str, subfolder: str | None = None,
                       private: bool = False) -> str:
    """The `hf upload` command (huggingface_hub's CLI) that uploads a saved folder as `push_to_hub` would."""
    words = ["hf", "upload", repo_id, os.fspath(folder)] + ([subfolder] if subfolder else [])
    return " ".join(shlex.quote(w) for w in words) + (" --private" if private else "")


def one_line(error: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
