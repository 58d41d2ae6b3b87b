"""`laden rl`'s held-out evaluation: the `valid_dataset` prompts that fit the context, when to evaluate
(`evaluator`), and the evaluation itself on the weights of the step (`laden.rl.evaluate`)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from laden.rl.producer import read_prompt_rows
from laden.rl.run_part import RunPart
from laden.safe_io import atomic_write_text
from laden.schedule import evaluation_due

log = logging.getLogger("laden.rl")


class HeldOut(RunPart):
    """The held-out evaluation of a `laden rl` run (a part of `laden.rl.trainer._Run`)."""

    def _held_out(self) -> list[dict[str, Any]] | None:
        """`valid_dataset`'s prompts that fit the engine's context, or None without one; the share of them that
        are training prompts too is reported (a warning, and `valid_data_stats.json`)."""
        self.valid_all = None
        if self.cfg.valid_dataset is None:
            return None
        from laden.data.overlap import prompt_overlap

        self.valid_all = read_prompt_rows(self.cfg, self.cfg.valid_dataset, "valid_dataset")
        overlap = prompt_overlap(self.all_records, self.valid_all)
        if overlap.num_shared and self.rt.is_main:
            log.warning(
                "valid_dataset %s: %s; held-out accuracy on them measures memorisation, not learning. Remove them "
                "from one of the sets (examples/prepare_arith.py writes disjoint ones)",
                self.cfg.valid_dataset.path, overlap.summary(),
            )  # fmt: skip
        kept, _ = self._prompts_that_fit(self.valid_all, "valid", overlap=overlap.num_shared)
        return kept

    def _prompts_that_fit(
        self, records, which: str, *, overlap: int | None = None
    ) -> tuple[list[dict[str, Any]], list[int]]:
        """The records whose rendered prompt has at most `train_dataset.max_length` tokens (the
        engine's context is that plus `gconfig.max_new_tokens`), and their prompts' token counts; the
        count dropped is logged and written to `<which>_data_stats.json`. Records the default rendering
        cannot read (a custom workflow's own keys) are kept as they are (counted as 0 tokens)."""
        from laden.rl.workflow import render_prompt

        limit = self.cfg.train_dataset.max_length
        kept, lengths, dropped = [], [], 0
        for record in records:
            try:
                n = len(render_prompt(dict(record), self.tokenizer).ids)
            except (ValueError, KeyError, TypeError):
                n = 0
            if n > limit:
                dropped += 1
            else:
                kept.append(record)
                lengths.append(n)
        field = "train_dataset" if which == "train" else "valid_dataset"
        if not kept:
            raise ValueError(
                f"{field}.path={records.source!r}: all {dropped} prompts are longer than "
                f"train_dataset.max_length={limit} tokens; raise it"
            )
        if dropped:
            log.warning("%s: %d of %d prompts are longer than train_dataset.max_length=%d tokens and are skipped",
                        field, dropped, dropped + len(kept), limit)  # fmt: skip
        if self.rt.is_main:
            stats = {
                "records": dropped + len(kept),
                "kept": len(kept),
                "dropped_longer_than_max_length": dropped,
            }
            if overlap is not None:
                stats["shared_with_train"] = overlap
            atomic_write_text(self.run.path / f"{which}_data_stats.json", json.dumps(stats, indent=2) + "\n")
        return kept, lengths

    def _eval_due(self, step: int, elapsed_s: float) -> bool:
        """Whether to evaluate after `step`: the last step, or as `evaluator` says (every rank decides as
        rank 0, since `freq_secs` reads each one's clock)."""
        if self.valid is None:
            return False
        due = evaluation_due(
            self.cfg.evaluator, step=step, total_steps=self.total_steps, steps_per_epoch=self.batches.steps_per_epoch,
            seconds_since_last=elapsed_s - self._last_eval_s,
        )  # fmt: skip
        return bool(self._gather(due)[0])

    async def _evaluate(self, step: int, bar: Any) -> dict[str, float]:
        """The held-out metrics of the weights after `step` (the rollout engine holds them), on every rank."""
        from laden.rl.evaluate import evaluate

        assert self.valid is not None
        bar.set_description_str(f"rl (evaluating {len(self.valid)} held-out prompts)")
        t0 = time.perf_counter()
        # Nothing else generates meanwhile (the producer is quiesced) and the engine's random draws are put
        # back after: a run trains the same with evaluations as without.
        await self._quiesce()
        before = self.rollout.sampling_state()
        try:
            share = self._generation_share()
            result = await evaluate(
                self.rollout, self.valid, self.eval_workflow, rank=self.rt.rank, world_size=self.rt.world_size,
                gather=self._gather, rows=range(share[0], len(self.valid), share[1]) if share else range(0),
            )  # fmt: skip
        finally:
            if before is not None:
                self.rollout.load_sampling_state(before)
        bar.set_description_str("rl")
        stale = {v for s in result.samples for v in s.versions} - {step}
        if stale:  # the engine took every update up to this step and no later one
            raise RuntimeError(
                f"held-out completions after step {step} carry weight versions {sorted(stale)}"
            )
        self._check_reward_errors(
            step,
            int(result.metrics["eval/reward_errors"]),
            len(result.samples),
            result.first_error,
            "held-out",
        )
        self._last_accuracy = result.metrics["eval/accuracy"]
        metrics = {name: round(value, 6) for name, value in result.metrics.items()}
        metrics["eval/time_s"] = round(time.perf_counter() - t0, 3)
        log.info("step %d: held-out accuracy %.3f on %d prompts (%d completions, %.1f s)", step,
                 metrics["eval/accuracy"], len(self.valid), len(result.samples), metrics["eval/time_s"])  # fmt: skip
        return metrics

    def _held_out_history(self) -> list[tuple[int, float]]:
        """(step, `eval/accuracy`) of every evaluation logged in `metrics.jsonl` (every rank reads rank 0's)."""
        rows = self.run.logged_rows() if self.rt.is_main else []
        return [(int(r["step"]), float(r["eval/accuracy"])) for r in rows if "eval/accuracy" in r]
