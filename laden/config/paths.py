"""Where the relative paths of a configuration point: a config file's against its directory, the rest
against the working directory.

A path written in a config file (`actor.path: ../models/tiny`) means the same wherever the command runs,
so `laden sft --config /abs/examples/sft_tiny.yaml` works from any directory; a path given on the command
line (`train_dataset.path=data.jsonl`), and a default (`cluster.fileroot: runs`), is relative to the
working directory, as in any other command. Every path field is made absolute at load time, so the
run's `config.yaml` names the same files when it is read again from elsewhere (`laden doctor`, a resume).

Left as written: `hf:` names (the `datasets` library resolves them), interpolations (`${...}`, resolved
afterwards, then made absolute against the working directory), and a Hub id: a model or dataset path of
the form `org/name` with no such path where it would resolve. Trade-off: a relative directory named
like a Hub id that does not exist yet (`data/train`) is taken as a Hub id, and the error that it does not
exist says so. `data_files` entries are local paths, resolved the same way, only for a builder of local
files (`hf:json`, `hf:csv`, ...); for a repository or directory they are relative to it, and left as written.

Each error about a path that does not exist ends with the rule that made it (`note_rules`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from laden.config.validate_model import is_hub_id

log = logging.getLogger(__name__)

PATH_FIELDS = (
    "actor.path",
    "critic.path",
    "teacher.path",
    "train_dataset.path",
    "valid_dataset.path",
    "cluster.fileroot",
)
"""The fields that hold a local path (a model directory, a dataset, the run root)."""
DATASETS = ("train_dataset", "valid_dataset")
LOCAL_FILE_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")
"""`hf:` names whose `data_files` are local files (`datasets`' packaged builders)."""


@dataclasses.dataclass(frozen=True, slots=True)
class PathRule:
    """How one path field got its value: as written, and the rule that resolved it."""

    written: str
    """The value as given (in the file, on the command line, or the default)."""
    rule: str
    """The rule applied, as a sentence for an error message."""


def resolve_in_file(raw: dict[str, Any], config_file: Path) -> dict[str, tuple[str, PathRule]]:
    """Make the relative path values of a config file's tree `raw` absolute against the file's
    directory, in place; returns {field: (value as resolved, its rule)} for each path field the file sets."""
    origin = f"written in the config file {config_file}"
    directory = Path(os.path.abspath(config_file)).parent
    resolved: dict[str, tuple[str, PathRule]] = {}
    for field in PATH_FIELDS:
        node, leaf = _parent(raw, field)
        value = node.get(leaf) if node is not None else None
        if isinstance(value, str) and value and not value.startswith("hf:") and "${" not in value:
            node[leaf] = _resolve(value, directory, field)  # type: ignore[index]
            resolved[field] = (node[leaf], _rule(value, node[leaf], origin, directory))  # type: ignore[index]
    for section in DATASETS:
        node, _ = _parent(raw, f"{section}.data_files")
        if node is not None and _local_files(node.get("path")) and isinstance(node.get("data_files"), list):
            node["data_files"] = [_resolve(f, directory, "data_files") if isinstance(f, str) else f
                                  for f in node["data_files"]]  # fmt: skip
    return resolved


def resolve_rest(cfg: Any, from_file: dict[str, tuple[str, PathRule]]) -> dict[str, PathRule]:
    """Make the path fields of `cfg` that are still relative (command line, defaults) absolute against
    the working directory, in place; returns the rule of each path field that is set."""
    cwd = Path.cwd()
    origin = "given on the command line (or a default)"
    rules: dict[str, PathRule] = {}
    for field in PATH_FIELDS:
        owner, leaf = _owner(cfg, field)
        value = getattr(owner, leaf, None) if owner is not None else None
        if not isinstance(value, str) or not value or value.startswith("hf:"):
            continue
        if field in from_file and value == from_file[field][0]:
            rules[field] = from_file[field][1]
            continue
        setattr(owner, leaf, _resolve(value, cwd, field))
        rules[field] = _rule(value, getattr(owner, leaf), origin, cwd)
    for section in DATASETS:
        ds = getattr(cfg, section, None)
        if ds is not None and _local_files(ds.path):
            ds.data_files = [_resolve(f, cwd, "data_files") for f in ds.data_files]
    return rules


def note_rules(errors: list[str], rules: dict[str, PathRule]) -> list[str]:
    """`errors` with the path rule added to each that says a path field's path does not exist."""
    out = []
    for error in errors:
        field = next((f for f in rules if error.startswith(f"{f}=")), None)
        if field is not None and "does not exist" in error:
            error = f"{error} [{field}: {rules[field].rule}]"
        out.append(error)
    return out


def warn_missing_datasets(cfg: Any, rules: dict[str, PathRule]) -> None:
    """Warn about a dataset path that does not exist (read when the run starts), naming the rule."""
    for section in DATASETS:
        field = f"{section}.path"
        ds = getattr(cfg, section, None)
        if ds is None or field not in rules or os.path.exists(os.path.expanduser(ds.path)):
            continue
        log.warning("%s=%r does not exist; reading the data will fail [%s: %s]", field, ds.path, field,
                    rules[field].rule)  # fmt: skip


def _resolve(value: str, directory: Path, field: str) -> str:
    """`value` made absolute against `directory`, unless it is an `hf:` name, an interpolation or a Hub id."""
    if not value or value.startswith("hf:") or "${" in value:
        return value
    expanded = os.path.expanduser(value)
    if os.path.isabs(expanded):
        return os.path.normpath(expanded)
    candidate = os.path.normpath(directory / expanded)
    hub_id = field not in ("cluster.fileroot", "data_files") and is_hub_id(value)
    if hub_id and not os.path.exists(candidate):
        return value
    return candidate


def _rule(written: str, resolved: str, origin: str, directory: Path) -> PathRule:
    """The rule that took `written` (`origin`: where it was given) to `resolved`."""
    if os.path.isabs(os.path.expanduser(written)):
        rule = f"{written!r} is an absolute path, used as written"
    elif resolved == written:
        rule = f"{written!r}, {origin}, is taken as a Hub id `org/name`: there is no {directory / written}"
    else:
        rule = f"{written!r}, {origin}, is relative to {directory}"
        if origin.startswith("written"):
            rule += " (the config file's directory); write it relative to that file, or absolute"
        else:
            rule += " (the working directory); give it relative to that directory, or absolute"
    return PathRule(written=written, rule=rule)


def _local_files(path: Any) -> bool:
    return isinstance(path, str) and path.startswith("hf:") and path[3:] in LOCAL_FILE_BUILDERS


def _parent(raw: dict[str, Any], field: str) -> tuple[dict[str, Any] | None, str]:
    *parents, leaf = field.split(".")
    node: Any = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


def _owner(cfg: Any, field: str) -> tuple[Any, str]:
    *parents, leaf = field.split(".")
    node = cfg
    for part in parents:
        node = getattr(node, part, None)
    return node, leaf
