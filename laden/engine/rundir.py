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
- A rerun of a finished run (its final checkpoint is at `total_steps`) trains nothing. Its export
  may still be missing (a kill or a full disk after the final checkpoint): `export_done` tells, from
  the manifest the export writes last (`laden.model.hf.export.export_complete`), so the rerun can
  write it from the final checkpoint.
- A run that fails leaves `error.log` (its traceback) for `laden doctor RUN_DIR`.
- A crafted directory (a symbolic link named `.lock`, `config.yaml` or `metrics.jsonl` pointing at
  a file elsewhere) would make laden write into the link's target. `acquire` refuses a directory
  holding links (at its top level, in `checkpoints/` or `hf/`), naming each, before writing
  anything, and every file is written through `laden.safe_io`: replaced atomically and never
  through a link, `.lock` and `metrics.jsonl` opened with `O_NOFOLLOW`. A full disk is a
  `DiskFullError` naming the file and the fix, and never leaves half a `metrics.jsonl` row.
- `metrics.jsonl` cut off by a kill or a full disk is repaired on resume (`keep_metrics_through`): a
  cut-off last line is dropped with a warning naming the file, the line and its first bytes. So is a
  line in the middle that is not a JSON row: the file is the history's record, not its state (the
  checkpoint is), and what a resume reads from it (`elapsed_s` of the last row) survives the loss of
  a row, so refusing to resume, and asking for a hand edit, would cost more than the row; the warning
  says what was lost. Every reader here (`logged_rows`, `last_logged`) skips such lines.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from laden.config.usage import flatten
from laden.engine.checkpoint import FORMAT, list_checkpoints, read_meta, read_run_config
from laden.engine.integrity import (
    Damage,
    DamagedCheckpointError,
    find_damage,
    has_checksums,
    is_old_layout,
    read_json,
)
from laden.safe_io import (
    AppendLines,
    UnsafePathError,
    atomic_write_text,
    open_in_place,
    read_jsonl,
    remove_leftover_temporaries,
)

log = logging.getLogger("laden.rundir")

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
    "critic.optimizer.gradient_clipping", "teacher.dtype",
    # a reward fixed after a failure (its import path, style or settings), and when to evaluate
    "reward_fn", "reward_fns", "reward_fn_style", "reward_timeout_s", "reward_workers", "reward_error_tolerance",
    "reward_import_timeout_s", "evaluator.", "eval_gconfig", "reward_worker_max_calls", "reward_worker_max_rss_gb",
)  # fmt: skip


