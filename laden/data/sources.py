"""Reading training records from files, directories of files, saved datasets and the Hugging Face hub.

Every source is read into a plain `list[dict]` up front. Trade-off: the whole dataset sits
in host memory as Python objects (a few hundred bytes per short record), in exchange for a
loader with no worker processes, exact resume and length statistics computed before the
first step. The optional formats (`pyarrow`, `datasets`) are imported only when used.

Input errors name the input: an empty source and a non-UTF-8 byte (`path:line`, byte offset) are
`ValueError`s. A row that is not a JSON object (invalid JSON or an array on a .jsonl line, a .json
element that is not an object) is a bad row: by `on_bad_row`, a `ValueError` naming the first
(`path:line`, `path row N`), how many there are and the fix, or left out and counted
(`Records.skipped`); `laden.data.rows` checks the content of the rows read. `hf:` names are resolved on the hub, whose
client retries a failed connection for ~27 s: one request with a short timeout
(`HUB_PROBE_TIMEOUT_S`) goes first, so an unreachable hub fails at once with the fix
(a local copy), at the cost of one extra round trip when it is reachable.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from laden.data.transform import rename_records, transform_records

log = logging.getLogger(__name__)

ACCEPTED_FORMATS = (
    "a .jsonl file (one JSON object per line), a .json file (a list of objects), a .parquet file, a .csv "
    "file (a header row, then one row per record), a directory of such files, a directory written by "
    "`datasets.Dataset.save_to_disk`, or `hf:<name>` for `datasets.load_dataset`"
)
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
"""The extensions of the data files laden reads itself (and in a directory of them)."""
HF_PREFIX = "hf:"
HUB_PROBE_TIMEOUT_S = 5.0
"""How long the one reachability request to the hub may take before `hf:` names fail as offline."""


def _local_copy_fix(name: str) -> str:
    return (
        f"download it where the hub is reachable (`datasets.load_dataset({name!r}).save_to_disk(dir)`, or "
        f"`huggingface-cli download --repo-type dataset {name} --local-dir dir`) and set the dataset path to "
        "that directory or data file; or set HF_HUB_OFFLINE=1 to use a copy already in the datasets cache"
    )


class Records(list[dict[str, Any]]):
    """The records of one source, a plain list that remembers where they were read from (for errors)."""

    __slots__ = ("source", "lines", "rows", "skipped", "files", "file_of")

    def __init__(
        self,
        records: list[dict[str, Any]],
        *,
        source: str,
        lines: list[int] | None = None,
        rows: list[int] | None = None,
        skipped: int = 0,
        files: list[str] | None = None,
        file_of: list[int] | None = None,
    ) -> None:
        super().__init__(records)
        self.source = source
        """The dataset path as given (a file, a directory or `hf:<name>`)."""
        self.lines = lines
        """The line of each record in a .jsonl file (blank lines skipped), else None."""
        self.rows = rows
        """The row (from 1) of each record in its source, where some were left out; else None."""
        self.skipped = skipped
        """Rows of the source left out as bad (`on_bad_row: skip`), not among these records."""
        self.files = files
        """A directory of data files: the files, in reading order; else None."""
        self.file_of = file_of
        """With `files`: the file (an index into it) of each record; `lines` then holds the line (.jsonl) or
        row (other formats, from 1) of each record in its file."""

    def where(self, index: int) -> str:
        """Where record `index` was read: `path:line` for a .jsonl file, else `path row N` (from 1)."""
        if self.files is not None and self.file_of is not None and self.lines is not None:
            file, position = self.files[self.file_of[index]], self.lines[index]
            return f"{file}:{position}" if file.endswith((".jsonl", ".csv")) else f"{file} row {position}"
        if self.lines is not None and index < len(self.lines):
            return f"{self.source}:{self.lines[index]}"
        return f"{self.source} row {self._row(index)}"

    def subset(self, indices: list[int], *, skipped: int = 0) -> Records:
        """The records at `indices`, each still named by `where` as where it was read; `skipped`: how many
        more rows were left out as bad (added to this one's `skipped`)."""
        lines = None if self.lines is None else [self.lines[i] for i in indices]
        rows = None if lines is not None else [self._row(i) for i in indices]
        file_of = None if self.file_of is None else [self.file_of[i] for i in indices]
        kept = [self[i] for i in indices]
        return Records(
            kept, source=self.source, lines=lines, rows=rows, skipped=self.skipped + skipped,
            files=self.files, file_of=file_of,
        )  # fmt: skip

    def _row(self, index: int) -> int:
        return self.rows[index] if self.rows is not None and index < len(self.rows) else index + 1


@dataclasses.dataclass(slots=True)
class _Positions:
    """Where each record was read, filled in while reading, and the rows that are not objects."""

    lines: list[int] = dataclasses.field(default_factory=list)
    """A .jsonl file: the line of each record."""
    rows: list[int] = dataclasses.field(default_factory=list)
    """A .json file: the element (from 1) of each record."""
    bad: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """Rows that are not JSON objects: (where, problem)."""
    files: list[str] = dataclasses.field(default_factory=list)
    """A directory of data files: the files read; `lines` then holds each record's line or row in its file."""
    file_of: list[int] = dataclasses.field(default_factory=list)
    """A directory of data files: the file (index into `files`) of each record."""


@dataclasses.dataclass(kw_only=True, slots=True)
class HubOptions:
    """What `hf:` names pass to `datasets.load_dataset` besides the name and split (`DatasetConfig`'s fields)."""

    name: str | None = None
    """The dataset's configuration (`openai/gsm8k` has `main` and `socratic`)."""
    revision: str | None = None
    """A branch, tag or commit of the dataset repository."""
    data_files: list[str] = dataclasses.field(default_factory=list)
    """The files to read, relative to the dataset (for `hf:json`, `hf:csv`, ...: local files)."""
    dataset_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Further keyword arguments of `datasets.load_dataset`."""

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `datasets.load_dataset` that are set."""
        given = {"name": self.name, "revision": self.revision, "data_files": self.data_files or None}
        return {k: v for k, v in given.items() if v is not None} | dict(self.dataset_kwargs)


class DatasetFields(Protocol):
    """The fields of a dataset section that say how to read it (`laden.config.DatasetConfig` has them)."""

    path: str
    split: str
    name: str | None
    revision: str | None
    data_files: list[str]
    dataset_kwargs: dict[str, Any]
    rename_columns: dict[str, str]
    transform_fn: str | None
    on_bad_row: Literal["stop", "skip"]


def read_dataset(ds: DatasetFields, *, field: str) -> Records:
    """`load_records` of a dataset section (`field`: its name in errors, e.g. `train_dataset`)."""
    hub = HubOptions(name=ds.name, revision=ds.revision, data_files=list(ds.data_files),
                     dataset_kwargs=dict(ds.dataset_kwargs))  # fmt: skip
    return load_records(
        ds.path, split=ds.split, hub=hub, rename_columns=ds.rename_columns, transform_fn=ds.transform_fn,
        on_bad_row=ds.on_bad_row, field=field,
    )  # fmt: skip


def load_records(
    path: str,
    *,
    split: str = "train",
    hub: HubOptions | None = None,
    rename_columns: Mapping[str, str] | None = None,
    transform_fn: str | None = None,
    on_bad_row: Literal["stop", "skip"] = "stop",
    field: str = "train_dataset",
) -> Records:
    """Read all records of a dataset as dicts; `split` picks the split of `hf:` names and saved DatasetDicts,
    `hub` the rest of what `hf:` names pass to `datasets.load_dataset`.

    Each record then has its columns renamed by `rename_columns` (`{source: new}`) and is passed through
    the function at the import path `transform_fn` (`laden.data.transform`). Raises ValueError for a
    source with no records, naming it. A row that is not a JSON object stops the read with a ValueError
    naming it, how many there are and the fix (`on_bad_row="stop"`; `field` names the dataset in the
    fix), or is left out with a warning and counted in `skipped` (`"skip"`).
    """
    found = _Positions()
    rows = _read_source(path, split=split, hub=hub or HubOptions(), found=found)
    records = Records(
        rows,
        source=path,
        lines=found.lines or None,
        rows=found.rows if found.bad and found.rows else None,
        files=found.files or None,
        file_of=found.file_of or None,
    )
    if found.bad:
        _bad_objects(records, found.bad, on_bad_row, field)
    if not records:
        raise ValueError(
            f"dataset path {path!r} has no records ({_empty_reason(path)}); a dataset needs at least one "
            'record such as {"prompt": ..., "completion": ...} or {"messages": [...]}'
        )
    if rename_columns:
        rename_records(records, rename_columns, field=field)
    if transform_fn:
        transform_records(records, transform_fn, field=field)
    return records


def _empty_reason(path: str) -> str:
    directory = Path(path).expanduser()
    if directory.is_dir() and not _is_saved_dataset(directory):
        return "its data files hold no records"
    if path.startswith(HF_PREFIX) or directory.is_dir():
        return "the dataset split is empty"
    return "the file is empty or holds only blank lines"


def _bad_objects(records: Records, bad: list[tuple[str, str]], on_bad_row: str, field: str) -> None:
    """Stop on rows that are not objects (`on_bad_row="stop"`, or none is left), or count them as skipped."""
    where, problem = bad[0]
    total = len(records) + len(bad)
    count = f"{len(bad)} of {total} rows of {records.source} are not JSON objects"
    if on_bad_row == "skip" and records:
        records.skipped += len(bad)
        log.warning(
            "%s: left out %s (%s.on_bad_row: skip); the first, %s: %s", field, count, field, where, problem
        )
        return
    others = ", ".join(w for w, _ in bad[1:6]) + (", ..." if len(bad) > 6 else "")
    also = f" (also {others})" if len(bad) > 1 else ""
    fix = (
        f"Fix the row(s), or set {field}.on_bad_row: skip to leave them out"
        if on_bad_row == "stop"
        else "Fix the data: every row must be a JSON object"
    )
    raise ValueError(f"{where}: {problem}; {count}{also}. {fix}")


def _read_source(path: str, *, split: str, hub: HubOptions, found: _Positions) -> list[dict[str, Any]]:
    """The records of `path`; `found` gets where each was read and the rows that are not objects."""
    if path.startswith(HF_PREFIX):
        return _load_hub(path[len(HF_PREFIX) :], split=split, hub=hub)
    file = Path(path).expanduser()
    if not file.exists():
        raise FileNotFoundError(f"dataset path {path!r} does not exist; expected {ACCEPTED_FORMATS}")
    if file.is_dir():
        if _is_saved_dataset(file):
            return _load_saved_dataset(file, split=split)
        return _load_directory(file, found)
    suffix = file.suffix.lower()
    if suffix not in DATA_SUFFIXES:
        raise ValueError(
            f"dataset path {path!r} has an unsupported extension {suffix!r}; expected {ACCEPTED_FORMATS}"
        )
    return _load_file(file, found)


def _load_file(file: Path, found: _Positions) -> list[dict[str, Any]]:
    """The records of one data file (`DATA_SUFFIXES`)."""
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        return _load_jsonl(file, found)
    if suffix == ".json":
        return _load_json(file, found)
    if suffix == ".csv":
        return _load_csv(file, found)
    return _load_parquet(file)


def _is_saved_dataset(directory: Path) -> bool:
    """Whether `directory` was written by `save_to_disk` (a Dataset's state.json, a DatasetDict's dataset_dict.json)."""
    return (directory / "state.json").is_file() or (directory / "dataset_dict.json").is_file()


def _load_directory(directory: Path, found: _Positions) -> list[dict[str, Any]]:
    """The records of the data files at the top of `directory`, file after file in name order."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix.lower() in DATA_SUFFIXES)
    if not files:
        inside = sorted(p.name for p in directory.iterdir())[:5]
        raise ValueError(
            f"directory {directory} is not a saved dataset and holds no data files ({', '.join(DATA_SUFFIXES)}) "
            f"at its top level (it holds {inside or 'nothing'}); expected {ACCEPTED_FORMATS}"
        )
    records: list[dict[str, Any]] = []
    for index, file in enumerate(files):
        inner = _Positions()
        rows = _load_file(file, inner)
        found.bad += inner.bad
        positions = inner.lines or inner.rows or list(range(1, len(rows) + 1))
        found.lines += positions
        found.file_of += [index] * len(rows)
        found.files.append(str(file))
        records += rows
    return records


def _load_csv(file: Path, found: _Positions) -> list[dict[str, Any]]:
    """The rows of a .csv file under its header row, every value a string; a row with more values
    than the header has columns is a bad row."""
    text = _decode_file(file.read_bytes(), file)
    reader = csv.DictReader(io.StringIO(text, newline=""), restkey=_EXTRA)
    records = []
    try:
        for row in reader:
            line = reader.line_num  # the row's last line (a quoted value may span several)
            if _EXTRA in row:
                found.bad.append(
                    (f"{file}:{line}", f"{len(reader.fieldnames or ()) + len(row[_EXTRA])} values under a header of "
                     f"{len(reader.fieldnames or ())} columns")
                )  # fmt: skip
                continue
            records.append({k: ("" if v is None else v) for k, v in row.items()})
            found.lines.append(line)
    except csv.Error as e:
        raise ValueError(
            f"{file}:{reader.line_num}: not valid CSV ({e}); quote values that hold commas or newlines"
        ) from e
    return records


_EXTRA = "\0extra"  # DictReader's key for the values past the header's columns


def _load_jsonl(file: Path, found: _Positions) -> list[dict[str, Any]]:
    records = []
    offset = 0  # byte offset of the current line in the file
    # Read as bytes and decode per line, so a bad byte is reported with its line and offset.
    with file.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            line = _decode(raw, file, line_no=line_no, line_offset=offset)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                found.bad.append((f"{file}:{line_no}", f"invalid JSON ({e.msg} at column {e.colno})"))
                continue
            if not isinstance(record, dict):
                found.bad.append(
                    (f"{file}:{line_no}", f"expected a JSON object per line, got {type(record).__name__}")
                )
                continue
            records.append(record)
            found.lines.append(line_no)
    return records


def _decode(raw: bytes, file: Path, *, line_no: int, line_offset: int) -> str:
    """`raw` as UTF-8, or a ValueError naming the file, line, column and byte offset of the bad byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = raw[e.start : e.end]
        column = len(raw[: e.start].decode("utf-8", errors="replace")) + 1
        raise ValueError(
            f"{file}:{line_no}: byte {' '.join(f'0x{b:02x}' for b in bad)} at byte offset {line_offset + e.start} (column "
            f"{column}) is not valid UTF-8 ({e.reason}); data files must be UTF-8: re-encode the file, "
            "e.g. `iconv -f latin1 -t utf-8 IN > OUT` for Latin-1 text"
        ) from e


def _decode_file(raw: bytes, file: Path) -> str:
    """A whole file as UTF-8; a bad byte is reported as by `_decode`, with its line."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        # A newline byte never occurs inside a UTF-8 sequence, so the line alone fails the same way.
        start = raw.rfind(b"\n", 0, e.start) + 1
        end = raw.find(b"\n", e.start)
        line = raw[start:] if end < 0 else raw[start:end]
        return _decode(line, file, line_no=raw.count(b"\n", 0, e.start) + 1, line_offset=start)


def _load_json(file: Path, found: _Positions) -> list[dict[str, Any]]:
    try:
        data = json.loads(_decode_file(file.read_bytes(), file))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(data, list):
        raise ValueError(
            f"{file}: a .json dataset must hold a list of objects, got {type(data).__name__}; "
            "for one object per line use a .jsonl file"
        )
    records = []
    for i, record in enumerate(data):
        if not isinstance(record, dict):
            found.bad.append(
                (f"{file} row {i + 1}", f"element {i} is a {type(record).__name__}, expected a JSON object")
            )
            continue
        records.append(record)
        found.rows.append(i + 1)
    return records


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


def _load_hub(name: str, *, split: str, hub: HubOptions) -> list[dict[str, Any]]:
    if not name:
        raise ValueError(
            f"dataset path {HF_PREFIX!r} names no dataset; write `hf:<name>`, e.g. `hf:org/data`"
        )
    path = f"{HF_PREFIX}{name}"
    datasets = _import_datasets(path)
    # A local directory, a builder of local files (`hf:json`) or an offline hub client needs no network;
    # anything else asks the hub first.
    local = Path(name).expanduser().exists() or name in _packaged_builders(datasets)
    if not local and not datasets.config.HF_HUB_OFFLINE:
        reason = hub_unreachable_reason()
        if reason is not None:
            raise ValueError(
                f"dataset path {path!r} needs the Hugging Face hub, which is unreachable ({reason}); "
                + _local_copy_fix(name)
            )
    try:
        loaded = datasets.load_dataset(name, split=split, **hub.kwargs())
    except ConnectionError as e:
        raise ValueError(
            f"dataset path {path!r} could not be read from the hub ({e}); {_local_copy_fix(name)}"
        ) from e
    return loaded.to_list()


def _packaged_builders(datasets: Any) -> frozenset[str]:
    """The names `datasets.load_dataset` reads local files with (`json`, `csv`, `parquet`, ...)."""
    modules = getattr(datasets.packaged_modules, "_PACKAGED_DATASETS_MODULES", None)
    return frozenset(modules or ("json", "csv", "parquet", "text", "arrow", "pandas"))


def hub_unreachable_reason(
    endpoint: str | None = None, *, timeout_s: float = HUB_PROBE_TIMEOUT_S
) -> str | None:
    """Why the hub at `endpoint` (default: `HF_ENDPOINT`) cannot be reached, or None when it answers.

    One HEAD request through the hub client's own HTTP session (so proxies apply), no retries.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    url = endpoint or constants.ENDPOINT
    try:
        get_session().head(url, timeout=timeout_s)
    except Exception as e:  # any transport failure (DNS, refused, timeout, proxy) means unreachable
        return f"{url}: {type(e).__name__}: {e}"
    return None
