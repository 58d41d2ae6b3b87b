"""The run directory: owned by one run at a time, and holding one history.

`cluster.fileroot/experiment_name/trial_name/` receives the resolved config, the data
statistics, `metrics.jsonl`, the checkpoints and the export. What could go wrong there, and
what happens instead:

- Two runs on one directory (two `laden sft` started with the same trial, say) would
  interleave `metrics.jsonl` and break each other's checkpoint writes. The run holds an
  exclusive `flock` on `<run>/.lock` for its lifetime; a second run is refused with the holder's
  pid, host, start time and command. The kernel releases the lock when its holder exits, a
  crash included, so a crashed run leaves no stuck lock (a `kill -9` too); the file's text is
  only a description of the last holder.
- A resume under a changed config: the new config is compared with the one stored in the
  checkpoint before anything in the directory is touched. Fields that only change how the
  same training is computed or recorded, and the optimizer's hyper-parameters and step count,
  take effect on resume and are listed in the log; fields that change what the history means
  (data, seed, model, optimizer type or master dtype) are refused with the field and the fix.
- `checkpoint.resume=never` on a directory that holds a history is refused (a fresh start
  there would mix two histories); choose a new `trial_name`. A run that stopped before its
  first checkpoint left nothing to continue: the rerun starts over with a clean `metrics.jsonl`.
- After a resume, `metrics.jsonl` keeps only the steps up to the checkpoint (the steps run after
  it, before the interruption, are run again and logged again).
- A rerun of a finished run (its final checkpoint is at `total_steps`) trains nothing: it says
  so and returns, without exporting again.
- A run that fails leaves `error.log` (its traceback) for `laden doctor RUN_DIR`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from laden.config.usage import flatten
from laden.engine.checkpoint import FORMAT, list_checkpoints, read_meta

# Fields that may differ between a checkpoint and the config resuming from it: they change how
# the same training is computed, recorded or scheduled, not what its history means.
_MAY_CHANGE = (
    "log_freq_steps", "oom_policy", "total_train_steps", "total_train_epochs", "valid_dataset",
    "checkpoint.", "cluster.", "gconfig.", "rollout.", "sglang.", "native.", "max_concurrent_rollouts",
    "actor.backend", "actor.dtype", "actor.gradient_checkpointing", "actor.attn_impl", "actor.chunked_loss",
    "actor.loss_chunk_size", "actor.lean_activations", "actor.fused_elementwise", "actor.tiled_mlp_tokens",
    "actor.weight_update_mode", "actor.weight_chunked_mem_mb", "actor.mb_spec.", "actor.fsdp.", "actor.roundpipe.",
    "actor.optimizer.lr", "actor.optimizer.weight_decay", "actor.optimizer.beta1", "actor.optimizer.beta2",
    "actor.optimizer.eps", "actor.optimizer.momentum", "actor.optimizer.lr_scheduler_type",
    "actor.optimizer.warmup_steps_proportion", "actor.optimizer.min_lr_ratio", "actor.optimizer.gradient_clipping",
    "experiment_name", "trial_name", "critic.backend", "critic.dtype", "critic.gradient_checkpointing",
    "critic.mb_spec", "critic.fsdp", "critic.roundpipe", "critic.optimizer.lr", "critic.optimizer.weight_decay",
    "critic.optimizer.beta1", "critic.optimizer.beta2", "critic.optimizer.eps", "critic.optimizer.momentum",
    "critic.optimizer.lr_scheduler_type", "critic.optimizer.warmup_steps_proportion", "critic.optimizer.min_lr_ratio",
    "critic.optimizer.gradient_clipping",
    # a reward fixed after a failure (its import path, style or settings), and when to evaluate
    "reward_fn", "reward_fns", "reward_fn_style", "reward_timeout_s", "reward_workers", "reward_error_tolerance",
    "reward_import_timeout_s", "evaluator.", "eval_gconfig", "reward_worker_max_calls", "reward_worker_max_rss_gb",
)  # fmt: skip


class RunDirectoryError(ValueError):
    """The run directory cannot be used as asked; the message names what and the fix."""


@dataclass(kw_only=True, slots=True)
class History:
    """What a run directory holds before this run starts."""

    checkpoint: Path | None
    """The newest complete checkpoint, if any."""
    checkpoint_step: int
    """Its step (0 without one)."""
    logged_steps: int
    """Rows in `metrics.jsonl`."""

    @property
    def empty(self) -> bool:
        return self.checkpoint is None and self.logged_steps == 0


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, old value, new value) of every field that differs, in the new config's order."""
    a, b = flatten(old), flatten(new)
    return [(k, a.get(k), b.get(k)) for k in [*b, *(k for k in a if k not in b)] if a.get(k) != b.get(k)]


def _may_change(field: str) -> bool:
    return any(
        field == p or (p.endswith(".") and field.startswith(p)) or field.startswith(p + ".")
        for p in _MAY_CHANGE
    )


