"""What `laden sft` and `laden rl` do before their first step, once: a Hub id in `actor.path` /
`critic.path` / `teacher.path` replaced by its local snapshot in the Hugging Face cache (fetched if need be), the
engine's backend object from `actor.backend`, every `auto` knob set by the planner from this process's
memory (before the runtime starts, so the runtime and the engines only ever see a finished config), the
runtime, the launch checked against the allocation, and the fields that do nothing for this job and
engine named."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

import torch

from laden.config import LadenConfig, run_dir
from laden.config.usage import fields_without_effect
from laden.engine.backend import resolve_backend
from laden.engine.rundir import RunDirectory
from laden.engine.runtime import Runtime, check_world_size, start_runtime

log = logging.getLogger("laden.runtime")
T = TypeVar("T")


def start_run(cfg: LadenConfig, job: str) -> Runtime:
    """The runtime of a `job` ("sft" or "rl") run of `cfg`, with its engine's backend (`rt.backend`)."""
    main = int(os.environ.get("RANK", "0")) == 0
    resolve_model_paths(cfg, show_progress=main)
    backend = resolve_backend(cfg)
    cpu = cfg.cluster.on_cpu
    resolve_auto_knobs(cfg, torch.device("cpu") if cpu else _local_device(), log_lines=main)
    rt = start_runtime(backend, cpu=cpu)
    check_world_size(cfg, rt, job, backend)
    if rt.is_main:
        for line in fields_without_effect(cfg, job=job, engine=backend.name):
            log.warning("%s", line)
    return rt


def in_run_directory(cfg: LadenConfig, rt: Runtime, train: Callable[[RunDirectory], T]) -> T:
    """`train(run)` in the run directory of `cfg`, owned by this run while it trains (a second run on it
    is refused), its failure recorded there (`error.log`, what `laden doctor` reads) and re-raised."""
    run = RunDirectory(run_dir(cfg), is_main=rt.is_main)
    rt.on_main(run.acquire)
    try:
        return train(run)
    except BaseException as exc:
        run.record_failure(exc)
        raise
    finally:
        run.release()


def resolve_model_paths(cfg: LadenConfig, *, weights: bool = True, show_progress: bool = True) -> LadenConfig:
    """`cfg` with a Hub id in `actor.path` / `critic.path` / `teacher.path` replaced by its local snapshot (fetched into the
    Hugging Face cache unless there; `weights=False`: config and tokenizer only), so every later reader
    sees a local directory. Local paths are kept as they are."""
    from laden.model.hf.hub import resolve_model_path

    a = cfg.actor
    a.path = resolve_model_path(a.path, revision=a.revision, weights=weights, show_progress=show_progress)
    for name, section in (("critic", cfg.critic), ("teacher", cfg.teacher)):
        if section is not None and section.path:
            section.path = resolve_model_path(
                section.path, revision=section.revision, weights=weights, show_progress=show_progress,
                field=f"{name}.path",
            )  # fmt: skip
    return cfg


def resolve_auto_knobs(cfg: LadenConfig, device: torch.device, *, log_lines: bool = True) -> None:
    """Every `auto` knob of `cfg` set from the planner's predictions for `device`'s memory, logged."""
    from laden.memory.auto import resolve_auto, training_budget

    for line in resolve_auto(cfg, training_budget(device)):
        if log_lines:
            log.info("%s", line)


def _local_device() -> torch.device:
    """The device this process will train on (torchrun's `LOCAL_RANK`-th GPU), before the runtime starts."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
