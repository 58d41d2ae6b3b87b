"""One class per tracker library, each through the library's own client (imported when opened).

Each takes the run's identity (`RunIdentity`) and its own `stats_logger` section, and offers
`log(metrics, step)` and `close(failed)`; `laden.trackers.Trackers` holds the ones a run configured.
The run objects the libraries return are used (not their module-level `log`), so two trackers, or
two runs in one process, never share a client's global state.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Protocol

from laden.config.schema_trackers import SwanlabConfig, TensorBoardConfig, TrackioConfig, WandBConfig

__all__ = ["Backend", "RunIdentity", "SwanlabBackend", "TensorBoardBackend", "TrackioBackend", "WandBBackend"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class RunIdentity:
    """What every tracker names a run by, and the run's config (API keys blanked) to attach to it."""

    experiment_name: str
    trial_name: str
    run_dir: Path
    config: dict[str, Any]


class Backend(Protocol):
    """One tracker of a run."""

    name: str

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self, *, failed: bool) -> None: ...


def _under(run_dir: Path, path: str) -> Path:
    """`path`, a relative one taken under the run directory."""
    return Path(path) if Path(path).is_absolute() else run_dir / path


def _with(config: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    return {"laden": config, **(extra or {})}


class WandBBackend:
    """Weights & Biases: one W&B run per laden run, resumed by its id when the laden run resumes."""

    name = "wandb"

    def __init__(self, cfg: WandBConfig, run: RunIdentity) -> None:
        import wandb

        if cfg.mode in ("online", "shared") and cfg.wandb_api_key:
            wandb.login(key=cfg.wandb_api_key, host=cfg.wandb_base_url or None)
        suffix = time.strftime("%Y_%m_%d_%H_%M_%S") if cfg.id_suffix == "timestamp" else cfg.id_suffix
        run_id = "_".join(p for p in (run.experiment_name, run.trial_name, suffix) if p)
        run.run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            mode=cfg.mode, entity=cfg.entity, project=cfg.project or run.experiment_name,
            name=cfg.name or run.trial_name, job_type=cfg.job_type,
            group=cfg.group or f"{run.experiment_name}_{run.trial_name}", notes=cfg.notes, tags=cfg.tags,
            config=_with(run.config, cfg.config), dir=str(run.run_dir), id=run_id, resume="allow",
            settings=wandb.Settings(base_url=cfg.wandb_base_url) if cfg.wandb_base_url else None,
        )  # fmt: skip

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self, *, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)


class SwanlabBackend:
    """SwanLab: one experiment per laden run, resumed by its id when the laden run resumes."""

    name = "swanlab"

    def __init__(self, cfg: SwanlabConfig, run: RunIdentity) -> None:
        import swanlab

        mode = "online" if cfg.mode == "cloud" else cfg.mode  # AReaL's name for it
        if mode == "online" and cfg.api_key:
            swanlab.login(api_key=cfg.api_key)
        logdir = _under(run.run_dir, cfg.logdir or "swanlab")
        logdir.mkdir(parents=True, exist_ok=True)
        self._run = swanlab.init(
            project=cfg.project or run.experiment_name, name=cfg.name or run.trial_name,
            config=_with(run.config, cfg.config), log_dir=str(logdir), mode=mode,
            id=f"{run.experiment_name}-{run.trial_name}"[:64], resume="allow",
        )  # fmt: skip

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self, *, failed: bool) -> None:
        self._run.finish(state="crashed" if failed else "success")


class TensorBoardBackend:
    """TensorBoard event files, through the writer of `torch.utils.tensorboard` (the `tensorboard` package)."""

    name = "tensorboard"

    def __init__(self, cfg: TensorBoardConfig, run: RunIdentity) -> None:
        from torch.utils.tensorboard import SummaryWriter

        assert cfg.path is not None, "opened only with stats_logger.tensorboard.path"
        self.path = _under(run.run_dir, cfg.path)
        self._writer = SummaryWriter(str(self.path))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()  # a reader (or a killed run) sees every logged step

    def close(self, *, failed: bool) -> None:
        self._writer.close()


class TrackioBackend:
    """Trackio: local, or pushed to a Hugging Face Space with `online`."""

    name = "trackio"

    def __init__(self, cfg: TrackioConfig, run: RunIdentity) -> None:
        import trackio

        if cfg.mode == "online" and not cfg.space_id:
            log.warning(
                "stats_logger.trackio.mode=online without stats_logger.trackio.space_id: Trackio logs locally "
                "only; set space_id to push to a Hugging Face Space"
            )
        self._run = trackio.init(
            project=cfg.project or run.experiment_name, name=cfg.name or run.trial_name,
            config=run.config, space_id=cfg.space_id if cfg.mode == "online" else None, resume="allow",
            embed=False,
        )  # fmt: skip

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self, *, failed: bool) -> None:
        self._run.finish()
