"""The weight-update process group: a store and a gloo or NCCL backend of its own.

`init_weight_group` builds the group straight from a `TCPStore` (hosted by rank 0, the
trainer) and a `ProcessGroupGloo` / `ProcessGroupNCCL` constructed directly, so it is
registered nowhere: it is independent of any default process group the trainer or an engine
uses (torchrun's, FSDP's), and creating or destroying it touches none of them. The cost is
that `torch.distributed`'s functional collectives do not know it: the group offers the two
collectives a weight update needs (`Collective`), from rank 0.

gloo binds to the loopback interface when the trainer's address is a loopback one (host
names may not resolve inside containers), else to the interface gloo picks by default
(`GLOO_SOCKET_IFNAME` chooses it).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from laden.weights.meta import WeightUpdateMeta

__all__ = ["Collective", "WeightGroup", "init_weight_group"]


class Collective(Protocol):
    """The two collectives a weight update needs, from rank 0 of a group (`WeightGroup` is one)."""

    rank: int
    world_size: int
    device: torch.device
    """Where the group's buffers live: a CUDA device for NCCL, the CPU for gloo."""

    def broadcast(self, t: torch.Tensor) -> None:
        """Rank 0's `t` into every rank's `t` (contiguous, same size everywhere), in place."""
        ...

    def all_reduce(self, t: torch.Tensor) -> None:
        """The sum over the ranks into every rank's `t`, in place."""
        ...


@dataclass(eq=False, slots=True)
class WeightGroup:
    """A process group for weight updates only: the backend and the store that keeps it alive."""

    pg: Any
    store: Any
    rank: int
    world_size: int
    device: torch.device
    backend: str

    def broadcast(self, t: torch.Tensor) -> None:
        """Rank 0's `t` into every rank's `t`; on NCCL the current stream waits for it."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place."""
        self.pg.allreduce([t]).wait()

    def close(self) -> None:
        """Release the backend's resources (NCCL communicators); the group is unusable afterwards."""
        shutdown = getattr(self.pg, "shutdown", None) or getattr(self.pg, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        self.pg = None
        self.store = None


def init_weight_group(
    meta: WeightUpdateMeta, rank: int, *, device: torch.device | str | None = None
) -> WeightGroup:
    """Join the weight-update group `meta` describes as `rank` (0: the trainer, which hosts the store).

    Every rank of `meta.world_size` must call it; it returns once all have joined (or fails
    after `meta.timeout_s`). `device`: NCCL's CUDA device (default: the current one); gloo
    uses the CPU. Touches no default process group.
    """
    if meta.type != "xccl":
        raise ValueError(
            f"meta.type={meta.type!r}: a weight group needs an xccl meta (WeightUpdateMeta.from_fsdp_xccl)"
        )
    if not 0 <= rank < meta.world_size:
        raise ValueError(f"rank={rank} must be in [0, meta.world_size={meta.world_size}): 0 is the trainer")
    timeout = datetime.timedelta(seconds=meta.timeout_s)
    assert meta.master_port is not None  # WeightUpdateMeta validates xccl metas
    store = dist.TCPStore(
        meta.master_addr, meta.master_port, meta.world_size, is_master=rank == 0, timeout=timeout,
        wait_for_workers=False,
    )  # fmt: skip
    prefixed = dist.PrefixStore(meta.group_name, store)
    if meta.backend == "nccl":
        pg, where = _nccl(prefixed, rank, meta.world_size, timeout, device)
    else:
        pg, where = _gloo(prefixed, rank, meta.world_size, timeout, meta.master_addr), torch.device("cpu")
    return WeightGroup(
        pg=pg, store=store, rank=rank, world_size=meta.world_size, device=where, backend=meta.backend
    )


def _gloo(store: Any, rank: int, size: int, timeout: datetime.timedelta, master_addr: str) -> Any:
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timeout
    # Every rank on this host: talk over loopback (the host name may not resolve in a container).
    loopback = _is_loopback(master_addr)
    device = (
        dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
        if loopback
        else dist.ProcessGroupGloo.create_default_device()
    )
    opts._devices = [device]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _nccl(
    store: Any, rank: int, size: int, timeout: datetime.timedelta, device: torch.device | str | None
) -> tuple[Any, torch.device]:
    if not torch.cuda.is_available() or not hasattr(dist, "ProcessGroupNCCL"):
        raise ValueError(
            "meta.backend='nccl' but this process has no CUDA/NCCL; use backend='gloo' on the CPU "
            "(WeightUpdateMeta.from_fsdp_xccl(backend='gloo'))"
        )
    where = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts), where


def _is_loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False
