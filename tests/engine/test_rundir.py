"""The run directory: one owner, one history; resume across engines and data-parallel sizes; OOM retry."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from laden.config import load_config
from laden.engine.oom import TrainingOOMError, is_host_oom, is_oom
from laden.engine.rundir import RunDirectory, RunDirectoryError
from laden.sft.trainer import run_sft

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = ("total_train_steps=4", "train_dataset.batch_size=8", "checkpoint.export_hf=false")


def _cfg(root: Path, trial: str, *extra: str):
    return load_config(
        "examples/sft_tiny.yaml", [f"cluster.fileroot={root}", f"trial_name={trial}", *BASE, *extra]
    )


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors")


def _interrupt_at(monkeypatch, step: int) -> None:
    """Make the next run raise KeyboardInterrupt when it starts step `step`."""
    import laden.sft.trainer as trainer

    original = trainer.train_step

    def interrupted(cfg, rt, engine, samples, indices, *, step: int):
        if step == stop_at:
            raise KeyboardInterrupt("simulated Ctrl-C")
        return original(cfg, rt, engine, samples, indices, step=step)

    stop_at = step
    monkeypatch.setattr(trainer, "train_step", interrupted)


def test_final_checkpoint_and_a_finished_rerun_trains_nothing(tmp_path, caplog):
    first = run_sft(_cfg(tmp_path, "t", "checkpoint.save_freq_steps=null"), progress=False)
    assert (first.run_dir / "checkpoints" / "step_4" / "trainer.json").exists()  # saved at the end
    assert first.first_loss is not None and first.last_loss is not None
    caplog.set_level(logging.WARNING, logger="laden.sft")
    again = run_sft(_cfg(tmp_path, "t", "checkpoint.save_freq_steps=null"), progress=False)
    assert again.already_finished and again.last_loss == first.last_loss
    assert "already holds a finished run (step 4 of 4" in caplog.text
    assert [r["step"] for r in _rows(first.run_dir)] == [1, 2, 3, 4]  # nothing appended


def test_interrupt_writes_a_checkpoint_and_resume_drops_the_repeated_steps(tmp_path, monkeypatch):
    straight = run_sft(_cfg(tmp_path, "straight"), progress=False)
    _interrupt_at(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        run_sft(_cfg(tmp_path, "resumed"), progress=False)
    run = tmp_path / "sft-tiny" / "resumed"
    assert (run / "checkpoints" / "step_3").exists()  # written on the interrupt
    # As if metrics of a step after the checkpoint had been written before a crash:
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 4, "loss": 123.0}) + "\n")
    monkeypatch.undo()
    resumed = run_sft(_cfg(tmp_path, "resumed"), progress=False)
    assert [r["step"] for r in _rows(resumed.run_dir)] == [1, 2, 3, 4]
    assert [r["loss"] for r in _rows(resumed.run_dir)] == [r["loss"] for r in _rows(straight.run_dir)]
    a, b = _weights(straight.run_dir, 4), _weights(resumed.run_dir, 4)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_second_run_on_a_held_directory_is_refused(tmp_path):
    cfg = _cfg(tmp_path, "held")
    holder = RunDirectory(cfg.run_dir, is_main=True)
    holder.acquire(command="laden sft (the first run)")
    try:
        with pytest.raises(RunDirectoryError, match=r"is in use by pid \d+ .*the first run"):
            run_sft(cfg, progress=False)
        assert not (cfg.run_dir / "metrics.jsonl").exists()
    finally:
        holder.release()
    run_sft(cfg, progress=False)  # released: the run goes ahead


def test_a_crashed_holder_leaves_no_stuck_lock(tmp_path):
    cfg = _cfg(tmp_path, "crashed")
    script = textwrap.dedent(f"""
        import os
        from laden.engine.rundir import RunDirectory
        RunDirectory({str(cfg.run_dir)!r}, is_main=True).acquire(command="doomed")
        os._exit(1)  # dies holding the lock
    """)
    subprocess.run([sys.executable, "-c", script], check=False)
    assert "doomed" in (cfg.run_dir / ".lock").read_text()
    run_sft(cfg, progress=False)


def test_resume_applies_a_changed_learning_rate_and_says_so(tmp_path, monkeypatch, caplog):
    _interrupt_at(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        run_sft(_cfg(tmp_path, "lr"), progress=False)
    monkeypatch.undo()
    caplog.set_level(logging.WARNING, logger="laden.sft")
    run_sft(_cfg(tmp_path, "lr", "actor.optimizer.lr=1e-4"), progress=False)
    assert (
        "resuming with a changed actor.optimizer.lr: 0.003 -> 0.0001 (takes effect from step 3)"
        in caplog.text
    )
    rows = _rows(tmp_path / "sft-tiny" / "lr")
    # the schedule of the new run: cosine over 4 steps, warm-up ceil(0.05 * 4) = 1 step
    import math

    want = 1e-4 * 0.5 * (1 + math.cos(math.pi * (2 - 1) / 3))
    assert rows[2]["lr"] == pytest.approx(want)
    assert rows[1]["lr"] == pytest.approx(3e-3 * 0.5 * (1 + math.cos(math.pi * (1 - 1) / 3)))


def test_resume_with_a_changed_batch_size_is_refused_before_the_directory_changes(tmp_path, monkeypatch):
    _interrupt_at(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        run_sft(_cfg(tmp_path, "bs"), progress=False)
    monkeypatch.undo()
    run = tmp_path / "sft-tiny" / "bs"
    before = {p: p.read_bytes() for p in (run / "config.yaml", run / "metrics.jsonl")}
    with pytest.raises(RunDirectoryError, match=r"train_dataset\.batch_size: 8 -> 4.*set them back"):
        run_sft(_cfg(tmp_path, "bs", "train_dataset.batch_size=4"), progress=False)
    assert {p: p.read_bytes() for p in before} == before


def test_resume_never_on_a_run_with_history_is_refused(tmp_path):
    run_sft(_cfg(tmp_path, "never"), progress=False)
    with pytest.raises(
        RunDirectoryError, match="checkpoint.resume=never but run directory .* already holds a run"
    ):
        run_sft(_cfg(tmp_path, "never", "checkpoint.resume=never"), progress=False)
    assert [r["step"] for r in _rows(tmp_path / "sft-tiny" / "never")] == [1, 2, 3, 4]


def test_an_old_format_checkpoint_is_refused_with_the_fix(tmp_path):
    run = tmp_path / "sft-tiny" / "old" / "checkpoints" / "step_2"
    run.mkdir(parents=True)
    (run / "trainer.json").write_text('{"step": 2}')
    with pytest.raises(RunDirectoryError, match="written by an older laden .* set trial_name to a new name"):
        run_sft(_cfg(tmp_path, "old"), progress=False)


@pytest.mark.parametrize("first,second", [("fsdp:d1", "roundpipe:d1"), ("roundpipe:d1", "fsdp:d1")])
def test_resume_under_another_engine_equals_uninterrupted(tmp_path, monkeypatch, first, second):
    straight = run_sft(_cfg(tmp_path, "straight", f"actor.backend={second}"), progress=False)
    _interrupt_at(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        run_sft(_cfg(tmp_path, "switched", f"actor.backend={first}"), progress=False)
    monkeypatch.undo()
    switched = run_sft(_cfg(tmp_path, "switched", f"actor.backend={second}"), progress=False)
    a, b = _weights(straight.run_dir, 4), _weights(switched.run_dir, 4)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5, msg=key)
    meta = json.loads((switched.run_dir / "checkpoints" / "step_4" / "meta.json").read_text())
    assert meta["backend"] == second


def test_host_allocator_errors_are_host_ooms_and_get_host_advice(tmp_path, monkeypatch):
    """torch's CPU allocator error is a host OOM: it is retried like a GPU one, and reported with host knobs."""
    host_error = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 34359738368 bytes. Error code 12 (Cannot allocate memory)"
    )
    assert is_oom(host_error) and is_host_oom(host_error)
    assert not is_host_oom(torch.OutOfMemoryError("CUDA out of memory"))
    never = run_sft(_cfg(tmp_path, "never", "actor.mb_spec.max_tokens_per_mb=256"), progress=False)

    import laden.sft.trainer as trainer

    original = trainer.step_micro_batches
    failures = {"n": 0}

    def host_oom_on_big(cfg, rt, samples, indices, tokens_per_mb):
        if tokens_per_mb > 256:
            failures["n"] += 1
            raise host_error
        return original(cfg, rt, samples, indices, tokens_per_mb)

    monkeypatch.setattr(trainer, "step_micro_batches", host_oom_on_big)
    retried = run_sft(_cfg(tmp_path, "retried", "oom_policy=auto"), progress=False)
    assert failures["n"] == 4
    a, b = _weights(never.run_dir, 4), _weights(retried.run_dir, 4)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    with pytest.raises(TrainingOOMError, match=r"ran out of host memory.*\n.*\n.*adam_bf16") as info:
        run_sft(_cfg(tmp_path, "raised"), progress=False)
    assert info.value.where == "host"


