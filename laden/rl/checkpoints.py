"""`laden rl`'s checkpoints: what a checkpoint holds beyond the engines' state (the data position, the
counters, the weight version, every rank's sampling state and the batches generated ahead of it), and
resuming from one, bitwise for synchronous runs and for the batches an asynchronous run had in flight."""

from __future__ import annotations

import logging
from typing import Any

from laden.config import format_config
from laden.engine.checkpoint import (
    checkpoint_meta,
    keep_new_hyperparameters,
    load_checkpoint,
    save_checkpoint,
)
from laden.errors import RewardFailureError
from laden.rl.producer import decode_batch
from laden.rl.run_part import RunPart

log = logging.getLogger("laden.rl")


class Checkpoints(RunPart):
    """The checkpoints of a `laden rl` run (a part of `laden.rl.trainer._Run`)."""

    def _resume(self, history, changes) -> int:
        if history.checkpoint is None or self.cfg.checkpoint.resume == "never":
            for line in changes:
                log.warning("%s", line)
            self.run.keep_metrics_through(-1)  # the evaluation before training (step 0) runs again too
            return 0
        step = history.checkpoint_step
        state = load_checkpoint(
            history.checkpoint,
            self.engine,
            rank=self.rt.rank,
            keep=keep_new_hyperparameters(self.engine, self.settings, step),
            others=None if self.critic is None else {"critic": (self.critic.engine, self.critic.keep(step))},
        )
        data = state["data"]
        self.batches.load_state_dict(data["batches"])
        self._carry = [int(i) for i in data.get("carry", [])]
        rl_state = dict(state.get("rl", {}))
        self._rollout_rng = _own_rng(rl_state, self.rt.rank, self.rt.world_size)
        pending = rl_state.pop("pending", [])
        if (
            len(pending) == self.rt.world_size
        ):  # each rank its own batches (a changed world size regenerates them)
            self._pending = [decode_batch(b) for b in pending[self.rt.rank]]
        self.counters.load(rl_state)
        for line in changes:
            log.warning("%s (takes effect from step %d)", line, step + 1)
        self.run.keep_metrics_through(step)
        log.info("resumed from %s (weight version %d)", history.checkpoint, self.engine.version)
        return step

    def _rng_state(self, mine: Any = None) -> dict[str, Any]:
        """The rollout engines' sampling states (`RolloutEngine.sampling_state`), every rank's (each
        samples its own share of a batch), so a resumed run samples what it would have: the engine's
        now, or `mine` (a state taken earlier). Every rank calls it (`_save`)."""
        if mine is None:
            mine = self.rollout.sampling_state()
        every = self._gather(mine)
        if every[0] is None:
            return {}
        return {"rollout_rng": every[0], "rollout_rng_ranks": every}

    def _save(
        self, step: int, data_state: dict[str, Any], rng: Any = None, pending: list[Any] | None = None
    ) -> None:
        """Checkpoint `step` with the data position after its batch; `rng`: this rank's sampling state to
        store (default the engine's now); `pending`: the batches generated ahead (`encode_batch`)."""
        cfg = self.cfg
        meta = checkpoint_meta(cfg, self.engine)
        rl_state = {**self.counters.state(), **self._rng_state(rng), "pending": self._gather(pending or [])}
        save_checkpoint(
            self.run.ckpt_root, step=step, engine=self.engine,
            trainer_state={"data": data_state, "rl": rl_state}, meta=meta,
            config_yaml=format_config(cfg), keep_last=cfg.checkpoint.keep_last, rank=self.rt.rank,
            barrier=self.rt.barrier, any_rank=self.rt.any_rank,
            others=None if self.critic is None else {"critic": self.critic.engine},
        )  # fmt: skip
        self._saved_step = step

    def _save_before(self, step: int, failure: RewardFailureError, previous: Any, item: Any) -> None:
        """After step `step`'s rewards failed: a checkpoint of step `step - 1` (nothing trained on the failed
        batch yet), whose data position and sampling state are those before that batch was drawn, so a rerun
        with a fixed reward draws it again. Said in the failure's message."""
        if step - 1 <= self._saved_step or previous is None:
            failure.note(f"the newest checkpoint holds step {self._saved_step}; a rerun resumes from it")
            return
        self.counters.load(self._counters_before)
        self._save(step - 1, previous[1], rng=item[3])
        failure.note(
            f"a checkpoint of step {step - 1} was written; a rerun of the same command resumes from it"
        )


def _own_rng(rl_state: dict[str, Any], rank: int, world_size: int) -> Any:
    """This rank's sampling state from a checkpoint's `rl` state (its entries removed):
    its own when the checkpoint was written by as many ranks, else rank 0's (with a warning on a
    change of world size: the resumed run samples other completions than an uninterrupted one)."""
    first = rl_state.pop("rollout_rng", None)
    every = rl_state.pop("rollout_rng_ranks", None)
    if every is not None and len(every) == world_size:
        return every[rank]
    if first is not None and world_size > 1 and rank == 0:
        log.warning(
            "the checkpoint holds the sampling state of %s rank(s) and this run has %d: every rank starts "
            "from rank 0's, so rollouts differ from an uninterrupted run's", len(every) if every else 1, world_size,
        )  # fmt: skip
    return first