class RunDirectory:
    """One run's hold on its directory (see the module docstring). Rank 0 locks and writes."""

    def __init__(self, path: Path, *, is_main: bool) -> None:
        self.path = Path(path)
        self.is_main = is_main
        self._lock_file: Any = None

    # ---------------------------------------------------------------- ownership
    def acquire(self, command: str | None = None) -> None:
        """Take the directory for this run, or refuse naming the run that holds it."""
        if not self.is_main:
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            handle = (self.path / ".lock").open("a+")
        except OSError as exc:
            raise RunDirectoryError(
                f"cluster.fileroot: cannot create the run directory {self.path} ({exc.strerror}); "
                "set cluster.fileroot to a writable directory"
            ) from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise RunDirectoryError(
                f"run directory {self.path} is in use by {holder}; wait for that run to finish, or set "
                "trial_name to another name to start a separate run"
            ) from None
        handle.seek(0)
        handle.truncate()
        cmd = command or " ".join(sys.argv)
        handle.write(
            f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')} ({cmd})\n"
        )
        handle.flush()
        self._lock_file = handle

    def record_failure(self, exc: BaseException) -> None:
        """`error.log` in the run directory: the command, the time and the traceback of the error that
        ended this run (what `laden doctor RUN_DIR` reads); the newest failure replaces an older one."""
        if not self.is_main or not self.path.is_dir():
            return
        import traceback

        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        with contextlib.suppress(OSError):
            (self.path / "error.log").write_text(
                f"laden run failed at {time.strftime('%Y-%m-%d %H:%M:%S')} ({' '.join(sys.argv)})\n{text}"
            )

    def release(self) -> None:
        if self._lock_file is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    # ------------------------------------------------------------------ history
    @property
    def ckpt_root(self) -> Path:
        return self.path / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    def history(self) -> History:
        found = list_checkpoints(self.ckpt_root)
        newest = found[-1] if found else None
        step = json.loads((newest / "trainer.json").read_text())["step"] if newest else 0
        rows = self.metrics_path.read_text().splitlines() if self.metrics_path.exists() else []
        return History(
            checkpoint=newest, checkpoint_step=int(step), logged_steps=len([r for r in rows if r.strip()])
        )

    def check_resume(self, history: History, new_config: dict[str, Any], *, resume: str) -> list[str]:
        """Refuse what cannot continue this history; return the log lines of what changes on resume."""
        if resume == "never":
            if not history.empty:
                raise RunDirectoryError(
                    f"checkpoint.resume=never but run directory {self.path} already holds a run "
                    f"({history.logged_steps} logged steps, newest checkpoint {history.checkpoint or 'none'}); "
                    "starting over there would mix two histories. Set trial_name to a new name, or delete "
                    "the directory to discard that run"
                )
            return []
        if history.checkpoint is None:  # a run that stopped before its first checkpoint: nothing to continue
            if history.logged_steps:
                return [f"run directory {self.path} holds {history.logged_steps} logged steps but no checkpoint; "
                        "starting over with a clean metrics.jsonl"]  # fmt: skip
            return []
        meta = read_meta(history.checkpoint)
        if meta.get("format") != FORMAT:
            raise RunDirectoryError(
                f"checkpoint {history.checkpoint} was written by an older laden (checkpoint format "
                f"{meta.get('format')}, this one reads {FORMAT}) and cannot be resumed; set trial_name to a new "
                "name to start a new run"
            )
        old = yaml.safe_load((history.checkpoint / "config.yaml").read_text()) or {}
        refused: list[str] = []
        applied: list[str] = []
        for field, before, after in config_changes(old, new_config):
            (applied if _may_change(field) else refused).append(f"{field}: {before!r} -> {after!r}")
        if refused:
            raise RunDirectoryError(
                f"cannot resume {history.checkpoint} (written by {_writer(meta)}) with this config: "
                + "; ".join(refused)
                + ". These fields define the run's history (data, seed, model, optimizer state); set them back "
                "to the checkpoint's values to resume, or set trial_name to a new name to start a new run"
            )
        return [f"resuming with a changed {line}" for line in applied]

    def keep_metrics_through(self, step: int) -> None:
        """Drop the logged steps after `step` (they ran after the checkpoint and will run again)."""
        if not self.is_main or not self.metrics_path.exists():
            return
        rows = [r for r in self.metrics_path.read_text().splitlines() if r.strip()]
        kept = [r for r in rows if json.loads(r).get("step", 0) <= step]
        if len(kept) != len(rows):
            tmp = self.metrics_path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(r + "\n" for r in kept))
            os.replace(tmp, self.metrics_path)

    def last_logged(self) -> dict[str, Any] | None:
        """The last row of `metrics.jsonl`."""
        if not self.metrics_path.exists():
            return None
        rows = [r for r in self.metrics_path.read_text().splitlines() if r.strip()]
        return json.loads(rows[-1]) if rows else None


def _writer(meta: dict[str, Any]) -> str:
    parts = [f"{k}={meta[k]}" for k in ("backend", "dp_size", "optimizer", "optimizer_dtype") if k in meta]
    return ", ".join(parts) or "an unknown run"