def _sft_rank(rank: int, world_size: int, root: str, trial: str, fail_rank: int | None) -> list[float]:
    """A worker of `tests/support/workers.py`: `laden sft` as one rank of fsdp:d2, optionally failing to place
    its micro-batches once per step on `fail_rank` while they are larger than 128 tokens."""
    import laden.sft.trainer as trainer

    if fail_rank == rank:
        original = trainer.step_micro_batches

        def oom_when_big(cfg, samples, indices, device, tokens_per_mb):
            if tokens_per_mb > 128:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
            return original(cfg, samples, indices, device, tokens_per_mb)

        trainer.step_micro_batches = oom_when_big
    extra = ["actor.backend=fsdp:d2", "cluster.n_gpus_per_node=2", "oom_policy=auto"]
    if fail_rank is None:
        extra.append("actor.mb_spec.max_tokens_per_mb=128")
    run_sft(_cfg(Path(root), trial, *extra), progress=False)
    return [r["loss"] for r in _rows(Path(root) / "sft-tiny" / trial)] if rank == 0 else []


def test_torchrun_oom_on_one_rank_resplits_on_both_and_equals_never_failed(tmp_path):
    from workers import run_workers

    never = run_workers(_sft_rank, 2, str(tmp_path), "never", None)[0]
    retried = run_workers(_sft_rank, 2, str(tmp_path), "retried", 1)[0]
    assert retried == never
    a = _weights(tmp_path / "sft-tiny" / "never", 4)
    b = _weights(tmp_path / "sft-tiny" / "retried", 4)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _resume_rank(rank: int, world_size: int, root: str) -> None:
    run_sft(
        _cfg(Path(root), "resharded", "actor.backend=fsdp:d2", "cluster.n_gpus_per_node=2"), progress=False
    )


