"""The weight-update process group: a store and a gloo or NCCL backend of its own.

`init_weight_group` builds the group straight from a `TCPStore` (hosted by rank 0, the
trainer) and a `ProcessGroupGloo` / `ProcessGroupNCCL` constructed directly, so it is
registered nowhere: it is independent of any default process group the trainer or an engine
uses (torchrun's, FSDP's), and creating or destroying it touches none of them. The cost is
that `torch.distributed`'s functional collectives do not know it: the group offers the two
collectives a weight update needs (`Collective`), from rank 0.

`cuda_ipc`: the trainer and the engines are processes on one GPU, where NCCL refuses two ranks.
A broadcast of a device tensor goes through one staging buffer on the trainer's GPU that every
receiver maps by CUDA IPC (`torch.multiprocessing`'s handles, sent again only when the trainer
makes a bigger buffer): the trainer fills its bucket in that buffer (`send_buffer`) or copies a
tensor's slice in, a small gloo broadcast says it is there, each receiver copies it out, and a
gloo all-reduce of one flag frees the buffer for the next bucket. Per bucket: one or two device
copies and two small host messages; one bucket of extra GPU memory on each side (the trainer's
is the shared buffer; the receivers' is their own bucket). While a bigger buffer replaces a
smaller one, the old one lives until every receiver has mapped the new one. Small or host
tensors (the metadata) go over gloo.

The store listens on `master_addr` only (`listening_store`): torch's `TCPStore` server binds to
every interface whatever host it is given, which would open the trainer's key-value store (and
the handshake of its weight broadcasts) to the whole network on a machine whose engines are all
on loopback. laden binds the socket itself and hands it to the store (`master_listen_fd`).
gloo binds to the loopback interface when the trainer's address is a loopback one (host
names may not resolve inside containers), else to the interface gloo picks by default
(`GLOO_SOCKET_IFNAME` chooses it).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from laden.weights.meta import WeightUpdateMeta

__all__ = [
    "Collective",
    "IpcGroup",
    "WeightGroup",
    "init_server_group",
    "init_weight_group",
    "listening_store",
]


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
) -> WeightGroup | IpcGroup:
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
    store = listening_store(
        meta.master_addr, meta.master_port, meta.world_size, is_master=rank == 0, timeout=timeout
    )
    prefixed = dist.PrefixStore(meta.group_name, store)
    if meta.backend == "nccl":
        pg, where = _nccl(prefixed, rank, meta.world_size, timeout, device)
    elif meta.backend == "cuda_ipc":
        where = _cuda_device(device, "cuda_ipc")
        gloo = _gloo(prefixed, rank, meta.world_size, timeout, meta.master_addr)
        return IpcGroup.join(gloo, store=store, rank=rank, world_size=meta.world_size, device=where)
    else:
        pg, where = _gloo(prefixed, rank, meta.world_size, timeout, meta.master_addr), torch.device("cpu")
    return WeightGroup(
        pg=pg, store=store, rank=rank, world_size=meta.world_size, device=where, backend=meta.backend
    )


def init_server_group(meta: WeightUpdateMeta, *, device: torch.device | str | None = None) -> WeightGroup:
    """Rank 0 (the trainer) of a group whose other ranks are rollout servers' workers that join it with
    torch.distributed's own constructor, as SGLang's `/init_weights_update_group` does: a `tcp://`
    rendezvous at `meta.master_addr:master_port`, its store prefixed by `meta.group_name`, and one
    backend made by `_new_process_group_helper`, which keys it under `<group_name>/<device>/`.

    The trainer's side is built as `init_weight_group` builds its own (a store listening on
    `master_addr` only, a backend constructed directly and registered nowhere) under those same key
    prefixes, and sets the group's sequence number as that constructor does (the workers wait for it).
    Returns once every rank has joined, or fails after `meta.timeout_s`.
    """
    if meta.type != "xccl":
        raise ValueError(
            f"meta.type={meta.type!r}: a weight group needs an xccl meta (WeightUpdateMeta.from_fsdp_xccl)"
        )
    if meta.backend not in ("nccl", "gloo"):
        raise ValueError(
            f"meta.backend={meta.backend!r}: rollout servers receive broadcasts over 'nccl' (GPUs) or 'gloo' (CPU)"
        )
    timeout = datetime.timedelta(seconds=meta.timeout_s)
    assert meta.master_port is not None  # WeightUpdateMeta validates xccl metas
    store = listening_store(
        meta.master_addr, meta.master_port, meta.world_size, is_master=True, timeout=timeout
    )
    kind = "cuda" if meta.backend == "nccl" else "cpu"  # the first device of the backend's device map
    keyed = dist.PrefixStore(
        f"{kind}/", dist.PrefixStore(f"{meta.group_name}/", dist.PrefixStore(meta.group_name, store))
    )
    if meta.backend == "nccl":
        pg, where = _nccl(keyed, 0, meta.world_size, timeout, device)
    else:
        pg, where = _gloo(keyed, 0, meta.world_size, timeout, meta.master_addr), torch.device("cpu")
    pg._set_sequence_number_for_group()
    return WeightGroup(
        pg=pg, store=store, rank=0, world_size=meta.world_size, device=where, backend=meta.backend
    )


def listening_store(
    host: str, port: int, world_size: int, *, is_master: bool, timeout: datetime.timedelta
) -> dist.TCPStore:
    """A `TCPStore` at `host:port`; the master's server listens on `host`'s address only, never on every
    interface (torch's default): laden binds the listening socket and passes it as `master_listen_fd`."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    fd = _listen_on(host, port).detach()  # the store owns the descriptor from here and closes it
    try:
        return dist.TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise


def _listen_on(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host`'s address (IPv4 preferred where the name has both)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise ValueError(
            f"master_addr={host!r} does not resolve to an address ({err}); use the trainer's IP"
        ) from err
    family, _, _, _, address = min(infos, key=lambda info: info[0] != socket.AF_INET)
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # as torch's own server: rebind after a restart
        listener.bind(address)
        listener.listen(max(128, socket.SOMAXCONN))
    except OSError as err:
        listener.close()
        raise ValueError(
            f"the weight group's store cannot listen on {host}:{port} ({err}); the port may be taken: leave "
            "master_port None in WeightUpdateMeta.from_fsdp_xccl to pick a free one"
        ) from err
    return listener


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


def _cuda_device(device: torch.device | str | None, backend: str) -> torch.device:
    if not torch.cuda.is_available() or (backend == "nccl" and not hasattr(dist, "ProcessGroupNCCL")):
        raise ValueError(
            f"meta.backend={backend!r} but this process has no CUDA{'/NCCL' if backend == 'nccl' else ''}; use "
            "backend='gloo' on the CPU (WeightUpdateMeta.from_fsdp_xccl(backend='gloo'))"
        )
    return torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())


def _nccl(
    store: Any, rank: int, size: int, timeout: datetime.timedelta, device: torch.device | str | None
) -> tuple[Any, torch.device]:
    where = _cuda_device(device, "nccl")
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


_SMALL_BYTES = 1 << 20
"""Broadcasts below this go over gloo (host copies) in an `IpcGroup`: the metadata and the flags."""


@dataclass(eq=False, slots=True)
class IpcGroup:
    """`cuda_ipc`: a `Collective` for processes on one GPU (see the module docstring)."""

    pg: Any
    store: Any
    rank: int
    world_size: int
    device: torch.device
    backend: str = "cuda_ipc"
    _staging: torch.Tensor | None = None
    _generation: int = 0
    """Which staging buffer this rank holds (rank 0: made; the others: mapped); 0 = none yet."""
    _shared: int = 0
    """Rank 0: the generation the receivers have mapped."""

    @classmethod
    def join(cls, pg: Any, *, store: Any, rank: int, world_size: int, device: torch.device) -> IpcGroup:
        """The group over gloo `pg`, once every rank has shown it runs on the trainer's GPU."""
        group = cls(pg=pg, store=store, rank=rank, world_size=world_size, device=device)
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        everyone = torch.zeros(world_size, 64, dtype=torch.uint8)
        everyone[rank] = torch.frombuffer(bytearray(uuid.encode().ljust(64)), dtype=torch.uint8)
        pg.allreduce([everyone]).wait()
        uuids = [bytes(row.tolist()).decode().strip() for row in everyone]
        if len(set(uuids)) > 1:
            others = [r for r, u in enumerate(uuids) if u != uuids[0]]
            raise ValueError(
                f"meta.backend='cuda_ipc' needs every rank on the trainer's GPU ({uuids[0]}), but rank(s) {others} "
                "run on another; use backend='nccl' between GPUs"
            )
        return group

    def send_buffer(self, num_bytes: int) -> torch.Tensor:
        """Rank 0: `num_bytes` of the shared staging buffer, to fill a bucket in (its broadcast then
        copies nothing on this side). A bigger buffer replaces it when needed (not a collective: the
        receivers map the new one at the next broadcast)."""
        if self._staging is None or self._staging.numel() < num_bytes:
            self._staging = None  # released before the new one is made
            self._staging = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
            self._generation += 1
        return self._staging[:num_bytes]

    def broadcast(self, t: torch.Tensor) -> None:
        """Rank 0's `t` into every rank's `t` (contiguous, the same size on every rank)."""
        flat = t.reshape(-1).view(torch.uint8)
        n = flat.numel()
        if t.device.type != "cuda" or n < _SMALL_BYTES:
            host = flat.cpu() if t.device.type == "cuda" else flat
            self._host_broadcast(host)
            if host is not flat and self.rank != 0:
                flat.copy_(host)
            return
        stream = torch.cuda.current_stream(t.device)
        generation = torch.tensor([self._generation], dtype=torch.int64)
        if self.rank == 0:
            staging = self.send_buffer(n)
            if staging.data_ptr() != flat.data_ptr():
                staging.copy_(flat)
            stream.synchronize()
            generation[0] = self._generation
        self._host_broadcast(generation)  # the bucket is in the buffer of this generation
        if int(generation.item()) != (self._shared if self.rank == 0 else self._generation):
            self._share_buffer(int(generation.item()))
        if self.rank != 0:
            assert self._staging is not None
            flat.copy_(self._staging[:n])
            stream.synchronize()
        self.pg.allreduce([torch.zeros(1, dtype=torch.int32)]).wait()  # every copy made: the buffer is free

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place (over gloo)."""
        host = t.cpu() if t.device.type == "cuda" else t
        self.pg.allreduce([host]).wait()
        if host is not t:
            t.copy_(host)

    def close(self) -> None:
        self._staging = None
        self.pg = None
        self.store = None

    def _host_broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()

    def _share_buffer(self, generation: int) -> None:
        """Rank 0 sends the staging buffer's CUDA IPC handle; the others map it (dropping the old one)."""
        import pickle

        from torch.multiprocessing.reductions import reduce_tensor

        if self.rank == 0:
            payload = torch.frombuffer(
                bytearray(pickle.dumps(reduce_tensor(self._staging))), dtype=torch.uint8
            )
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        self._host_broadcast(length)
        if self.rank != 0:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self._host_broadcast(payload)
        if self.rank == 0:
            self._shared = generation
            return
        self._staging = None
        rebuild, args = pickle.loads(payload.numpy().tobytes())  # noqa: S301 - the trainer's own handle
        with torch.cuda.device(self.device):
            self._staging = rebuild(*args)
        self._generation = generation
