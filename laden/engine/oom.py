"""Out-of-memory errors: which allocation failures are out-of-memory, and the errors a run stops with.

The OOM guides laden is built from tell a person, after the crash, which knob to turn. A run's
out-of-memory error says the same with this run's values: what ran out of which memory, at which
step, and the knob changes that fix it, most effective first. The fixes are supplied by the caller
(an engine's backend object for a training step, the planner's doctor for `laden rl`'s other phases),
so this module knows nothing of engines or the planner. With `oom_policy: auto` a training step is
re-split into smaller micro-batches and retried first (`laden.engine.runtime.OOMRetry`).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

import torch

__all__ = [
    "OutOfMemoryError",
    "PhaseOOMError",
    "TrainingOOMError",
    "is_host_oom",
    "is_oom",
    "release_cached_memory",
]

_HOST_OOM_TEXT = ("defaultcpuallocator: can't allocate memory", "cannot allocate memory", "std::bad_alloc")


def is_host_oom(exc: BaseException) -> bool:
    """A host allocation failure: Python's MemoryError or torch's CPU allocator refusing."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(t in text for t in _HOST_OOM_TEXT)


def is_oom(exc: BaseException) -> bool:
    """True for a device or host allocation failure."""
    if isinstance(exc, torch.OutOfMemoryError) or is_host_oom(exc):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def release_cached_memory() -> None:
    """Drop what the failed attempt left behind before retrying."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class OutOfMemoryError(RuntimeError):
    """Something of a run ran out of memory: `what` ("training step 3", "generation for step 3"), where
    (`self.where`: "host" or "GPU", read from `cause`), a `note` and the `fixes`, most effective first."""

    def __init__(self, what: str, *, cause: BaseException, fixes: Sequence[str], note: str = "") -> None:
        self.where = "host" if is_host_oom(cause) else "GPU"
        self.fixes = list(fixes)
        super().__init__(
            f"{what} ran out of {self.where} memory ({str(cause).splitlines()[0][:200]}).{note}\n"
            + "Change one of, most effective first:\n"
            + "\n".join(f"  - {line}" for line in self.fixes)
        )


class TrainingOOMError(OutOfMemoryError):
    """A training step ran out of memory (`fixes`: its engine's, `TrainBackend.training_oom_fixes`)."""

    def __init__(
        self, *, step: int, cause: BaseException, fixes: Sequence[str], in_collectives: bool = False
    ) -> None:
        note = (
            "\nIt happened inside the step's collectives, where the other ranks cannot retry with this one; "
            "the run stops here and a rerun of the same command resumes from the newest checkpoint."
            if in_collectives
            else ""
        )
        super().__init__(f"training step {step}", cause=cause, fixes=fixes, note=note)


class PhaseOOMError(OutOfMemoryError):
    """Generation or a weight update of `laden rl` ran out of memory (`fixes`: `laden.memory.doctor.phase_fixes`).
    The run stops; nothing is lost (a rerun resumes from the newest checkpoint)."""

    def __init__(self, *, phase: str, step: int, cause: BaseException, fixes: Sequence[str]) -> None:
        self.phase = phase
        super().__init__(
            f"{phase} for step {step}", cause=cause, fixes=fixes,
            note=" The run stops here; a rerun of the same command resumes from the newest checkpoint.",
        )  # fmt: skip
