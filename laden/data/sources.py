"""Reading training records from files, saved datasets and the Hugging Face hub.

Every source is read into a plain `list[dict]` up front. Trade-off: the whole dataset sits
in host memory as Python objects (a few hundred bytes per short record), in exchange for a
loader with no worker processes, exact resume and length statistics computed before the
first step. The optional formats (`pyarrow`, `datasets`) are imported only when used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ACCEPTED_FORMATS = (
    "a .jsonl file (one JSON object per line), a .json file (a list of objects), a .parquet file, "
    "a directory written by `datasets.Dataset.save_to_disk`, or `hf:<name>` for `datasets.load_dataset`"
)
HF_PREFIX = "hf:"


def load_records(path: str, *, split: str = "train") -> list[dict[str, Any]]:
    """Read all records of a dataset as dicts; `split` picks the split of `hf:` names and saved DatasetDicts."""
    if path.startswith(HF_PREFIX):
        return _load_hub(path[len(HF_PREFIX) :], split=split)
    file = Path(path).expanduser()
    if not file.exists():
        raise FileNotFoundError(f"dataset path {path!r} does not exist; expected {ACCEPTED_FORMATS}")
    if file.is_dir():
        return _load_saved_dataset(file, split=split)
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        return _load_jsonl(file)
    if suffix == ".json":
        return _load_json(file)
    if suffix == ".parquet":
        return _load_parquet(file)
    raise ValueError(
        f"dataset path {path!r} has an unsupported extension {suffix!r}; expected {ACCEPTED_FORMATS}"
    )


def _load_jsonl(file: Path) -> list[dict[str, Any]]:
    records = []
    with file.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}:{line_no}: invalid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(record, dict):
                raise ValueError(
                    f"{file}:{line_no}: expected a JSON object per line, got {type(record).__name__}"
                )
            records.append(record)
    return records


def _load_json(file: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(data, list):
        raise ValueError(
            f"{file}: a .json dataset must hold a list of objects, got {type(data).__name__}; "
            "for one object per line use a .jsonl file"
        )
    for i, record in enumerate(data):
        if not isinstance(record, dict):
            raise ValueError(f"{file}: element {i} is a {type(record).__name__}, expected a JSON object")
    return data


def _load_parquet(file: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(
            f"reading {file} needs pyarrow: `pip install pyarrow` (or `pip install laden[data]`)"
        ) from e
    return pq.read_table(file).to_pylist()


def _import_datasets(what: str):
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            f"reading {what} needs the `datasets` package: `pip install datasets` (or `pip install laden[data]`)"
        ) from e
    return datasets


def _load_saved_dataset(directory: Path, *, split: str) -> list[dict[str, Any]]:
    datasets = _import_datasets(str(directory))
    try:
        loaded = datasets.load_from_disk(str(directory))
    except FileNotFoundError as e:
        raise ValueError(
            f"directory {directory} is not a saved dataset ({e}); expected {ACCEPTED_FORMATS}"
        ) from e
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(
                f"saved dataset {directory} has no split {split!r}; available splits: {sorted(loaded)}; "
                "set train_dataset.split to one of them"
            )
        loaded = loaded[split]
    return loaded.to_list()


def _load_hub(name: str, *, split: str) -> list[dict[str, Any]]:
    if not name:
        raise ValueError(
            f"dataset path {HF_PREFIX!r} names no dataset; write `hf:<name>`, e.g. `hf:org/data`"
        )
    datasets = _import_datasets(f"{HF_PREFIX}{name}")
    return datasets.load_dataset(name, split=split).to_list()