DISK_FULL_FIX = (
    "free space on that file system, then rerun the same command: the run resumes from its last checkpoint "
    "(a finished run writes its missing export)"
)
"""What a `DiskFullError` from a write into the run directory tells the user to do."""


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
        """Take the directory for this run, or refuse naming the run that holds it. Before anything is written
        there, a directory holding symbolic links (top level, `checkpoints/`, `hf/`) is refused, naming each."""
        if not self.is_main:
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            what = "it exists and is not a directory" if os.path.lexists(self.path) else exc.strerror
            raise RunDirectoryError(
                f"cluster.fileroot: cannot create the run directory {self.path} ({what}); "
                "set cluster.fileroot to a writable directory, or trial_name to another name"
            ) from None
        self._refuse_links()
        handle = self._open_lock()
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
        self._lock_file = handle
        cmd = command or " ".join(sys.argv)
        with contextlib.suppress(OSError):  # only a description of the holder: a full disk may leave it empty
            handle.seek(0)
            handle.truncate()
            handle.write(
                f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')} ({cmd})\n"
            )
            handle.flush()
        remove_leftover_temporaries(self.path)  # of a writer killed mid-write: the lock says none is at work

    def _refuse_links(self) -> None:
        folders = [f for f in (self.path, self.ckpt_root, self.hf_path) if f.is_dir() and not f.is_symlink()]
        links = [p for f in folders for p in sorted(f.iterdir()) if p.is_symlink()]
        if links:
            shown = ", ".join(f"{p.relative_to(self.path)} -> {os.readlink(p)}" for p in links)
            raise RunDirectoryError(
                f"run directory {self.path} holds symbolic links ({shown}); laden writes its files there and "
                f"would write through them into the files they point to. Remove them (rm {' '.join(map(str, links))}), "
                "or set trial_name to a new name for a new run"
            )

    def _open_lock(self) -> Any:
        lock = self.path / ".lock"
        if os.path.lexists(lock) and not lock.is_symlink() and not lock.is_file():
            what, rm = ("a directory", "rm -r") if lock.is_dir() else ("not a regular file", "rm")
            raise RunDirectoryError(
                f"{lock} is {what}; laden keeps the run's lock file there (a one-line text file naming the run "
                f"that holds the directory). Remove it ({rm} {lock}) if nothing in it is needed, or set trial_name "
                "to a new name for a new run"
            )
        try:
            return os.fdopen(open_in_place(lock, os.O_RDWR | os.O_CREAT), "r+")
        except UnsafePathError as exc:
            raise RunDirectoryError(str(exc)) from None
        except OSError as exc:
            raise RunDirectoryError(
                f"cannot open the lock file {lock} ({exc.strerror}); make {self.path} writable, or set "
                "cluster.fileroot to a writable directory"
            ) from None

    def record_failure(self, exc: BaseException) -> None:
        """`error.log` in the run directory: the command, the time and the traceback of the error that
        ended this run (what `laden doctor RUN_DIR` reads); the newest failure replaces an older one."""
        if not self.is_main or not self.path.is_dir():
            return
        import traceback

        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        with contextlib.suppress(OSError):  # a full disk, say: the error itself still reaches the user
            atomic_write_text(
                self.path / "error.log",
                f"laden run failed at {time.strftime('%Y-%m-%d %H:%M:%S')} ({' '.join(sys.argv)})\n{text}",
            )

    def write_text(self, name: str, text: str) -> Path:
        """Write `text` to the file `name` of the run directory (`config.yaml`, `train_data_stats.json`),
        replacing it atomically and never through a link (`laden.safe_io.atomic_write_text`)."""
        assert not Path(name).is_absolute() and ".." not in Path(name).parts, name
        return atomic_write_text(self.path / name, text, fix=DISK_FULL_FIX)

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

    @property
    def hf_path(self) -> Path:
        return self.path / "hf"

    def export_done(self) -> bool:
        """Whether `hf/` holds a whole export (`laden.model.hf.export.export_complete`: its manifest, written
        last, lists every file at its size). False for a finished run killed, or out of disk, after its final
        checkpoint and before its export was in place. Reads the file system: with several ranks, use rank
        0's answer on every rank."""
        from laden.model.hf.export import export_complete

        return export_complete(self.hf_path)

    def history(self, *, on_damage: str = "previous") -> History:
        """What the directory holds. On rank 0 its checkpoint is the newest intact one, every file checked
        against its checksum (`laden.engine.integrity`): a damaged newer one is skipped with a warning that
        names it (`on_damage="previous"`) or stops the run (`"stop"`: `DamagedCheckpointError`, a
        `ValueError`). Other ranks see the newest checkpoint unchecked: with several ranks, the caller
        shares rank 0's `History` with them so that every rank loads the same checkpoint."""
        found = list_checkpoints(self.ckpt_root)
        newest = (
            (_newest_intact(self.ckpt_root, found, on_damage) if self.is_main else found[-1])
            if found
            else None
        )
        step = read_json(newest / "trainer.json")["step"] if newest else 0
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
        old = read_run_config(history.checkpoint)
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
        """Drop the logged steps after `step` (they ran after the checkpoint and will run again), and the lines
        that are not rows (a cut-off last line, garbage), each with a warning (see the module docstring).
        Rewrites `metrics.jsonl` atomically when anything changes, ending in a line end for the appends."""
        if not self.is_main or not os.path.lexists(self.metrics_path):
            return
        rows, problems, clean = self._metrics()
        for problem in problems:
            log.warning("%s; dropped, the other rows are kept", problem)
        kept = [text for text, row in rows if row.get("step", 0) <= step]
        if len(kept) != len(rows) or not clean:
            atomic_write_text(self.metrics_path, "".join(text + "\n" for text in kept), fix=DISK_FULL_FIX)

    def logged_rows(self) -> list[dict[str, Any]]:
        """The rows of `metrics.jsonl`, without the lines `keep_metrics_through` would drop (silently)."""
        return [row for _, row in self._metrics()[0]]

    def last_logged(self) -> dict[str, Any] | None:
        """The last row of `metrics.jsonl`."""
        rows = self.logged_rows()
        return rows[-1] if rows else None

    def open_metrics(self) -> AppendLines:
        """`metrics.jsonl` opened for appending rows (rank 0, after `keep_metrics_through`):
        `append_line(json.dumps(row))` writes a row whole or not at all, never through a link; a full disk
        raises `DiskFullError` (an `OSError`) naming the file and the fix, the file left as it was."""
        return AppendLines(self.metrics_path, fix=DISK_FULL_FIX)

    def _metrics(self) -> tuple[list[tuple[str, dict[str, Any]]], list[str], bool]:
        """(text and object of each row, what is wrong with each other line, whether the file is clean)."""
        scan = read_jsonl(self.metrics_path)
        problems = [bad.describe(self.metrics_path) for bad in scan.bad]
        rows = []
        for number, text, row in scan.lines:
            if isinstance(row.get("step", 0), int | float) and not isinstance(row.get("step"), bool):
                rows.append((text, row))
            else:
                problems.append(f"line {number} of {self.metrics_path} has no step number: {text[:60]!r}")
        return rows, problems, scan.clean and len(rows) == len(scan.lines)


