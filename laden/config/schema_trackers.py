"""The `stats_logger` section of the config tree (AReaL's): the experiment trackers `laden.trackers` opens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(kw_only=True, slots=True)
class WandBConfig:
    """Weights & Biases (AReaL's `stats_logger.wandb`): rank 0 logs every metrics row; files under `<run dir>/wandb`."""

    mode: Literal["disabled", "online", "offline", "shared"] = "disabled"
    """`online`: stream to the W&B server; `offline`: write under the run directory only (upload later with
    `wandb sync`); `shared`: W&B's shared mode; `disabled`: no W&B."""
    wandb_base_url: str = ""
    """The W&B server's URL; empty = `WANDB_BASE_URL` or wandb's default."""
    wandb_api_key: str = ""
    """The key rank 0 logs in with (online); empty = `WANDB_API_KEY` or `wandb login`. Like every field it is
    written to the run's config.yaml: prefer the environment variable."""
    entity: str | None = None
    """The W&B user or team; None = the key's default."""
    project: str | None = None
    """The W&B project; None = `experiment_name`."""
    name: str | None = None
    """The W&B run's name; None = `trial_name`."""
    job_type: str | None = None
    """The W&B run's job type."""
    group: str | None = None
    """The W&B group; None = `<experiment_name>_<trial_name>`."""
    notes: str | None = None
    """The W&B run's notes."""
    tags: list[str] | None = None
    """The W&B run's tags."""
    config: dict[str, Any] | None = None
    """Entries added to the W&B run's config, beside laden's whole config (its key `laden`, API keys blanked)."""
    id_suffix: str | None = "train"
    """The W&B run id is `<experiment_name>_<trial_name>_<id_suffix>`, so a resumed run goes on in the same W&B
    run; `timestamp`: the start time, a new W&B run per start; None: no suffix."""


@dataclass(kw_only=True, slots=True)
class SwanlabConfig:
    """SwanLab (AReaL's `stats_logger.swanlab`): rank 0 logs every metrics row."""

    mode: Literal["disabled", "cloud", "online", "local", "offline"] = "disabled"
    """`cloud` (AReaL's name) or `online`: to the SwanLab server; `local`: files for `swanlab watch`;
    `offline`: files to upload later with `swanlab sync`; `disabled`: no SwanLab."""
    project: str | None = None
    """The SwanLab project; None = `experiment_name`."""
    name: str | None = None
    """The SwanLab experiment's name; None = `trial_name`."""
    config: dict[str, Any] | None = None
    """Entries added to the SwanLab config, beside laden's whole config (its key `laden`, API keys blanked)."""
    logdir: str | None = None
    """Directory of SwanLab's files (a relative path is under the run directory); None = `<run dir>/swanlab`."""
    api_key: str | None = None
    """The key rank 0 logs in with (`cloud`/`online`); None = `SWANLAB_API_KEY` or `swanlab login`. Written
    to config.yaml like every field: prefer the environment variable."""


@dataclass(kw_only=True, slots=True)
class TensorBoardConfig:
    """TensorBoard event files (AReaL's `stats_logger.tensorboard`), written by rank 0."""

    path: str | None = None
    """Directory of the event files (a relative path is under the run directory: `tensorboard` is
    `<run dir>/tensorboard`); None = no TensorBoard."""


@dataclass(kw_only=True, slots=True)
class TrackioConfig:
    """Trackio (AReaL's `stats_logger.trackio`): rank 0 logs every metrics row."""

    mode: Literal["disabled", "local", "online"] = "disabled"
    """`local`: Trackio's local database (`TRACKIO_DIR`, default Hugging Face's cache); `online`: also the
    Hugging Face Space `space_id`; `disabled`: no Trackio."""
    project: str | None = None
    """The Trackio project; None = `experiment_name`."""
    name: str | None = None
    """The Trackio run's name; None = `trial_name`."""
    space_id: str | None = None
    """The Hugging Face Space (`user/space`) that `online` pushes to."""


@dataclass(kw_only=True, slots=True)
class StatsLoggerConfig:
    """Experiment trackers (AReaL's `stats_logger`), beside the run's metrics.jsonl: on rank 0, through each
    library's own client (`pip install 'laden[trackers]'`), under AReaL's metric names (docs/metrics.md)."""

    wandb: WandBConfig = field(default_factory=WandBConfig)
    """Weights & Biases."""
    swanlab: SwanlabConfig = field(default_factory=SwanlabConfig)
    """SwanLab."""
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    """TensorBoard event files."""
    trackio: TrackioConfig = field(default_factory=TrackioConfig)
    """Trackio."""
