"""Dataset sources and row reshaping: every local format, a directory of them, a column map, a row
function by import path, and `hf:` names with their `datasets.load_dataset` arguments (no network)."""

from __future__ import annotations

import json
import sys

import pytest

from laden.config import ConfigError, load_config
from laden.data import HubOptions, load_records, read_dataset

ROWS = [{"question": "1+1", "answer": "2"}, {"question": "2+3", "answer": "5"}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _csv(path, rows):
    path.write_text(
        "question,answer\n" + "".join(f"{r['question']},{r['answer']}\n" for r in rows), encoding="utf-8"
    )
    return path


def test_each_local_format_reads_the_same_rows(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    files = {
        "jsonl": _jsonl(tmp_path / "d.jsonl", ROWS),
        "csv": _csv(tmp_path / "d.csv", ROWS),
        "json": tmp_path / "d.json",
        "parquet": tmp_path / "d.parquet",
    }
    files["json"].write_text(json.dumps(ROWS), encoding="utf-8")
    pd.DataFrame(ROWS).to_parquet(files["parquet"])
    for kind, file in files.items():
        assert list(load_records(str(file))) == ROWS, kind


def test_csv_values_are_strings_and_rows_are_named_by_line(tmp_path):
    file = tmp_path / "d.csv"
    file.write_text('question,answer\n"a, quoted",7\n1+1,2,extra\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"d\.csv:3: 3 values under a header of 2 columns"):
        load_records(str(file))
    records = load_records(str(file), on_bad_row="skip")
    assert list(records) == [{"question": "a, quoted", "answer": "7"}] and records.skipped == 1
    assert records.where(0) == f"{file}:2"


def test_directory_of_data_files_reads_each_in_name_order(tmp_path):
    _jsonl(tmp_path / "a.jsonl", ROWS[:1])
    _csv(tmp_path / "b.csv", ROWS[1:])
    (tmp_path / "notes.txt").write_text("not data")
    records = load_records(str(tmp_path))
    assert list(records) == ROWS
    assert [records.where(i) for i in range(2)] == [f"{tmp_path / 'a.jsonl'}:1", f"{tmp_path / 'b.csv'}:2"]
    kept = records.subset([1])
    assert kept.where(0) == f"{tmp_path / 'b.csv'}:2"


def test_directory_without_data_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"not a saved dataset and holds no data files.*notes\.txt"):
        load_records(str(tmp_path))


def test_column_map_renames_before_the_transform(tmp_path, monkeypatch):
    (tmp_path / "my_rows.py").write_text(
        "def to_prompt(row):\n"
        "    return {'prompt': row['prompt'] + ' = ?', 'answer': row['answer']}\n"
        "def not_a_dict(row):\n"
        "    return [row]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = _jsonl(tmp_path / "d.jsonl", ROWS)
    records = load_records(str(data), rename_columns={"question": "prompt"}, transform_fn="my_rows:to_prompt")
    assert list(records) == [{"prompt": "1+1 = ?", "answer": "2"}, {"prompt": "2+3 = ?", "answer": "5"}]
    assert records.where(1) == f"{data}:2"  # still named by where it was read
    with pytest.raises(
        ValueError, match=r"d\.jsonl:1: train_dataset\.transform_fn='my_rows:not_a_dict' returned a list"
    ):
        load_records(str(data), transform_fn="my_rows:not_a_dict")
    with pytest.raises(
        ValueError, match=r"train_dataset\.transform_fn='no_such_module:f': cannot import 'no_such_module': no module "
        r"named 'no_such_module'; check the spelling and that its folder is on PYTHONPATH.*set train_dataset\."
        r"transform_fn to `module:function`",
    ):  # fmt: skip
        load_records(str(data), transform_fn="no_such_module:f")
    with pytest.raises(
        ValueError,
        match=r"'my_rows' has no attribute 'missing' \(it has: not_a_dict, to_prompt\); fix the name",
    ):
        load_records(str(data), transform_fn="my_rows:missing")
    sys.modules.pop("my_rows", None)


def test_column_map_errors_name_the_column(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"question": "q", "prompt": "p"}])
    with pytest.raises(
        ValueError, match=r"column\(s\) \['questoin'\] are in no row.*\['prompt', 'question'\]"
    ):
        load_records(str(data), rename_columns={"questoin": "prompt"})
    with pytest.raises(
        ValueError, match=r"d\.jsonl:1: .*renames a column to 'prompt', which the row has already"
    ):
        load_records(str(data), rename_columns={"question": "prompt"})
    swapped = load_records(str(data), rename_columns={"question": "prompt", "prompt": "question"})
    assert list(swapped) == [{"prompt": "q", "question": "p"}]


def test_hf_name_passes_config_split_revision_files_and_kwargs(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # no reachability probe
    hub = HubOptions(
        name="main", revision="v1", data_files=["a.parquet"], dataset_kwargs={"trust_remote_code": True}
    )
    records = load_records("hf:openai/gsm8k", split="test", hub=hub, rename_columns={"question": "prompt"})
    assert calls == [("openai/gsm8k", {"split": "test", "name": "main", "revision": "v1",
                                       "data_files": ["a.parquet"], "trust_remote_code": True})]  # fmt: skip
    assert records[0] == {"prompt": "1+1", "answer": "2"}


def test_hf_json_builder_reads_local_data_files_from_a_config(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    (tmp_path / "data").mkdir()
    _jsonl(tmp_path / "data" / "part.jsonl", ROWS)
    config = tmp_path / "job.yaml"
    config.write_text(
        "train_dataset:\n  path: hf:json\n  data_files: [data/part.jsonl]\n  rename_columns: {question: prompt}\n"
    )
    monkeypatch.chdir("/")  # the data files resolve against the config file, not the working directory
    cfg = load_config(config, [])
    assert cfg.train_dataset.data_files == [str(tmp_path / "data" / "part.jsonl")]
    records = read_dataset(cfg.train_dataset, field="train_dataset")
    assert [r["prompt"] for r in records] == ["1+1", "2+3"]


def test_hub_only_fields_on_a_local_file_and_bad_values_are_config_errors():
    with pytest.raises(ConfigError) as info:
        load_config(None, [
            "train_dataset.path=d.jsonl", "train_dataset.name=main", "train_dataset.transform_fn=not a path",
            "valid_dataset.path=hf:org/data", "valid_dataset.dataset_kwargs={split: test}",
            "valid_dataset.rename_columns={a: prompt, b: prompt}", "valid_dataset.data_files=x.json",
        ])  # fmt: skip
    errors = info.value.errors
    assert any(e.startswith("train_dataset.name='main' is passed to `datasets.load_dataset`, which reads only `hf:`")
               and "remove train_dataset.name" in e for e in errors)  # fmt: skip
    assert any(e.startswith("train_dataset.transform_fn='not a path' is not an import path") for e in errors)
    assert any("valid_dataset.dataset_kwargs.split='test'" in e and "set valid_dataset.split instead" in e
               for e in errors)  # fmt: skip
    assert any("renames several columns to ['prompt']" in e for e in errors)
    assert any(e.startswith("valid_dataset.data_files='x.json': expected a list of") for e in errors)
    assert len(errors) == 5, errors