def _writer(meta: dict[str, Any]) -> str:
    parts = [f"{k}={meta[k]}" for k in ("backend", "dp_size", "optimizer", "optimizer_dtype") if k in meta]
    return ", ".join(parts) or "an unknown run"


def _newest_intact(ckpt_root: Path, found: list[Path], on_damage: str) -> Path:
    """The newest of `found` (oldest first) whose files check out, saying what was skipped (`history`)."""
    damaged: list[tuple[Path, list[Damage]]] = []
    for checkpoint in reversed(found):
        problems = find_damage(checkpoint)
        if not problems:
            break
        if on_damage == "stop":
            raise DamagedCheckpointError(
                f"{'; '.join(map(str, problems))}. Delete {checkpoint} to resume from the previous intact "
                "checkpoint, or set checkpoint.on_damage=previous to resume from it and keep this one as it is"
            )
        damaged.append((checkpoint, problems))
    else:
        listed = "; ".join(f"{c.name}: {'; '.join(map(str, p))}" for c, p in damaged)
        raise DamagedCheckpointError(
            f"no intact checkpoint in {ckpt_root} ({listed}); laden deletes none of them. Restore one from a "
            "backup, or start over: set trial_name to a new name and checkpoint.resume=never"
        )
    if damaged:
        newest = damaged[0][0]
        log.warning(
            "checkpoint %s is damaged (%s); resuming from %s instead: steps %d..%d run again. %s is kept as it "
            "is: delete it once it is no longer needed", newest.name, "; ".join(str(p) for _, ps in damaged for p in ps),
            checkpoint.name, _step(checkpoint) + 1, _step(newest), "It" if len(damaged) == 1 else "Each damaged one",
        )  # fmt: skip
    if not has_checksums(checkpoint) and not is_old_layout(checkpoint):
        log.info(
            "%s was written before checkpoints carried checksums: checked by parsing its files only",
            checkpoint,
        )
    return checkpoint


def _step(checkpoint: Path) -> int:
    return int(checkpoint.name.rsplit("_", 1)[1])
