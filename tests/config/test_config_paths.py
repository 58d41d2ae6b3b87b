"""Paths in a config file resolve against the file's directory; absolute paths, and paths on the command
line, against the working directory; `hf:` names and Hub ids stay as written; the error for a path that
does not exist names the rule that made it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from repo_paths import ROOT

from laden.config import ConfigError, dump_config, load_config

ASSETS = ROOT / "laden" / "assets"


def _job(directory: Path, **lines: str) -> Path:
    """A config in `directory/configs/` whose model and data sit in `directory/` (relative `../`)."""
    shutil.copytree(ASSETS / "tiny", directory / "model")
    shutil.copy(ASSETS / "sft_tiny.jsonl", directory / "train.jsonl")
    (directory / "configs").mkdir()
    config = directory / "configs" / "job.yaml"
    body = {"actor": "  path: ../model", "train_dataset": "  path: ../train.jsonl", **lines}
    config.write_text("".join(f"{section}:\n{text}\n" for section, text in body.items()))
    return config


def test_config_in_a_subdirectory_loads_from_another_working_directory(tmp_path, monkeypatch):
    config = _job(tmp_path, cluster="  fileroot: ../out")
    monkeypatch.chdir(ROOT)
    cfg = load_config(str(config), [], job="sft")
    assert cfg.actor.path == str(tmp_path / "model")
    assert cfg.train_dataset.path == str(tmp_path / "train.jsonl")
    assert cfg.cluster.fileroot == str(tmp_path / "out")


def test_overrides_resolve_against_the_working_directory(tmp_path, monkeypatch):
    config = _job(tmp_path / "job")
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(ASSETS / "sft_tiny.jsonl", tmp_path / "elsewhere" / "other.jsonl")
    monkeypatch.chdir(tmp_path / "elsewhere")
    cfg = load_config(
        str(config), ["train_dataset.path=other.jsonl", "valid_dataset={path: other.jsonl}"], job="sft"
    )
    assert cfg.train_dataset.path == str(tmp_path / "elsewhere" / "other.jsonl")
    assert cfg.valid_dataset is not None and cfg.valid_dataset.path == cfg.train_dataset.path
    assert cfg.cluster.fileroot == str(
        tmp_path / "elsewhere" / "runs"
    )  # the default, in the working directory
    assert cfg.actor.path == str(tmp_path / "job" / "model")  # from the file: against its directory


def test_repository_examples_load_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("examples/sft_tiny.yaml", "examples/rl_tiny.yaml", "laden/assets/sft_tiny.yaml"):
        cfg = load_config(str(ROOT / name), [])
        assert cfg.actor.path == str(ASSETS / "tiny"), name
        assert Path(cfg.train_dataset.path).is_file(), name


def test_hf_names_and_hub_ids_stay_as_written(tmp_path, monkeypatch):
    config = tmp_path / "job.yaml"
    config.write_text(
        "actor:\n  path: Qwen/Qwen3-0.6B\ntrain_dataset:\n  path: hf:openai/gsm8k\n  name: main\n"
    )
    monkeypatch.chdir("/")
    cfg = load_config(str(config), ["valid_dataset.path=org/held_out"], job="any")
    assert cfg.actor.path == "Qwen/Qwen3-0.6B"
    assert cfg.train_dataset.path == "hf:openai/gsm8k"
    assert cfg.valid_dataset is not None and cfg.valid_dataset.path == "org/held_out"


def test_error_for_a_missing_path_names_the_rule(tmp_path, monkeypatch, caplog):
    config = _job(tmp_path)
    config.write_text(config.read_text().replace("../model", "model"))  # written as if from tmp_path
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(str(config), [], job="sft")
    (error,) = info.value.errors
    assert error.startswith(f"actor.path={str(tmp_path / 'configs' / 'model')!r} does not exist")
    assert f"'model', written in the config file {config}, is relative to {tmp_path / 'configs'} (the config " \
           "file's directory)" in error  # fmt: skip
    with pytest.raises(ConfigError) as info:
        load_config(str(config), ["actor.path=missing_model"], job="sft")
    (error,) = info.value.errors
    assert f"'missing_model', given on the command line (or a default), is relative to {tmp_path} (the " \
           "working directory)" in error  # fmt: skip
    caplog.clear()
    load_config(str(config), ["actor.path=model", "train_dataset.path=nothing.jsonl"], job="sft")
    assert f"train_dataset.path={str(tmp_path / 'nothing.jsonl')!r} does not exist" in caplog.text
    assert "given on the command line" in caplog.text


def test_written_config_reads_back_the_same_from_elsewhere(tmp_path, monkeypatch):
    config = _job(tmp_path)
    cfg = load_config(str(config), [], job="sft")
    dump_config(cfg, tmp_path / "run" / "config.yaml")
    monkeypatch.chdir(tmp_path / "run")
    assert load_config(str(tmp_path / "run" / "config.yaml"), [], job="sft") == cfg
