"""`offload()` / `onload()` of the fsdp and archon engines: storages copied to host buffers and released in place.

Between uses (while a colocated rollout engine generates) the engine gives back the device
memory of its parameters (the local shards of DTensors), gradients and optimizer states.
Each tensor's *storage* is copied into a separate host buffer (page-locked on CUDA, so the
copies run at full bandwidth) and then released with `untyped_storage().resize_(0)`;
`onload` resizes it back and copies the bytes in. The tensors themselves (the `nn.Parameter`
and DTensor objects, FSDP's sharded views, the optimizer's state dict entries) never change,
so every reference FSDP, the optimizer and a checkpoint template hold stays valid and training
after `onload` is bitwise the training that never offloaded.

Storages are handled once each (views such as FSDP's padded shards share one). Only storages
on the engine's device are moved; on a CPU-only machine that is the host itself, so the copy
and the release really happen there too (that is what the CPU tests check). A storage that
cannot be resized (memory-mapped host weights) is already host memory and stays.
`state_tensors` lists what an engine hands to `StorageOffload.offload`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from laden.engine.parallel.params import local_shard


class StorageOffload:
    """The host copies of released storages (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._held: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # (released storage, host copy)

    @property
    def offloaded(self) -> bool:
        return bool(self._held)

    def offload(self, tensors: Iterable[torch.Tensor]) -> None:
        """Copy every distinct storage of `tensors` on the device to the host and release it."""
        seen: set[int] = set()
        pin = self.device.type == "cuda"
        for t in tensors:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or key in seen or t.device.type != self.device.type or not storage.resizable():
                continue
            seen.add(key)
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(_bytes(storage), non_blocking=pin)
            self._held.append((storage, host))
        if pin:
            # Deliberate sync: the device-to-host copies must land before the storages are released.
            torch.cuda.current_stream(self.device).synchronize()
        for storage, _ in self._held:
            storage.resize_(0)

    def onload(self) -> None:
        """Reallocate every released storage and copy its bytes back."""
        pin = self.device.type == "cuda"
        for storage, host in self._held:
            storage.resize_(host.numel())
            _bytes(storage).copy_(host, non_blocking=pin)
        if pin:
            # Deliberate sync: the host buffers are freed next and the copies read them.
            torch.cuda.current_stream(self.device).synchronize()
        self._held = []


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def state_tensors(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """What an engine offloads: each parameter's local shard (once, however often it is listed), its
    gradient's, and every tensor of the optimizer's state."""
    seen: set[int] = set()
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        yield local_shard(p)
        if p.grad is not None:
            yield local_shard(p.grad)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield local_shard(value)
