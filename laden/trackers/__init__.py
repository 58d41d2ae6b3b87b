"""Experiment trackers (AReaL's `stats_logger`): W&B, SwanLab, TensorBoard and Trackio, on rank 0.

Both trainers open one `Trackers` on rank 0 (an empty one elsewhere), hand it every row they append to
metrics.jsonl, and close it at the end, marking the tracker's run as failed when the training failed.
metrics.jsonl stays the run's record, under laden's names; the trackers get AReaL's names
(`laden.trackers.names`, docs/metrics.md). Nothing is configured by default: each library is opt-in
by its `stats_logger` section and comes with `pip install 'laden[trackers]'`.

`check_trackers` runs before the model is loaded, so a missing library or a setting that does nothing
is reported at start-up, not after minutes of loading. A tracker that fails while logging (a network
error) is closed and dropped with a warning; the training and metrics.jsonl go on.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from laden.config import LadenConfig
from laden.config.loader import config_to_dict
from laden.trackers.backends import (
    Backend,
    RunIdentity,
    SwanlabBackend,
    TensorBoardBackend,
    TrackioBackend,
    WandBBackend,
)
from laden.trackers.names import AREAL_NAMES, tracker_row

__all__ = ["AREAL_NAMES", "Trackers", "check_trackers", "tracker_row"]

log = logging.getLogger(__name__)

INSTALL = "pip install 'laden[trackers]'"
_MODULES = {"wandb": "wandb", "swanlab": "swanlab", "tensorboard": "tensorboard", "trackio": "trackio"}
_SECRETS = ("wandb_api_key", "api_key")


def _enabled(cfg: LadenConfig) -> list[str]:
    """The trackers `cfg.stats_logger` turns on, in the order they are opened."""
    s = cfg.stats_logger
    on = {
        "wandb": s.wandb.mode != "disabled",
        "swanlab": s.swanlab.mode != "disabled",
        "tensorboard": s.tensorboard.path is not None,
        "trackio": s.trackio.mode != "disabled",
    }
    return [name for name, yes in on.items() if yes]


def check_trackers(cfg: LadenConfig) -> None:
    """Raise ValueError naming every configured tracker whose library is missing or whose setting is not
    of the right kind; warn about settings of a tracker that is off (they do nothing)."""
    problems = [
        f"stats_logger.{name} is configured but the `{_MODULES[name]}` package is not installed; "
        f"run {INSTALL} (or pip install {_MODULES[name]})"
        for name in _enabled(cfg)
        if importlib.util.find_spec(_MODULES[name]) is None
    ]
    for name in ("wandb", "swanlab"):
        extra = getattr(cfg.stats_logger, name).config
        if extra is not None and not isinstance(extra, Mapping):
            problems.append(f"stats_logger.{name}.config={extra!r}: expected a mapping of names to values")
    if problems:
        raise ValueError("; ".join(problems))
    _warn_unused(cfg)


def _warn_unused(cfg: LadenConfig) -> None:
    on = _enabled(cfg)
    for name in ("wandb", "swanlab", "trackio"):
        section = getattr(cfg.stats_logger, name)
        default = type(section)()
        set_fields = [
            f.name for f in dataclasses.fields(section)
            if f.name != "mode" and getattr(section, f.name) != getattr(default, f.name)
        ]  # fmt: skip
        if name not in on and set_fields:
            log.warning(
                "stats_logger.%s.{%s} set, but stats_logger.%s.mode=disabled: they do nothing; set the mode to "
                "log to %s", name, ", ".join(set_fields), name, name,
            )  # fmt: skip
    trackio = cfg.stats_logger.trackio
    if trackio.mode == "local" and trackio.space_id:
        log.warning("stats_logger.trackio.space_id is read with mode=online only; mode=local logs locally")


def _identity(cfg: LadenConfig, run_dir: Path) -> RunIdentity:
    config = config_to_dict(cfg)
    for section in config["stats_logger"].values():
        for key in _SECRETS:
            if section.get(key):
                section[key] = "***"
    return RunIdentity(cfg.experiment_name, cfg.trial_name, Path(run_dir), config)


_OPENERS: dict[str, Any] = {
    "wandb": WandBBackend,
    "swanlab": SwanlabBackend,
    "tensorboard": TensorBoardBackend,
    "trackio": TrackioBackend,
}


class Trackers:
    """The trackers of one run on this process (none off rank 0): `log` each metrics row, `close` at the end."""

    def __init__(self, backends: list[Backend], job: str) -> None:
        self.backends = backends
        self.job = job

    @classmethod
    def open(cls, cfg: LadenConfig, run_dir: Path, *, job: str, main: bool) -> Trackers:
        """Open what `cfg.stats_logger` configures, on the main process only. A tracker that fails to open
        closes the ones opened before it and raises."""
        if not main:
            return cls([], job)
        run = _identity(cfg, run_dir)
        opened = cls([], job)
        try:
            for name in _enabled(cfg):
                opened.backends.append(_OPENERS[name](getattr(cfg.stats_logger, name), run))
                log.info("stats_logger: logging to %s", name)
        except BaseException:
            opened.close(failed=True)
            raise
        return opened

    def log(self, row: Mapping[str, Any]) -> None:
        """Log a metrics.jsonl row (it has `step`) under the trackers' names."""
        if not self.backends:
            return
        metrics, step = tracker_row(row, self.job), int(row["step"])
        for backend in list(self.backends):
            try:
                backend.log(metrics, step)
            except Exception as exc:  # noqa: BLE001 - metrics.jsonl keeps the row; the run goes on
                log.warning(
                    "stats_logger.%s failed at step %d and is dropped for the rest of the run (metrics.jsonl "
                    "has every row): %s: %s", backend.name, step, type(exc).__name__, exc,
                )  # fmt: skip
                self.backends.remove(backend)
                self._close_one(backend, failed=True)

    def close(self, *, failed: bool = False) -> None:
        """Finish every tracker's run (as failed when the training failed); safe to call twice."""
        backends, self.backends = self.backends, []
        for backend in backends:
            self._close_one(backend, failed=failed)

    @staticmethod
    def _close_one(backend: Backend, *, failed: bool) -> None:
        try:
            backend.close(failed=failed)
        except Exception as exc:  # noqa: BLE001 - closing one tracker must not stop the others closing
            log.warning(
                "stats_logger.%s did not close cleanly: %s: %s", backend.name, type(exc).__name__, exc
            )
