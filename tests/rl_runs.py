"""Test helper shared by the `laden rl` tests: a run killed at a step, then rerun to resume."""

from __future__ import annotations

import pytest

from laden.rl import trainer as rl_trainer
from laden.rl.trainer import run_rl


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
