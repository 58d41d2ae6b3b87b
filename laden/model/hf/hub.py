"""Model paths that name a Hugging Face Hub repository (`org/name`): fetched once into the HF cache.

`resolve_model_path` returns an existing local path unchanged; a path shaped like a Hub id that does
not exist locally is fetched with `huggingface_hub.snapshot_download` into the Hub cache (`HF_HUB_CACHE`,
default `~/.cache/huggingface/hub`) and the snapshot directory is returned, so every later reader
(loaders, tokenizer, memory planner, rollout servers) sees a plain local directory. Offline
(`HF_HUB_OFFLINE=1`, `local_files_only`, or a Hub that cannot be reached) a cached snapshot is used; a
model that is neither cached nor reachable is a `ValueError` naming the id, the reason and the fix
(`hf download <id> --local-dir DIR`, then `actor.path=DIR`).

Only what laden reads is fetched (`MODEL_FILES`: config, tokenizer and safetensors weights at the top
level of the repository), never PyTorch `.bin`/`.pth`, GGUF or ONNX copies, nor Mistral's duplicate
`consolidated.safetensors`. The cost: a repository that ships only `pytorch_model*.bin` arrives without
weights (the loader then says so); download such a one with `hf download` and point the path at it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from laden.config.validate_model import is_hub_id

log = logging.getLogger(__name__)

__all__ = ["CONFIG_FILES", "MODEL_FILES", "is_hub_id", "resolve_model_path"]

CONFIG_FILES = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")
"""Config, generation config, tokenizer and chat template files (JSON, merges/vocab text, SentencePiece)."""
MODEL_FILES = (*CONFIG_FILES, "*.safetensors")
"""Everything laden reads from a model repository: `CONFIG_FILES` plus the safetensors weights."""
_SKIPPED = ("*/*", "consolidated*")
"""Sub-folders (`original/`, `onnx/`, ...) and Mistral's single-file duplicate of the sharded weights."""


def resolve_model_path(
    path: str,
    *,
    revision: str | None = None,
    local_files_only: bool = False,
    weights: bool = True,
    show_progress: bool = True,
    field: str = "actor.path",
) -> str:
    """`path` itself when it exists or is not a Hub id, else the local snapshot of the Hub repository.

    `revision`: branch, tag or commit (None = main). `local_files_only`: only the HF cache, never the
    network (`HF_HUB_OFFLINE=1` does the same, read by huggingface_hub). `weights`: False fetches the
    config and tokenizer only (enough for a memory plan). `field` names the setting in messages.
    Raises ValueError when the model can be neither found in the cache nor fetched.
    """
    if not path or Path(path).expanduser().exists() or not is_hub_id(path):
        if revision and path:
            log.warning("%s=%r is a local path: the revision %r is ignored", field, path, revision)
        return path
    from huggingface_hub import snapshot_download

    at = f" at revision {revision!r}" if revision else ""
    log.info(
        "%s=%r%s: fetching from the Hugging Face Hub into its cache (or using the cached copy)",
        field,
        path,
        at,
    )
    try:
        directory = snapshot_download(
            path,
            revision=revision or None,
            local_files_only=local_files_only,
            allow_patterns=list(MODEL_FILES if weights else CONFIG_FILES),
            ignore_patterns=list(_SKIPPED),
            tqdm_class=None if show_progress else _silent_tqdm(),
        )
    except Exception as err:  # every failure of the Hub client becomes one line with the fix
        raise ValueError(_fetch_error(path, revision, field, err)) from err
    log.info("%s=%r%s is the local directory %s", field, path, at, directory)
    return str(directory)


def _fetch_error(path: str, revision: str | None, field: str, err: Exception) -> str:
    """The invariant (what `path` is not), the reason (from the Hub client's error) and the fix."""
    from huggingface_hub import errors

    at = f" at revision {revision!r}" if revision else ""
    what = f"{field}={path!r} is not a local path, so it was looked up as a Hugging Face Hub model{at}"
    rev = f" --revision {revision}" if revision else ""
    fix = (
        f"download it where the Hub is reachable (`hf download {path}{rev} --local-dir DIR`) and set "
        f"{field}=DIR, or fill this machine's Hugging Face cache (HF_HUB_CACHE) with `hf download {path}{rev}`"
    )
    reason = _one_line(err)
    if isinstance(err, errors.GatedRepoError):
        return f"{what}: it is gated ({reason}); accept its terms on the Hub and log in (`hf auth login`), or {fix}"
    if isinstance(err, errors.RepositoryNotFoundError):
        return (
            f"{what}: the Hub has no such repository, or it is private ({reason}); check the name (as a local "
            f"path, {Path(path).absolute()} does not exist), log in (`hf auth login`) for a private one, or {fix}"
        )
    if isinstance(err, errors.RevisionNotFoundError):
        field_rev = field.rsplit(".", 1)[0] + ".revision"
        return f"{what}: the repository has no revision {revision!r} ({reason}); set {field_rev} to a branch, tag or commit it has"
    if isinstance(err, errors.LocalEntryNotFoundError):
        return f"{what}: it is not in the Hugging Face cache and cannot be fetched now ({reason}); {fix}"
    return f"{what}: fetching it failed ({type(err).__name__}: {reason}); {fix}"


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _silent_tqdm() -> Any:
    from tqdm.auto import tqdm

    class Silent(tqdm):  # type: ignore[misc, valid-type]
        """A progress bar that never draws (ranks other than the first fetch quietly)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent
