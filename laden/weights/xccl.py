"""Weights broadcast from the trainer to the rollout engines, in flat byte buckets.

The trainer is rank 0 of a process group of its own (`laden.weights.group`), built from a
`TCPStore` and a gloo or NCCL backend constructed directly, so it is independent of any
default process group the trainer or an engine uses (torchrun's, FSDP's). One update:

1. metadata: the version, the bucket size, and every tensor's name, shape and dtype, as JSON
   bytes (their length first), in one small broadcast;
2. agreement: every receiver checks the metadata against its own weights and an all-reduce
   of one flag per rank tells every rank whether all accepted. A mismatch (a missing or
   unexpected name, another shape or dtype) is refused before a byte of weights moves, so
   the engines keep their weights, and every rank raises (the receiver with the mismatch
   names the tensors);
3. the bytes of all tensors, in the announced order, cut into buckets of `bucket_bytes`
   (the last one shorter): a tensor larger than a bucket spans several, a bucket holds the
   ends and starts of several small ones.

Memory: the sender fills one bucket buffer, pulling the next tensor from `named_weights`
only when the bucket needs more bytes, so a sharded engine gathers one tensor at a time
and the sender holds one bucket plus the current tensor. The receiver copies each bucket's
bytes straight into flat byte views of its destination tensors, so it holds one bucket
beyond its weights. A bucket that lies inside one tensor on the group's device goes out of
(and into) that tensor directly, with no bucket copy. Bigger buckets mean fewer
collectives (each costs a latency) and more memory on both sides.

Failure: the sender checks each tensor against what it announced; a mismatch or an error in
the iterator after the agreement leaves the receivers waiting in a broadcast until the
group's timeout (`WeightUpdateMeta.timeout_s`), with their weights partly written.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from laden.weights.group import (
    Collective,
    WeightGroup,
    init_weight_group,
)  # re-exported: the group of this protocol

FORMAT = "laden-xccl/1"
_MAX_LISTED = 5

__all__ = [
    "Collective",
    "IncomingWeights",
    "TransferStats",
    "WeightGroup",
    "WeightSpec",
    "init_weight_group",
    "receive",
    "receive_into",
    "send_weights",
    "weight_specs",
]


# ---- what is sent -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WeightSpec:
    """One tensor of an update: its Hugging Face name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return math.prod(self.shape) * self.dtype.itemsize


def weight_specs(
    source: nn.Module | Mapping[str, torch.Tensor], dtype: torch.dtype | None = None
) -> list[WeightSpec]:
    """The specs of what `named_weights(dtype)` yields: a model's `hf_state_names` (shapes of the
    full tensors, DTensors included; no gather), or a mapping's entries in order. Floating
    tensors take `dtype` (default: their own)."""
    if isinstance(source, nn.Module):
        from laden.model.hf.export import hf_state_names

        state = source.state_dict()
        items: Iterable[tuple[str, torch.Tensor]] = ((name, state[name]) for name in hf_state_names(source))
    else:
        items = source.items()
    return [
        WeightSpec(name, tuple(t.shape), dtype if dtype is not None and t.is_floating_point() else t.dtype)
        for name, t in items
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferStats:
    """What one update moved."""

    version: int
    num_tensors: int
    num_bytes: int
    num_buckets: int


@dataclass(slots=True)
class _Header:
    """What the sender announces: the version, the bucket size and the tensors, in stream order."""

    version: int
    bucket_bytes: int
    specs: tuple[WeightSpec, ...]
    offsets: list[int] = field(init=False)
    """Byte offset of each tensor in the update's byte stream, plus the total at the end."""

    def __post_init__(self) -> None:
        self.offsets = [0]
        for spec in self.specs:
            self.offsets.append(self.offsets[-1] + spec.nbytes)

    @property
    def total_bytes(self) -> int:
        return self.offsets[-1]

    @property
    def num_buckets(self) -> int:
        return -(-self.total_bytes // self.bucket_bytes)

    def bucket_len(self, index: int) -> int:
        return min(self.bucket_bytes, self.total_bytes - index * self.bucket_bytes)

    def stats(self) -> TransferStats:
        return TransferStats(
            version=self.version, num_tensors=len(self.specs), num_bytes=self.total_bytes,
            num_buckets=self.num_buckets,
        )  # fmt: skip

    def encode(self) -> bytes:
        tensors = [[s.name, list(s.shape), str(s.dtype).removeprefix("torch.")] for s in self.specs]
        body = {"format": FORMAT, "version": self.version, "bucket_bytes": self.bucket_bytes,
                "total_bytes": self.total_bytes, "tensors": tensors}  # fmt: skip
        return json.dumps(body).encode()

    @staticmethod
    def decode(raw: bytes) -> _Header:
        body = json.loads(raw)
        if body.get("format") != FORMAT:
            raise RuntimeError(
                f"weight update header of format {body.get('format')!r}; this receiver reads {FORMAT!r}"
            )
        specs = tuple(WeightSpec(name, tuple(shape), _dtype(dtype)) for name, shape, dtype in body["tensors"])
        header = _Header(int(body["version"]), int(body["bucket_bytes"]), specs)
        if header.total_bytes != body["total_bytes"]:
            raise RuntimeError(
                f"weight update header: {body['total_bytes']} bytes announced, {header.total_bytes} described"
            )
        return header


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RuntimeError(f"weight update header names dtype {name!r}, which this torch does not have")
    return dtype


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s storage bytes as a flat uint8 view (`t` contiguous)."""
    return t.detach().reshape(-1).view(torch.uint8)


# ---- sender ---------------------------------------------------------------------------------
def send_weights(
    group: Collective,
    named_weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    *,
    version: int,
    bucket_bytes: int,
    specs: Sequence[WeightSpec] | None = None,
) -> TransferStats:
    """Broadcast `named_weights` (rank 0 of `group`) to every other rank as version `version`.

    `specs`: the name, shape and dtype of each tensor `named_weights` will yield, in order
    (`weight_specs(engine.model, dtype)`); a mapping describes itself. They go out first, so
    the receivers check them before any weight moves. `bucket_bytes`: bytes per broadcast
    (`WeightUpdateMeta.bucket_bytes`). Raises ValueError when a receiver refuses the update.
    """
    if group.rank != 0:
        raise ValueError(f"send_weights on rank {group.rank}: the trainer is rank 0 of the weight group")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} must be a positive integer; e.g. meta.bucket_bytes")
    header = _Header(int(version), bucket_bytes, tuple(_resolve_specs(named_weights, specs)))
    _broadcast_header(group, header)
    _agree(group, header, problem=None)
    pairs = iter(named_weights.items() if isinstance(named_weights, Mapping) else named_weights)
    _send_buckets(group, header, pairs)
    return header.stats()


def _resolve_specs(
    named_weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    specs: Sequence[WeightSpec] | None,
) -> Sequence[WeightSpec]:
    if specs is None:
        if not isinstance(named_weights, Mapping):
            raise ValueError(
                "send_weights needs every tensor's name, shape and dtype before the first bucket, and an "
                "iterator only tells them one at a time: pass specs=weight_specs(engine.model, dtype) "
                "(or a dict of tensors)"
            )
        specs = weight_specs(named_weights)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"specs name {twice[:_MAX_LISTED]} more than once; each tensor must appear once")
    return specs


def _send_buckets(group: Collective, header: _Header, pairs: Iterator[tuple[str, torch.Tensor]]) -> int:
    """Stream every tensor's bytes through one bucket buffer; returns the buckets broadcast."""
    bucket: torch.Tensor | None = None
    fill = sent = 0
    for index in range(len(header.specs)):
        t = _next_tensor(pairs, header, index)
        src = _flat_bytes(t.contiguous())
        pos, size = 0, src.numel()
        while pos < size:
            length = header.bucket_len(sent)
            if fill == 0 and size - pos >= length and src.device == group.device:
                group.broadcast(src[pos : pos + length])  # the bucket is a slice of this tensor: no copy
                pos, sent = pos + length, sent + 1
                continue
            if bucket is None:  # a group with a shared send buffer (cuda_ipc) fills that one
                size_bytes = min(header.bucket_bytes, header.total_bytes)
                make = getattr(group, "send_buffer", None)
                bucket = (
                    make(size_bytes)
                    if make is not None
                    else torch.empty(size_bytes, dtype=torch.uint8, device=group.device)
                )
            n = min(length - fill, size - pos)
            bucket[fill : fill + n].copy_(src[pos : pos + n])
            fill, pos = fill + n, pos + n
            if fill == length:
                group.broadcast(bucket[:length])
                fill, sent = 0, sent + 1
        del t, src  # before the next tensor is made: the sender holds one at a time
    if next(pairs, None) is not None:
        raise RuntimeError(
            f"named_weights yielded more than the {len(header.specs)} tensors its specs announced (all were "
            "sent; the extra ones were not): pass the specs of every tensor it yields"
        )
    assert sent == header.num_buckets, (sent, header.num_buckets)
    return sent


def _next_tensor(pairs: Iterator[tuple[str, torch.Tensor]], header: _Header, index: int) -> torch.Tensor:
    spec = header.specs[index]
    pair = next(pairs, None)
    if pair is None:
        raise RuntimeError(
            f"named_weights ended after {index} of the {len(header.specs)} tensors announced ({spec.name!r} "
            "next); the receivers wait for the rest until the group's timeout: announce what it yields"
        )
    name, t = pair
    if name != spec.name or tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
        raise RuntimeError(
            f"named_weights yielded {name!r} {tuple(t.shape)} {t.dtype} as tensor {index}, but the update "
            f"announced {spec.name!r} {spec.shape} {spec.dtype}; the receivers wait until the group's timeout: "
            "build specs from the same model and dtype as named_weights"
        )
    return t


# ---- metadata and agreement ---------------------------------------------------------------
def _broadcast_header(group: Collective, header: _Header | None) -> _Header:
    """Rank 0's header to every rank: its length, then its JSON bytes."""
    payload = None
    if header is not None:
        raw = header.encode()
        payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(group.device)
    length = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64, device=group.device)
    group.broadcast(length)
    if payload is None:
        size = int(length.item())  # deliberate sync: the header's size
        payload = torch.empty(size, dtype=torch.uint8, device=group.device)
    group.broadcast(payload)
    if header is not None:
        return header
    return _Header.decode(payload.cpu().numpy().tobytes())


def _agree(group: Collective, header: _Header, *, problem: str | None) -> None:
    """One flag per rank, summed: every rank learns whether all accepted the update; else all raise."""
    flags = torch.zeros(group.world_size, dtype=torch.int32, device=group.device)
    if problem is not None:
        flags[group.rank] = 1
    group.all_reduce(flags)
    refused = [rank for rank, flag in enumerate(flags.tolist()) if flag]  # deliberate sync: the verdict
    if problem is not None:
        raise ValueError(
            f"weight update to version {header.version} refused (nothing was written): {problem}"
        )
    if refused and group.rank == 0:
        raise ValueError(
            f"weight update to version {header.version} refused by receiver rank(s) {refused}: their weights' "
            "names, shapes or dtypes differ from what was sent (each names the tensors in its own error); "
            "nothing was transferred"
        )
    if refused:
        raise RuntimeError(
            f"weight update to version {header.version} aborted: rank(s) {refused} refused it (see their "
            "error); this rank's weights are unchanged"
        )


# ---- receivers ------------------------------------------------------------------------------
def receive_into(group: Collective, params: Mapping[str, torch.Tensor]) -> TransferStats:
    """Receive one update (rank > 0) straight into `params` ({hf_name: tensor}, written in place).

    `params` must hold exactly the tensors sent, each contiguous with the sent shape and
    dtype; otherwise the update is refused before anything is written (ValueError naming the
    tensors, and the sender raises too). Holds one bucket beyond `params`.
    """
    _check_receiver(group, "receive_into")
    header = _broadcast_header(group, None)
    _agree(group, header, problem=_mismatch(header, params))
    dests = [params[spec.name] for spec in header.specs]
    with torch.no_grad():
        for _ in _receive_buckets(group, header, dests.__getitem__):
            pass
    return header.stats()


def receive(
    group: Collective,
    *,
    device: torch.device | str | None = None,
    expect: Mapping[str, torch.Tensor] | None = None,
) -> IncomingWeights:
    """Receive one update (rank > 0) as fresh tensors: an iterator of `(name, tensor)`, each handed
    out once its last byte arrived. Consume it to the end (the sender waits for every rank).

    `device`: where the tensors are made (default: the group's device). The metadata is read
    here; `version` and `specs` are known before the first tensor. `expect`: the names, shapes
    and dtypes this receiver takes (meta tensors will do; a tensor parallel engine gives its
    shards' whole shapes); an update that differs is refused before any byte moves, as in
    `receive_into`.
    """
    _check_receiver(group, "receive")
    header = _broadcast_header(group, None)
    _agree(group, header, problem=None if expect is None else _mismatch(header, expect))
    return IncomingWeights(group, header, torch.device(device) if device is not None else group.device)


class IncomingWeights(Iterator[tuple[str, torch.Tensor]]):
    """The tensors of one update as they complete (`receive`); `version`, `specs` and `stats` up front."""

    def __init__(self, group: Collective, header: _Header, device: torch.device) -> None:
        self.version = header.version
        self.specs: tuple[WeightSpec, ...] = header.specs
        self.stats = header.stats()
        self._device = device
        self._partial: dict[int, torch.Tensor] = {}  # tensors whose bytes are still arriving
        self._completed = _receive_buckets(group, header, self._dest)

    def _dest(self, index: int) -> torch.Tensor:
        t = self._partial.get(index)
        if t is None:
            spec = self.specs[index]
            t = self._partial[index] = torch.empty(spec.shape, dtype=spec.dtype, device=self._device)
        return t

    def __next__(self) -> tuple[str, torch.Tensor]:
        index = next(self._completed)
        t = self._dest(index)  # a tensor of no bytes is made here
        del self._partial[index]
        return self.specs[index].name, t


def _check_receiver(group: Collective, what: str) -> None:
    if group.rank == 0:
        raise ValueError(f"{what} on rank 0: rank 0 is the trainer (send_weights); engines are ranks 1..n-1")


def _mismatch(header: _Header, params: Mapping[str, torch.Tensor]) -> str | None:
    """Why `params` cannot take the update (every reason, naming tensors), or None."""
    sent = {spec.name for spec in header.specs}
    problems = []
    unexpected = [spec.name for spec in header.specs if spec.name not in params]
    if unexpected:
        problems.append(
            f"the trainer sent {len(unexpected)} weight(s) this engine does not have: {_listed(unexpected)}"
        )
    missing = [name for name in params if name not in sent]
    if missing:
        problems.append(
            f"this engine has {len(missing)} weight(s) the trainer did not send: {_listed(missing)}"
        )
    differ = []
    for spec in header.specs:
        t = params.get(spec.name)
        if t is None:
            continue
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            differ.append(
                f"{spec.name!r} sent as {list(spec.shape)} {spec.dtype}, held as {list(t.shape)} {t.dtype}"
            )
        elif not t.is_contiguous():
            differ.append(f"{spec.name!r} is not contiguous here (its bytes are written in place)")
    if differ:
        problems.append(f"{len(differ)} weight(s) differ: " + "; ".join(differ[:_MAX_LISTED]))
    if not problems:
        return None
    return (
        "; ".join(problems)
        + ". Fix: send the same model in this engine's dtype (named_weights(dtype) and weight_specs(model, dtype))"
    )


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return ", ".join(repr(n) for n in names[:_MAX_LISTED]) + more


def _receive_buckets(
    group: Collective, header: _Header, dest: Callable[[int], torch.Tensor]
) -> Iterator[int]:
    """Receive every bucket into the tensors `dest(i)` gives; yield each index once its tensor is complete."""
    offsets, specs = header.offsets, header.specs
    bucket: torch.Tensor | None = None
    first = done = 0  # first tensor overlapping the next bucket; first tensor not yet handed out
    for k in range(header.num_buckets):
        start = k * header.bucket_bytes
        end = start + header.bucket_len(k)
        while offsets[first + 1] <= start:  # tensors that ended before this bucket (or hold no bytes)
            first += 1
        inside = offsets[first + 1] >= end
        if inside and dest(first).device == group.device:
            lo = start - offsets[first]
            group.broadcast(_flat_bytes(dest(first))[lo : lo + end - start])  # straight into the tensor
        else:
            if bucket is None:
                bucket = torch.empty(
                    min(header.bucket_bytes, header.total_bytes), dtype=torch.uint8, device=group.device
                )
            view = bucket[: end - start]
            group.broadcast(view)
            j = first
            while j < len(specs) and offsets[j] < end:
                lo, hi = max(start, offsets[j]), min(end, offsets[j + 1])
                if hi > lo:
                    _flat_bytes(dest(j))[lo - offsets[j] : hi - offsets[j]].copy_(
                        view[lo - start : hi - start]
                    )
                j += 1
        while done < len(specs) and offsets[done + 1] <= end:
            yield done
            done += 1
    while done < len(specs):  # tensors of no bytes after the last bucket (or an update of no bytes)
        yield done
        done += 1
