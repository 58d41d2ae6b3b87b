"""Module buffers written in forward (BatchNorm running statistics, counters) persist.

Each residency works on device copies of its layers' buffers, so an in-place write in
forward (`running_mean`, `num_batches_tracked`, any registered buffer a layer updates)
would vanish with the copies. A forward pass (a forward stage, the forward of the fused
stage, an inference call) therefore copies its layers' persistent buffers back into the
model's host buffers when the stage is done, once per residency and after every micro-batch
ran, so the statistics advance once per micro-batch, as `num_microbatch` plain calls would.

A recompute must neither see nor make those writes: the backward stages upload the buffer
values from before the call's forward (snapshotted on the host when a forward stage starts),
the fused stage's layer-grain recompute restores the device values its forward left, and
nothing a backward writes is copied back.

Non-persistent buffers (`register_buffer(..., persistent=False)`: rotary frequencies, masks)
are taken to be constants and never copied back; that keeps the write-back off the models
that have nothing to write back. The copy back is a blocking device-to-host copy, a host
stall at the end of a forward stage of layers that own persistent buffers (a few KiB each).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from laden.engine.roundpipe.device import Lane
from laden.engine.roundpipe.host.store import HostStore, LayerInfo


def persistent_slots(info: LayerInfo) -> Iterator[tuple[str, str, torch.Tensor]]:
    """The (path, attr, host buffer) of a layer's persistent buffers."""
    for path, attr, b in info.buffer_slots:
        owner = info.module.get_submodule(path) if path else info.module
        if attr not in owner._non_persistent_buffers_set:
            yield path, attr, b


def snapshot_host(store: HostStore, layers: Iterable[int], into: dict[int, torch.Tensor]) -> None:
    """Keep the values before this call's forward of the layers' persistent buffers (first value wins)."""
    for layer in layers:
        for _, _, b in persistent_slots(store.layers[layer]):
            if id(b) not in into:
                into[id(b)] = b.detach().clone()


def _device_buffer(shell: nn.Module, path: str, attr: str) -> torch.Tensor | None:
    owner = shell.get_submodule(path) if path else shell
    return owner._buffers.get(attr)


def write_back(store: HostStore, lane: Lane, modules: dict[int, nn.Module], layers: Iterable[int]) -> None:
    """Copy the residency's persistent buffers (its shells' current ones) into the host buffers,
    on the compute stream (after the forward that wrote them)."""
    with torch.no_grad(), lane.on(lane.compute):
        for layer in layers:
            for path, attr, b in persistent_slots(store.layers[layer]):
                dev = _device_buffer(modules[layer], path, attr)
                if dev is None or dev is b:
                    continue
                if dev.shape != b.shape or dev.dtype != b.dtype:
                    raise RuntimeError(
                        f"layer {layer} replaced buffer {path + '.' if path else ''}{attr} with one of shape "
                        f"{tuple(dev.shape)} {dev.dtype} (was {tuple(b.shape)} {b.dtype}); update buffers in "
                        "place (buffer.copy_(...)) so that RoundPipe can write them back"
                    )
                b.copy_(dev)  # deliberate sync on a GPU: a blocking copy, only for layers owning such buffers


def device_snapshot(store: HostStore, modules: dict[int, nn.Module], layers: Iterable[int]) -> list:
    """Clones of the device values of the layers' persistent buffers (to undo a recompute's writes)."""
    kept = []
    for layer in layers:
        for path, attr, _ in persistent_slots(store.layers[layer]):
            dev = _device_buffer(modules[layer], path, attr)
            if dev is not None:
                kept.append((dev, dev.detach().clone()))
    return kept


def restore_device(kept: list) -> None:
    with torch.no_grad():
        for dev, value in kept:
            dev.copy_(value)
