"""Weights broadcast from the trainer to rollout servers (`actor.weight_update_mode: xccl`).

The trainer is rank 0 of a process group of its own with every server's workers (server `i` of `d`,
each of `t` GPUs, holds ranks `1 + i*t ... (i+1)*t`): NCCL on GPUs, gloo on the CPU
(`laden.weights.group.init_server_group`). The servers join it at the first update
(SGLang: `POST /init_weights_update_group`); from then on each update goes out in buckets of about
`actor.weight_chunked_mem_mb` MiB of whole tensors: per bucket, every server is asked to receive
those tensors (SGLang: `POST /update_weights_from_distributed` with their names, dtypes and
shapes) while the trainer broadcasts them, one tensor after the other, in that order. A tensor
larger than a bucket is a bucket of its own. The trainer holds one bucket beyond the tensor being
gathered; each server allocates the bucket's tensors and loads them into its model.

Failure: a server that refuses a bucket, or a broadcast that fails, raises `WeightBroadcastError`
at once: the servers may then hold a mix of the old and new weights, the group cannot be used
again, and the update is not reported as done (the engine stays paused and keeps the old version
number). The run stops; resuming it from its last checkpoint (`laden rl` again with the same
experiment and trial) makes a new group and sends that checkpoint's weights whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from laden.weights.group import _is_loopback
from laden.weights.meta import WeightUpdateMeta, free_port

log = logging.getLogger(__name__)

__all__ = ["BroadcastBucket", "ServerBroadcast", "ServerChannel", "WeightBroadcastError", "trainer_address"]


class WeightBroadcastError(RuntimeError):
    """A broadcast weight update to the rollout servers failed part way (see the module docstring)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BroadcastBucket:
    """What a dialect's `load_from_broadcast` gets: the group and the tensors of one bucket, in the order
    the trainer broadcasts them."""

    master_address: str
    """Host of the group's store (the trainer)."""
    master_port: int
    """Port of that store."""
    world_size: int
    """Ranks of the group: the trainer plus every server worker."""
    group_name: str
    """Name the servers know the group by (unique per trainer run)."""
    backend: str
    """`nccl` or `gloo`."""
    rank_offsets: Mapping[str, int]
    """Each server URL's first rank in the group."""
    names: tuple[str, ...]
    """Hugging Face names of the bucket's tensors."""
    dtypes: tuple[str, ...]
    """Their dtypes, e.g. `bfloat16`."""
    shapes: tuple[tuple[int, ...], ...]
    """Their shapes."""

    @property
    def master_addr(self) -> str:
        """`master_address` under `WeightUpdateMeta`'s name."""
        return self.master_address

    def rank_offset(self, url: str) -> int:
        """The first rank of the server at `url`."""
        return self.rank_offsets[url]