def test_resume_at_another_data_parallel_size_equals_uninterrupted(tmp_path, monkeypatch):
    from workers import run_workers

    straight = run_sft(_cfg(tmp_path, "straight"), progress=False)
    _interrupt_at(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        run_sft(_cfg(tmp_path, "resharded"), progress=False)
    monkeypatch.undo()
    run_workers(_resume_rank, 2, str(tmp_path))
    a, b = _weights(straight.run_dir, 4), _weights(tmp_path / "sft-tiny" / "resharded", 4)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5, msg=key)
    meta = json.loads(
        (tmp_path / "sft-tiny" / "resharded" / "checkpoints" / "step_4" / "meta.json").read_text()
    )
    assert meta["dp_size"] == 2


def test_a_run_that_stopped_before_its_first_checkpoint_starts_over_cleanly(tmp_path, monkeypatch):
    """A crash before any checkpoint (not Ctrl-C: nothing was written) leaves metrics to drop, not to mix."""
    import laden.sft.trainer as trainer

    original = trainer.train_step

    def crash_at_three(cfg, rt, engine, samples, indices, *, step: int):
        if step == 3:
            raise RuntimeError("simulated crash")
        return original(cfg, rt, engine, samples, indices, step=step)

    monkeypatch.setattr(trainer, "train_step", crash_at_three)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_sft(_cfg(tmp_path, "crash"), progress=False)
    run = tmp_path / "sft-tiny" / "crash"
    assert [r["step"] for r in _rows(run)] == [1, 2] and not (run / "checkpoints").exists()
    monkeypatch.undo()
    run_sft(_cfg(tmp_path, "crash"), progress=False)
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4]
