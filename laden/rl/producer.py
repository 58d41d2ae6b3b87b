"""`laden rl`'s producer: batches of trajectories generated at most `rollout.max_head_offpolicyness`
ahead of the trainer, rejected groups refilled from the next prompts, and checkpoints that carry
the batches generated ahead of them (so an asynchronous run resumes exactly)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from laden.config import LadenConfig
from laden.data import read_dataset
from laden.engine.oom import PhaseOOMError, is_oom
from laden.rl.run_part import RunPart
from laden.rl.weight_sync import phase_oom_fixes

log = logging.getLogger("laden.rl")


DEFAULT_WORKFLOWS = ("laden.rl.workflow:RLVRWorkflow", "laden.rl.workflow:MultiTurnWorkflow")


def read_prompt_rows(cfg: LadenConfig, ds: Any, field: str) -> Any:
    """A dataset's rows, each checked once here: a JSON object with a prompt the workflow can render (laden's
    own workflows; a custom one reads its own fields). A bad row stops the run naming its file and line, or
    with `<field>.on_bad_row: skip` is left out (counted in the log)."""
    from laden.data.rows import check_prompt_rows

    records = read_dataset(ds, field=field)
    if cfg.workflow in DEFAULT_WORKFLOWS:
        records, _ = check_prompt_rows(records, on_bad_row=ds.on_bad_row, field=field)
    return records


def _jsonable(value: Any) -> Any:
    """`value` with tuples, numpy and torch scalars and arrays as JSON types (a row's fields may hold them)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def encode_batch(groups: list[list[Any]], gen_s: float) -> dict[str, Any]:
    """A generated batch (groups of `Trajectory`s) as JSON data, for a checkpoint (nothing is pickled)."""
    from dataclasses import asdict

    return {"gen_s": gen_s, "groups": [[_jsonable(asdict(t)) for t in g] for g in groups]}


def decode_batch(data: dict[str, Any]) -> tuple[list[list[Any]], None, float, None]:
    """`encode_batch`'s batch back as the producer's queue item."""
    from laden.rl.workflow import Trajectory

    groups = [[Trajectory(**{**t, "prompt_ids": tuple(t["prompt_ids"])}) for t in g] for g in data["groups"]]
    return groups, None, float(data["gen_s"]), None


class Producer(RunPart):
    """The rollout producer of a `laden rl` run (a part of `laden.rl.trainer._Run`)."""

    async def _quiesce(self) -> None:
        """Wait until the producer generates nothing: every batch it may start before the next step is
        trained (at most `max_head_offpolicyness` ahead) is done, and it waits for the trainer or for room
        in the queue. Then the engine's sampling state and the data position describe exactly what was
        generated, so a checkpoint taken now (with the generated batches) resumes as the run goes on."""
        while self._producing:
            await asyncio.sleep(0.005)

    async def _checkpoint(self, step: int, queue: asyncio.Queue) -> None:
        """Checkpoint `step` with what the producer generated ahead of it (asynchronous runs): the batches
        waiting in the queue, their data position and the sampling state after them."""
        await self._quiesce()
        pending = [item for item in list(queue._queue) if not isinstance(item, BaseException)]  # type: ignore[attr-defined]
        data_state = {"batches": self.batches.state_dict(), "carry": list(self._carry)}
        self._save(step, data_state, pending=[encode_batch(trajs, gen_s) for trajs, _, gen_s, _ in pending])

    async def _produce(self, first: int, queue: asyncio.Queue, k: int) -> None:
        """Batches `first`.. of trajectories, at most `k` ahead of the trainer (k = 0: after each update).
        `self._producing` is true while a batch is generated (`_quiesce`)."""
        b = first
        try:
            for b in range(first, self.total_steps + 1):
                async with self.progress_cond:  # batch b starts only when step b - 1 - k is trained
                    await self.progress_cond.wait_for(self._trained_through(b - 1 - k))
                self._producing = True
                t0 = time.perf_counter()
                rng_before = self.rollout.sampling_state()
                trajs = await self._collect_batch()
                data_state = {"batches": self.batches.state_dict(), "carry": list(self._carry)}
                self._producing = False
                await queue.put((trajs, data_state, time.perf_counter() - t0, rng_before))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - the trainer re-raises it
            failure: BaseException = e
            if is_oom(e):
                failure = PhaseOOMError(
                    phase="generation", step=b, cause=e, fixes=phase_oom_fixes(self.cfg, "generation", e)
                )
                failure.__cause__ = e
            await queue.put(failure)
        finally:
            self._producing = False

    def _trained_through(self, step: int):
        return lambda: self.steps_done >= step

    async def _collect_batch(self) -> list[Any]:
        """`batch_size` accepted groups (rejected ones are refilled from the next prompts; the rest of a
        batch drawn for a refill is kept for the next, so no prompt is skipped)."""
        want = self.cfg.train_dataset.batch_size
        groups: list[list[Any]] = []
        attempts = 0
        share = self._generation_share()
        while len(groups) < want:
            if len(self._carry) < want - len(groups):
                self._carry += list(next(self.batches))
            need = want - len(groups)
            indices, self._carry = self._carry[:need], self._carry[need:]
            if self.rt.world_size > 1:  # this rank's share of the batch; no refill, so the ranks stay in step
                indices, want = (indices[share[0] :: share[1]] if share else []), 0
            attempts += len(indices)
            episodes = await asyncio.gather(
                *(self.workflow.arun_episode(self.rollout, dict(self.records[i])) for i in indices)
            )
            self.counters.episodes += len(indices)
            for ep in episodes:
                if ep:
                    groups.append(ep)
                else:
                    self.counters.rejected += 1
            if attempts >= 8 * want and len(groups) < want:
                failure = getattr(self.workflow, "last_failure", None)  # an agent workflow's failed runs
                if not groups and failure:
                    raise RuntimeError(
                        f"{attempts} prompts in a row were all rejected by the workflow; the latest failure: {failure}"
                    )
                if not groups:
                    raise RuntimeError(
                        f"{attempts} prompts in a row were all rejected by the workflow (every group's rewards "
                        "equal, with actor.dynamic_sampling); the reward cannot separate completions: check "
                        "reward_fn, or set actor.dynamic_sampling: false"
                    )
                break
        return groups