class ServerChannel:
    """The trainer's end of the broadcast group with the servers at `urls`, each of `tp` workers; joined at
    the first update and kept for the run (`close()` releases it)."""

    def __init__(
        self, urls: Sequence[str], *, tp: int, bucket_mb: int, backend: str, master_addr: str | None = None,
        timeout_s: float = 300.0,
    ) -> None:  # fmt: skip
        self.urls = list(urls)
        self.meta = WeightUpdateMeta(
            type="xccl", weight_chunked_mem_mb=bucket_mb, backend=backend, world_size=1 + len(self.urls) * tp,
            master_addr=master_addr or trainer_address(self.urls), master_port=free_port(),
            group_name=f"laden-weights-{uuid.uuid4().hex[:12]}", timeout_s=timeout_s,
        )  # fmt: skip
        self.rank_offsets = {url: 1 + i * tp for i, url in enumerate(self.urls)}
        self.group: Any = None
        self.broken: str | None = None
        """Why the group can no longer be used (a failed update), or None."""

    def update(self, named_weights: Iterable[tuple[str, torch.Tensor]], *, executor: Executor | None = None):
        """The source of one update for `ServerEngine.update_weights`: `named_weights` (iterated on
        `executor`, e.g. the thread that trains) broadcast over this group."""
        return ServerBroadcast(channel=self, named_weights=named_weights, executor=executor)

    def bucket(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> BroadcastBucket:
        """The description of one bucket, for the servers."""
        meta = self.meta
        assert meta.master_port is not None
        return BroadcastBucket(
            master_address=meta.master_addr, master_port=meta.master_port, world_size=meta.world_size,
            group_name=meta.group_name, backend=meta.backend, rank_offsets=self.rank_offsets,
            names=tuple(n for n, _ in tensors), dtypes=tuple(str(t.dtype).removeprefix("torch.") for _, t in tensors),
            shapes=tuple(tuple(t.shape) for _, t in tensors),
        )  # fmt: skip

    def send(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Join the group (first call) and broadcast each tensor, in order (blocks until all are out)."""
        from laden.weights.group import init_server_group

        first = tensors[0][1].device
        if self.group is None:  # NCCL: on the GPU the weights were gathered to (this thread's own is cuda:0)
            self.group = init_server_group(self.meta, device=first if first.type == "cuda" else None)
            log.info(
                "weight broadcast group %s: %d ranks (%s), store at %s:%s", self.meta.group_name,
                self.meta.world_size, self.meta.backend, self.meta.master_addr, self.meta.master_port,
            )  # fmt: skip
        where = self.group.device
        with torch.cuda.device(where) if where.type == "cuda" else contextlib.nullcontext():
            for _, t in tensors:
                self.group.broadcast(t.detach().to(where).contiguous())

    def close(self) -> None:
        """Release the trainer's end of the group; after a failed update it is only dropped (a broadcast may
        still wait in it, which releasing would wait for: it ends at the group's timeout)."""
        if self.group is not None and self.broken is None:
            self.group.close()
        self.group = None


@dataclass(slots=True, kw_only=True)
class ServerBroadcast:
    """One update's source for `ServerEngine.update_weights` (`type == "xccl"`)."""

    type: ClassVar[str] = "xccl"
    channel: ServerChannel
    named_weights: Iterable[tuple[str, torch.Tensor]]
    executor: Executor | None = None


def buckets(
    pairs: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`pairs` in order, grouped into lists of at most `bucket_bytes` (a bigger tensor alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in pairs:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


async def broadcast_to_servers(
    source: ServerBroadcast, version: int, *, each_server: Callable[[Callable], Any], load: Callable
) -> int:
    """Send `source`'s weights to every server as `version` (see the module docstring); returns the buckets
    sent. `each_server(call)` runs `call(http, url)` on every server; `load(http, url, bucket, version)`
    asks one server to receive a bucket (the dialect's `load_from_broadcast`)."""
    channel = source.channel
    if channel.broken is not None:
        raise WeightBroadcastError(
            f"weight update to version {version}: the broadcast group cannot be used after {channel.broken}; "
            "the run must stop (resume it from its last checkpoint)"
        )
    loop = asyncio.get_running_loop()
    stream = buckets(source.named_weights, channel.meta.bucket_bytes)
    sent = 0
    while True:
        try:
            tensors = await loop.run_in_executor(source.executor, next, stream, None)
        except BaseException:  # gathering the weights failed (e.g. out of memory): raised as it is
            if sent:
                channel.broken = f"the update to version {version} stopped after {sent} bucket(s)"
            raise
        if tensors is None:
            return sent
        info = channel.bucket(tensors)
        try:
            await asyncio.gather(
                each_server(lambda http, url, info=info: load(http, url, info, version)),
                _in_thread(channel.send, tensors),
            )
        except Exception as err:
            channel.broken = f"the failed update to version {version}"
            raise WeightBroadcastError(
                f"weight update to version {version} failed at bucket {sent + 1} ({len(tensors)} tensors from "
                f"{tensors[0][0]!r}) of the broadcast to {', '.join(channel.urls)}: {type(err).__name__}: {err}. "
                "The servers may hold a mix of old and new weights; nothing was reported as updated and the run "
                "stops. Resume it from its last checkpoint (the same experiment_name and trial_name), which "
                "sends that checkpoint's weights whole over a new group, or set actor.weight_update_mode: disk"
            ) from err
        sent += 1
        del tensors


async def _in_thread(fn: Callable, *args: Any) -> None:
    """`fn(*args)` on a daemon thread of its own: a broadcast left waiting for a server that failed must not
    keep the process from exiting (a thread pool's threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(err: BaseException | None) -> None:
        if not done.done():
            done.set_result(None) if err is None else done.set_exception(err)

    def run() -> None:
        err: BaseException | None = None
        try:
            fn(*args)
        except BaseException as exc:  # handed to the awaiting coroutine
            err = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: the update failed and was reported
            loop.call_soon_threadsafe(settle, err)

    threading.Thread(target=run, name="laden-weight-broadcast", daemon=True).start()
    await done


def trainer_address(urls: Sequence[str]) -> str:
    """The trainer's address as the servers at `urls` reach it: loopback when they are on loopback, else
    this host's address on the route to the first of them (without one: the address its name resolves to)."""
    hosts = [urllib.parse.urlparse(u).hostname or "127.0.0.1" for u in urls]
    if all(_is_loopback(h) for h in hosts):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
            probe.connect((next(h for h in hosts if not _is_loopback(h)), 9))
            return str(probe.getsockname()[0])
    except OSError:  # no route known here (or the name does not resolve): this host's own address
        return socket.gethostbyname(socket.gethostname())
