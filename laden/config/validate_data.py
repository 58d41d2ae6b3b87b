"""The rules of the dataset sections: what only `hf:` names read, the column map, the row function.

`name`, `revision`, `data_files` and `dataset_kwargs` are arguments of `datasets.load_dataset`, which only
`hf:` paths go through; set on a local file they would do nothing, so they are errors that say how to
read the file through `datasets` instead. Nothing is imported or read here (the row function is
imported, and the columns checked, when the data is read).
"""

from __future__ import annotations

from laden.config.schema import DatasetConfig, LadenConfig
from laden.import_path import import_path_error

HUB_ONLY = ("name", "revision", "data_files", "dataset_kwargs")
"""Fields passed to `datasets.load_dataset`, read for `hf:` paths only."""
_OWN_ARGUMENTS = ("path", "name", "split", "revision", "data_files")
"""Arguments of `datasets.load_dataset` that laden passes from fields of their own."""


def dataset_errors(cfg: LadenConfig) -> list[str]:
    """Every error of `train_dataset` and `valid_dataset` (when set)."""
    errors = _section_errors(cfg.train_dataset, "train_dataset")
    if cfg.valid_dataset is not None:
        errors += _section_errors(cfg.valid_dataset, "valid_dataset")
    return errors


def _section_errors(ds: DatasetConfig, field: str) -> list[str]:
    return (
        _hub_only_errors(ds, field)
        + _kwargs_errors(ds, field)
        + _rename_errors(ds, field)
        + _transform_errors(ds, field)
    )


def _hub_only_errors(ds: DatasetConfig, field: str) -> list[str]:
    if not ds.path or ds.path.startswith("hf:"):
        return []
    return [
        f"{field}.{name}={getattr(ds, name)!r} is passed to `datasets.load_dataset`, which reads only `hf:` paths, "
        f"and {field}.path={ds.path!r} is not one; remove {field}.{name}, or read the data through `datasets`: "
        f"{field}.path=hf:<dataset> (a Hub id, a local directory, or hf:json / hf:csv / hf:parquet with data_files)"
        for name in HUB_ONLY
        if getattr(ds, name)
    ]


def _kwargs_errors(ds: DatasetConfig, field: str) -> list[str]:
    return [
        f"{field}.dataset_kwargs.{key}={ds.dataset_kwargs[key]!r}: laden passes {key} to `datasets.load_dataset` "
        f"itself; set {field}.{key} instead" + (" (the part after hf:)" if key == "path" else "")
        for key in ds.dataset_kwargs
        if key in _OWN_ARGUMENTS
    ]


def _rename_errors(ds: DatasetConfig, field: str) -> list[str]:
    errors = []
    for source, new in ds.rename_columns.items():
        if not source or not new:
            errors.append(
                f"{field}.rename_columns={ds.rename_columns!r}: {source!r} -> {new!r} names an empty column; "
                "write {source: new}, e.g. {question: prompt}"
            )
    targets = list(ds.rename_columns.values())
    twice = sorted({t for t in targets if targets.count(t) > 1})
    if twice:
        errors.append(
            f"{field}.rename_columns={ds.rename_columns!r} renames several columns to {twice}; a row would lose "
            "all but one of them: rename each to a name of its own"
        )
    return errors


def _transform_errors(ds: DatasetConfig, field: str) -> list[str]:
    if ds.transform_fn is None:
        return []
    error = import_path_error(
        ds.transform_fn, field=f"{field}.transform_fn",
        fix=f"write `module:function`, e.g. {field}.transform_fn=my_data:to_prompt (a function of one row, "
        "a dict, returning a dict)",
    )  # fmt: skip
    return [error] if error else []
