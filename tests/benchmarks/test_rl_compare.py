"""benchmarks/rl_compare.py: time to the same reward of synchronous against asynchronous runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from benchmark_scripts import BENCH, load_script
from rl_runs import tiny_rl_config

from laden.rl.trainer import run_rl

rl_compare = load_script(BENCH / "rl_compare.py")


def _rows(rewards, seconds, accuracy=None):
    return [
        {
            "step": i + 1,
            "reward_mean": r,
            "elapsed_s": t,
            **({} if accuracy is None else {"accuracy": accuracy[i]}),
        }
        for i, (r, t) in enumerate(zip(rewards, seconds))
    ]


def test_the_moving_mean_equals_a_plain_one():
    values = [0.3, 0.1, 0.9, 0.4, 0.0, 0.7, 0.2]
    for window in (1, 2, 3, 10):
        plain = [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                 for i in range(len(values))]  # fmt: skip
        assert rl_compare.smoothed(values, window) == pytest.approx(plain)


def test_time_to_the_same_reward_and_the_speedup():
    sync = _rows([0.0, 0.2, 0.4, 0.6, 0.8], [10, 20, 30, 40, 50], accuracy=[0, 0, 0.5, 0.5, 0.6])
    fast = _rows([0.0, 0.3, 0.5, 0.6, 0.7], [4, 8, 12, 16, 20], accuracy=[0, 0, 0.4, 0.6, 0.7])
    records = rl_compare.compare({"k0": sync, "k4": fast}, window=2)
    # smoothed: sync 0, .1, .3, .5, .7 (max .7); fast 0, .15, .4, .55, .65 (max .65): the same reward is .65
    by = {r["label"]: r for r in records if "label" in r}
    assert by["k0"]["target_reward"] == 0.65
    assert (by["k0"]["step_to_target"], by["k0"]["seconds_to_target"]) == (5, 50)
    assert (by["k4"]["step_to_target"], by["k4"]["seconds_to_target"]) == (5, 20)
    assert by["k0"]["final_accuracy"] == pytest.approx(0.55)
    assert by["k4"]["final_accuracy"] == pytest.approx(0.65)
    summary = records[-1]
    assert summary["summary"] and summary["reference"] == "k0"
    assert summary["speedup_k4"] == 2.5 and summary["accuracy_gap_k4"] == pytest.approx(0.1)


def test_a_target_no_run_reaches_gives_no_time_and_held_out_accuracy_wins():
    records = rl_compare.compare(
        {"a": _rows([0.1, 0.2], [1, 2]), "b": _rows([0.1, 0.3], [1, 3])}, window=1, target=0.25,
        accuracy={"a": 0.5, "b": 0.25},
    )  # fmt: skip
    assert records[0]["seconds_to_target"] is None and records[1]["seconds_to_target"] == 3
    assert records[-1]["speedup_b"] is None and records[-1]["accuracy_gap_b"] == -0.25


def test_on_two_real_runs_at_offpolicyness_0_and_2(tmp_path):
    dirs = []
    for k in (0, 2):
        cfg = tiny_rl_config(tmp_path / f"k{k}", "total_train_steps=6", f"rollout.max_head_offpolicyness={k}")
        dirs.append(run_rl(cfg, progress=False).run_dir)
    out = subprocess.run(
        [sys.executable, str(BENCH / "rl_compare.py"), *map(str, dirs), "--labels", "k0", "k2", "--window", "2",
         "--accuracy", "k2=0.5"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r.get("label") for r in records] == ["k0", "k2", None]
    assert all(r["steps"] == 6 and r["seconds_to_target"] is not None for r in records[:2])  # the same reward
    # both runs evaluated on held-out prompts: that is their final accuracy, and the time to the same one
    assert records[1]["final_accuracy_source"] == "eval/accuracy" and "speedup_k2" in records[2]
    assert (
        all(r["seconds_to_accuracy"] is not None for r in records[:2]) and "speedup_accuracy_k2" in records[2]
    )


def test_time_to_the_same_held_out_accuracy():
    slow = _rows([0.1, 0.2, 0.3, 0.4], [10, 20, 30, 40])
    fast = _rows([0.1, 0.2, 0.3, 0.4], [5, 10, 15, 20])
    slow += [{"step": 0, "elapsed_s": 0, "eval/accuracy": 0.1}, {"step": 2, "elapsed_s": 20, "eval/accuracy": 0.3},
             {"step": 4, "elapsed_s": 40, "eval/accuracy": 0.5}]  # fmt: skip
    fast += [{"step": 0, "elapsed_s": 0, "eval/accuracy": 0.1}, {"step": 2, "elapsed_s": 10, "eval/accuracy": 0.5},
             {"step": 4, "elapsed_s": 20, "eval/accuracy": 0.6}]  # fmt: skip
    records = rl_compare.compare({"slow": slow, "fast": fast}, window=1)
    # the best accuracy the weaker run reaches (0.5): slow at 40 s, fast at 10 s
    assert [r["seconds_to_accuracy"] for r in records[:2]] == [40, 10] and records[0][
        "target_accuracy"
    ] == 0.5
    assert records[-1]["speedup_accuracy_fast"] == 4.0 and records[-1]["accuracy_gap_fast"] == pytest.approx(
        0.1
    )
    assert records[0]["steps"] == 4  # the training rows only


def test_rows_without_elapsed_seconds_are_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.1}) + "\n")
    with pytest.raises(SystemExit, match="no elapsed_s"):
        rl_compare.load(tmp_path)
