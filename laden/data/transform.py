"""Reshaping rows as they are read: a column map (`rename_columns`) and a row function (`transform_fn`).

A dataset whose columns are not laden's (`openai/gsm8k`: `question`, `answer`) is used as it is
published: `rename_columns: {question: prompt}` renames columns, and `transform_fn: module:function`
rewrites each row (a dict in, a dict out: build a prompt from several columns, add an instruction).
The column map runs first, so the function sees the new names. Both run once per row at start-up,
before the rows are checked (`laden.data.rows`), so a row they leave unusable is named by its file
and line like any other. Trade-off: a row function runs in the training process, row by row, in
Python (about a microsecond each for a dict rebuild; 1M rows add about a second to start-up).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableSequence
from typing import Any

from laden.import_path import resolve_import_path

Row = dict[str, Any]


def rename_records(records: MutableSequence[Row], columns: Mapping[str, str], *, field: str) -> None:
    """Rename the columns of every row in place (`columns`: `{source: new}`, `Dataset.rename_columns`'
    mapping); a row without a source column keeps its other columns.

    ValueError when a source column is in no row (a misspelt name), or when a new name is a column of
    the row that is not renamed itself (its value would be lost)."""
    present = set().union(*(row.keys() for row in records))
    absent = [source for source in columns if source not in present]
    if absent:
        raise ValueError(
            f"{field}.rename_columns={dict(columns)!r}: column(s) {absent} are in no row of {_source(records)} "
            f"(its columns: {sorted(present)[:20]}); rename columns the data has"
        )
    for index, row in enumerate(records):
        clash = next(
            (new for old, new in columns.items() if old in row and new in row and new not in columns), None
        )
        if clash is not None:
            raise ValueError(
                f"{_where(records, index)}: {field}.rename_columns renames a column to {clash!r}, which the row "
                f"has already; its value would be lost: rename or drop that column too "
                f"(e.g. {{{clash}: original_{clash}}} in {field}.rename_columns)"
            )
        records[index] = {columns.get(key, key): value for key, value in row.items()}


def transform_records(records: MutableSequence[Row], import_path: str, *, field: str) -> None:
    """Replace every row by `function(row)` for the function at `import_path` (`module:function`); the
    result must be a dict (a Mapping). ValueError naming the row when it raises or returns anything else."""
    function = import_transform(import_path, field=field)
    for index, row in enumerate(records):
        try:
            result = function(row)
        except Exception as e:  # the user's function: any failure is reported with its row
            raise ValueError(
                f"{_where(records, index)}: {field}.transform_fn={import_path!r} raised {type(e).__name__}: {e}; "
                "fix the function or the row"
            ) from e
        if not isinstance(result, Mapping):
            raise ValueError(
                f"{_where(records, index)}: {field}.transform_fn={import_path!r} returned a "
                f"{type(result).__name__}, expected a dict (the row with its columns); return the row"
            )
        records[index] = dict(result)


def import_transform(import_path: str, *, field: str) -> Callable[[Row], Any]:
    """The callable at `module:function` (or `module.function`); ValueError (`ImportPathError`) saying why it
    cannot be had: the path's form, a missing module or package, an import that raised, a missing name."""
    fix = f"set {field}.transform_fn to `module:function`, a function of one row (a dict) that returns a dict"
    return resolve_import_path(import_path, field=f"{field}.transform_fn", fix=fix, callable_as="a function")


def _where(records: MutableSequence[Row], index: int) -> str:
    where = getattr(records, "where", None)
    return where(index) if where is not None else f"row {index + 1}"


def _source(records: MutableSequence[Row]) -> str:
    return str(getattr(records, "source", "the dataset"))
