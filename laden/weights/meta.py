"""`WeightUpdateMeta`: how new weights travel from the trainer to the rollout engines.

Three ways, one description each (`type`):

- `disk`: the trainer writes each version as safetensors shards under `path`
  (`cluster.fileroot/experiment_name/trial_name/weight_updates/v00000042/`) and the engines
  read it (`laden.weights.disk`). Works across nodes on a shared file system and survives
  either side restarting; costs a round trip through storage (seconds per GB).
- `xccl`: the trainer is rank 0 of a process group of its own with the engines and
  broadcasts the weights in flat buckets of `weight_chunked_mem_mb` MiB
  (`laden.weights.xccl`): NCCL on GPUs, gloo on the CPU. Bigger buckets mean fewer
  collectives and more memory on both sides (one bucket each); 1024 MiB is the default.
- `inplace`: trainer and engine share a process (colocated); each tensor is copied into the
  engine's parameter (`laden.weights.inplace`).

The constructors follow the names users know from AReaL (`from_disk`, `from_fsdp_xccl`) plus
`from_config` for a laden config. Every problem with the fields is reported at once, each as
field, value, reason and fix.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from laden.config.alloc import BACKEND_DIMS, AllocationMode

if TYPE_CHECKING:
    from laden.config.schema import LadenConfig

WeightUpdateType = Literal["disk", "xccl", "inplace"]
WEIGHT_UPDATE_TYPES: tuple[WeightUpdateType, ...] = ("disk", "xccl", "inplace")
BACKENDS = ("nccl", "cuda_ipc", "gloo")
DEFAULT_GROUP_NAME = "laden_weight_update"
WEIGHT_UPDATES_DIRNAME = "weight_updates"

__all__ = ["WEIGHT_UPDATE_TYPES", "WeightUpdateMeta", "WeightUpdateType", "default_backend", "free_port"]


@dataclass(kw_only=True, slots=True)
class WeightUpdateMeta:
    """Where and how one trainer hands its weights to the rollout engines (see the module docstring)."""

    type: WeightUpdateType
    """`disk`, `xccl` or `inplace`."""
    path: Path | None = None
    """disk: the root directory the versions are written under (`<path>/v00000042/`)."""
    weight_chunked_mem_mb: int = 1024
    """MiB per broadcast bucket (xccl) or per safetensors shard (disk): the memory each side holds
    beyond the model during an update."""
    master_addr: str = "127.0.0.1"
    """xccl: host of the trainer (rank 0), where the group's TCP store listens."""
    master_port: int | None = None
    """xccl: port of that TCP store."""
    group_name: str = DEFAULT_GROUP_NAME
    """xccl: name of the group (a key prefix in the store)."""
    backend: str = field(default_factory=lambda: default_backend())
    """xccl: `nccl` (GPUs), `cuda_ipc` (the trainer and the engines in processes on one GPU, where NCCL
    refuses: buckets pass through one device buffer the trainer shares by CUDA IPC, signalled over
    gloo) or `gloo` (CPU); default: `nccl` when CUDA is available."""
    world_size: int = 2
    """xccl: ranks of the group: the trainer (rank 0) plus one per receiving engine process."""
    timeout_s: float = 300.0
    """xccl: seconds a rendezvous or a collective may take before it fails."""

    def __post_init__(self) -> None:
        if isinstance(self.path, str):
            self.path = Path(self.path)
        problems = self._problems()
        if problems:
            raise ValueError("invalid WeightUpdateMeta: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        problems = []
        if self.type not in WEIGHT_UPDATE_TYPES:
            problems.append(
                f"type={self.type!r} is not a weight update type; use one of {WEIGHT_UPDATE_TYPES}"
            )
        chunk = self.weight_chunked_mem_mb
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            problems.append(
                f"weight_chunked_mem_mb={chunk!r} must be an integer of at least 1 (MiB per bucket or shard); "
                "set actor.weight_chunked_mem_mb to e.g. 1024"
            )
        if self.type == "disk" and self.path is None:
            problems.append(
                "path=None: a disk update needs the directory the versions are written under; "
                "use WeightUpdateMeta.from_disk(experiment_name, trial_name, fileroot)"
            )
        if self.type == "xccl":
            problems += self._xccl_problems()
        return problems

    def _xccl_problems(self) -> list[str]:
        problems = []
        port = self.master_port
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            problems.append(
                f"master_port={port!r} must be a TCP port in [1, 65535]; leave it None in "
                "WeightUpdateMeta.from_fsdp_xccl to pick a free one"
            )
        if self.backend not in BACKENDS:
            problems.append(
                f"backend={self.backend!r} must be 'nccl' (GPUs), 'cuda_ipc' (processes sharing one GPU) or "
                "'gloo' (CPU)"
            )
        if not isinstance(self.world_size, int) or self.world_size < 2:
            problems.append(
                f"world_size={self.world_size!r} must be at least 2: the trainer (rank 0) and one engine"
            )
        if not self.group_name:
            problems.append(f"group_name={self.group_name!r} must not be empty; e.g. {DEFAULT_GROUP_NAME!r}")
        if not self.master_addr:
            problems.append(
                f"master_addr={self.master_addr!r} must name the trainer's host, e.g. '127.0.0.1'"
            )
        if not self.timeout_s > 0:
            problems.append(f"timeout_s={self.timeout_s!r} must be > 0 seconds, e.g. 300")
        return problems

    @property
    def bucket_bytes(self) -> int:
        """`weight_chunked_mem_mb` in bytes."""
        return self.weight_chunked_mem_mb * 2**20

    @classmethod
    def from_disk(
        cls,
        experiment_name: str,
        trial_name: str,
        fileroot: str | Path,
        *,
        weight_chunked_mem_mb: int = 1024,
    ) -> WeightUpdateMeta:
        """Versions under `fileroot/experiment_name/trial_name/weight_updates` (the run directory's)."""
        problems = [
            f"{field}={value!r} must be a non-empty name without '/'; use the run's {field}"
            for field, value in (("experiment_name", experiment_name), ("trial_name", trial_name))
            if not value or "/" in value
        ]
        if problems:
            raise ValueError("invalid WeightUpdateMeta.from_disk arguments: " + "; ".join(problems))
        path = Path(fileroot) / experiment_name / trial_name / WEIGHT_UPDATES_DIRNAME
        return cls(type="disk", path=path, weight_chunked_mem_mb=weight_chunked_mem_mb)

    @classmethod
    def from_fsdp_xccl(
        cls,
        allocation_mode: AllocationMode | str | None = None,
        *,
        weight_chunked_mem_mb: int = 1024,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        backend: str | None = None,
        group_name: str = DEFAULT_GROUP_NAME,
        timeout_s: float = 300.0,
    ) -> WeightUpdateMeta:
        """A broadcast group of the trainer and the engines of `allocation_mode`.

        `allocation_mode`: the rollout side's (`rollout.backend`, e.g. `sglang:d2t2`): one
        receiving rank per GPU, so `world_size = 1 + num_gpus`; None: one engine process
        (`world_size = 2`). `master_port`: None picks a free port on this host. `backend`:
        None = `nccl` when CUDA is available, else `gloo`.
        """
        receivers = 1 if allocation_mode is None else _rollout_mode(allocation_mode).num_gpus
        if backend is None:
            backend = default_backend()
        if master_port is None:
            master_port = free_port()
        return cls(
            type="xccl", weight_chunked_mem_mb=weight_chunked_mem_mb, master_addr=master_addr,
            master_port=master_port, group_name=group_name, backend=backend, world_size=1 + receivers,
            timeout_s=timeout_s,
        )  # fmt: skip

    @classmethod
    def from_config(cls, cfg: LadenConfig) -> WeightUpdateMeta:
        """What `actor.weight_update_mode` and `actor.weight_chunked_mem_mb` say: disk versions in the
        run directory (`cluster.fileroot/experiment_name/trial_name/weight_updates`), or a broadcast
        group sized by `rollout.backend`."""
        actor = cfg.actor
        mode = actor.weight_update_mode
        if mode == "disk":
            return cls.from_disk(
                cfg.experiment_name, cfg.trial_name, cfg.cluster.fileroot,
                weight_chunked_mem_mb=actor.weight_chunked_mem_mb,
            )  # fmt: skip
        if mode == "xccl":
            return cls.from_fsdp_xccl(cfg.rollout.backend, weight_chunked_mem_mb=actor.weight_chunked_mem_mb)
        raise ValueError(f"actor.weight_update_mode={mode!r} must be 'xccl' or 'disk'")


def _rollout_mode(mode: AllocationMode | str) -> AllocationMode:
    parsed = AllocationMode.parse(mode) if isinstance(mode, str) else mode
    if parsed.backend in BACKEND_DIMS["actor"]:
        raise ValueError(
            f"allocation_mode={str(parsed)!r} is a training allocation; the group's receivers are the rollout "
            "engines: pass the rollout allocation (rollout.backend, e.g. 'sglang:d2')"
        )
    return parsed


def default_backend() -> str:
    """`nccl` when CUDA is available, else `gloo`."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def free_port() -> int:
    """A TCP port free on this host now (the OS picks it; another process could take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])
