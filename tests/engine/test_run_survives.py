"""A run that survives interruptions: SIGINT and SIGTERM checkpoint the last finished step in both jobs and
exit with a one-line message; a time-based checkpoint bounds what a kill loses; an asynchronous RL run
killed and resumed equals the uninterrupted one."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from rl_runs import ASSETS, tiny_rl_config
from safetensors.torch import load_file

from laden.cli import main
from laden.config import load_config
from laden.engine.signals import RunInterrupted
from laden.rl import trainer as rl_trainer
from laden.rl.trainer import run_rl
from laden.sft.trainer import run_sft

pytestmark = [pytest.mark.usefixtures("one_thread")]


def _rows(run_dir) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if r["step"] > 0]


def _weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors")


def _same_weights(a, b) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _sft_cfg(tmp_path, trial: str, *extra: str):
    return load_config("examples/sft_tiny.yaml", [f"cluster.fileroot={tmp_path}", f"trial_name={trial}",
                       "total_train_steps=6", "train_dataset.batch_size=8", "checkpoint.save_freq_steps=null",
                       "checkpoint.export_hf=false", *extra], job="sft")  # fmt: skip


def _signal_at(monkeypatch, cls, name: str, at_call: int, signum: int) -> None:
    """Send `signum` to this process during the `at_call`-th call of `cls.name` (a step in progress)."""
    original, calls = getattr(cls, name), {"n": 0}

    def sending(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at_call:
            os.kill(os.getpid(), signum)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, sending)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sft_stops_at_a_signal_after_checkpointing_the_step_and_resumes_bitwise(
    tmp_path, monkeypatch, signum
):
    from laden.engine.fsdp.engine import FSDPEngine

    straight = run_sft(_sft_cfg(tmp_path, "straight"), progress=False)
    _signal_at(monkeypatch, FSDPEngine, "train_batch", 3, signum)  # during step 3: it finishes, then stops
    with pytest.raises(
        RunInterrupted, match=rf"{signal.Signals(signum).name}: stopped after step 3, checkpointed"
    ) as info:
        run_sft(_sft_cfg(tmp_path, "stopped"), progress=False)
    assert info.value.exit_status == 128 + signum
    stopped = tmp_path / "sft-tiny" / "stopped"
    assert (stopped / "checkpoints" / "step_3").is_dir() and [r["step"] for r in _rows(stopped)] == [1, 2, 3]
    monkeypatch.undo()
    resumed = run_sft(_sft_cfg(tmp_path, "stopped"), progress=False)
    _same_weights(_weights(straight.run_dir, 6), _weights(resumed.run_dir, 6))


def test_rl_stops_at_sigterm_after_checkpointing_the_step_and_resumes_bitwise(tmp_path, monkeypatch, capsys):
    args = ["total_train_steps=6", "~valid_dataset"]
    straight = run_rl(tiny_rl_config(tmp_path / "a", *args), progress=False)
    _signal_at(monkeypatch, rl_trainer._Run, "_train_on", 2, signal.SIGTERM)
    overrides = [f"actor.path={ASSETS / 'tiny'}", f"train_dataset.path={ASSETS / 'rl_tiny.jsonl'}",
                 f"cluster.fileroot={tmp_path / 'b'}", *args]  # fmt: skip
    assert (
        main(["rl", "--no-progress", "--config", str(ASSETS / "rl_tiny.yaml"), *overrides])
        == 128 + signal.SIGTERM
    )
    assert "SIGTERM: stopped after step 2, checkpointed; rerun the same command" in capsys.readouterr().err
    monkeypatch.undo()
    resumed = run_rl(tiny_rl_config(tmp_path / "b", *args), progress=False)
    assert resumed.rewards == straight.rewards[2:]
    _same_weights(_weights(straight.run_dir, 6), _weights(resumed.run_dir, 6))


def test_a_time_based_checkpoint_bounds_what_a_kill_loses(tmp_path, monkeypatch):
    clock = {"t": 0.0}

    def minutes_pass() -> float:  # every read of the clock: 10 minutes later
        clock["t"] += 600.0
        return clock["t"]

    monkeypatch.setattr("laden.engine.signals.now", minutes_pass)
    result = run_rl(tiny_rl_config(tmp_path, "total_train_steps=4", "~valid_dataset", "checkpoint.keep_last=10",
                                   "checkpoint.save_every_minutes=15"), progress=False)  # fmt: skip
    saved = sorted(int(p.name.split("_")[1]) for p in (result.run_dir / "checkpoints").iterdir())
    # each read of the clock adds 10 minutes: 20 have passed after step 2 (saved, and read again), 10 after step 3
    assert saved == [2, 4]


def test_an_asynchronous_run_killed_and_resumed_equals_the_uninterrupted_one(tmp_path, monkeypatch):
    """With max_head_offpolicyness 2 the batches generated ahead of a checkpoint are checkpointed with it,
    so the resumed run trains on what the uninterrupted one trained on, bitwise, and counts no episode twice."""
    from rl_runs import crash_then_resume, lockstep

    args = ["total_train_steps=8", "rollout.max_head_offpolicyness=2", "checkpoint.save_freq_steps=3"]
    lockstep(monkeypatch)  # every run generates batch b with the weights after step b - 3, however loaded
    full = run_rl(tiny_rl_config(tmp_path / "a", *args), progress=False)
    for at_step in (5, 7):
        cfg = tiny_rl_config(tmp_path / f"k{at_step}", *args)
        resumed = crash_then_resume(cfg, monkeypatch, at_step=at_step)
        done = 3 if at_step < 7 else 6
        assert resumed.rewards == full.rewards[done:], at_step
        a, b = _rows(full.run_dir), _rows(resumed.run_dir)
        # (a row's `episodes` counts what the producer has generated by then: a matter of timing)
        assert [(r["trained"], r["loss"], r["reward_mean"]) for r in a] == [
            (r["trained"], r["loss"], r["reward_mean"]) for r in b
        ]
        assert b[-1]["episodes"] == a[-1]["episodes"]
        _same_weights(_weights(full.run_dir, 8), _weights(resumed.run_dir, 8))
    assert a[-1]["episodes"] == 8 * 8  # no batch generated twice


@pytest.mark.parametrize("job", ["sft", "rl"])
def test_a_run_killed_before_its_export_is_exported_by_the_rerun(tmp_path, monkeypatch, job):
    from laden.engine.fsdp.engine import FSDPEngine
    from laden.model.hf.export import export_complete

    def killed(self, *args, **kwargs):
        raise KeyboardInterrupt  # the process dies after its final checkpoint, before hf/ is in place

    if job == "sft":
        cfg = _sft_cfg(tmp_path, "run", "checkpoint.export_hf=true", "total_train_steps=2")
        run = run_sft
    else:
        cfg = tiny_rl_config(tmp_path, "total_train_steps=2", "~valid_dataset", "checkpoint.export_hf=true")
        run = run_rl
    monkeypatch.setattr(FSDPEngine, "export_hf", killed)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, progress=False)
    monkeypatch.undo()
    result = run(cfg, progress=False)
    assert result.already_finished and export_complete(result.run_dir / "hf")
