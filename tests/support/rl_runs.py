"""Test helpers shared by the `laden rl` tests: the tiny RL config, and a run killed at a step, then rerun."""

from __future__ import annotations

import asyncio
from importlib import resources

import pytest

from laden.config import load_config
from laden.rl import trainer as rl_trainer
from laden.rl.trainer import run_rl

ASSETS = resources.files("laden") / "assets"


def tiny_rl_config(tmp_path, *overrides):
    """The embedded tiny RL job (`laden/assets/rl_tiny.yaml`, with its held-out prompts) writing under `tmp_path`."""
    return load_config(
        str(ASSETS / "rl_tiny.yaml"),
        [f"actor.path={ASSETS / 'tiny'}", f"train_dataset.path={ASSETS / 'rl_tiny.jsonl'}",
         f"valid_dataset.path={ASSETS / 'rl_tiny_valid.jsonl'}", f"cluster.fileroot={tmp_path}", *overrides],
        job="rl",
    )  # fmt: skip


def lockstep(monkeypatch) -> None:
    """Make asynchronous runs (max_head_offpolicyness k > 0) generate the same batches whatever the timing:
    before step s trains, the producer has generated every batch it may (through s + k) and is idle, so
    batch b is always generated with the weights after step b - 1 - k. Without this, a loaded machine
    lets the trainer run ahead of generation and a batch may carry newer weights in one run than another."""
    original_produce, original_step = rl_trainer._Run._produce, rl_trainer._Run._step

    async def produce(self, first, queue, k):
        self._lockstep_next = first
        collect = self._collect_batch

        async def counted():
            out = await collect()
            self._lockstep_next += 1
            return out

        self._collect_batch = counted
        return await original_produce(self, first, queue, k)

    async def step(self, step, *args):
        ready = min(step + self.cfg.rollout.max_head_offpolicyness, self.total_steps)
        while getattr(self, "_lockstep_next", 0) <= ready or self._producing:  # 0: not started yet
            await asyncio.sleep(0.001)
        return await original_step(self, step, *args)

    monkeypatch.setattr(rl_trainer._Run, "_produce", produce)
    monkeypatch.setattr(rl_trainer._Run, "_step", step)


def crash_then_resume(cfg, monkeypatch, *, at_step: int):
    """Run `cfg` until step `at_step` raises KeyboardInterrupt (as Ctrl-C would), then run it again:
    the second run resumes from the last checkpoint; its result is returned."""
    original = rl_trainer._Run._step

    async def crash(self, step, *args):
        if step == at_step:
            raise KeyboardInterrupt
        return await original(self, step, *args)

    monkeypatch.setattr(rl_trainer._Run, "_step", crash)
    with pytest.raises(KeyboardInterrupt):
        run_rl(cfg, progress=False)
    monkeypatch.setattr(rl_trainer._Run, "_step", original)
    return run_rl(cfg, progress=False)
