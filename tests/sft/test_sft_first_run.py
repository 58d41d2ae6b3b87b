"""The embedded `laden sft` job teaches something visible: held-out sums answered before -> after training."""

from __future__ import annotations

import json
import re

import pytest

from laden.cli import _embedded_default, main
from laden.config import load_config
from laden.data import read_dataset
from laden.data.overlap import prompt_overlap

pytestmark = pytest.mark.usefixtures("one_thread")


def _default(*overrides: str):
    config, defaults = _embedded_default()
    return load_config(config, [*defaults, *overrides], job="sft")


def test_default_held_out_sums_are_not_training_sums():
    cfg = _default()
    assert cfg.valid_dataset is not None
    train = read_dataset(cfg.train_dataset, field="train_dataset")
    held_out = read_dataset(cfg.valid_dataset, field="valid_dataset")
    overlap = prompt_overlap(train, held_out)
    assert overlap.num_held_out == len(held_out) > 0 and overlap.num_shared == 0, overlap.summary()
    pairs = lambda rows: {tuple(int(x) for x in re.findall(r"\d+", r["prompt"])) for r in rows}  # noqa: E731
    assert not pairs(train) & pairs(held_out)  # the same (a, b) never appears on both sides
    assert all(
        int(r["completion"]) == sum(int(x) for x in re.findall(r"\d+", r["prompt"]))
        for r in [*train, *held_out]
    )


def test_default_job_evaluates_held_out_accuracy_before_and_after():
    cfg = _default()
    assert cfg.evaluator.generate and cfg.evaluator.eval_before_train
    assert cfg.evaluator.freq_epochs is None and cfg.evaluator.freq_steps is None  # only before and after


def test_short_default_run_logs_accuracy_at_step_0_and_the_end(tmp_path, capsys):
    argv = ["sft", "--no-progress", f"cluster.fileroot={tmp_path}", "total_train_steps=3",
            "checkpoint.save_freq_steps=null", "checkpoint.export_hf=false"]  # fmt: skip
    assert main(argv) == 0
    rows = [
        json.loads(x) for x in (tmp_path / "sft-tiny" / "run0" / "metrics.jsonl").read_text().splitlines()
    ]
    accuracy = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    assert sorted(accuracy) == [0, 3] and all(0.0 <= a <= 1.0 for a in accuracy.values())
    out = capsys.readouterr().out
    assert f"held-out accuracy {accuracy[0]:.3f} -> {accuracy[3]:.3f} (20 prompts, exact match)" in out
    samples = [line for line in out.splitlines() if " -> " in line and "(reference " in line]
    assert len(samples) == 3, out
