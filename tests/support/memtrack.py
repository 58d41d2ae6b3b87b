"""Deterministic memory checks for tests: the largest tensor any op produces."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages that ops create while the mode is on and that are still alive.

    Every op output's storage is counted once, from its creation until it is freed (a weakref
    finalizer on the storage's owner tensor); views and in-place ops add nothing. What existed
    before the mode started (the model) is not counted, so `peak_bytes` is what a piece of code
    holds beyond it at its worst moment.
    """

    def __init__(self):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._seen: dict[int, int] = {}

    def _track(self, t: torch.Tensor) -> None:
        import weakref

        key = _storage_ptr(t)
        if key == 0 or key in self._seen:
            return
        nbytes = t.untyped_storage().nbytes()
        self._seen[key] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

        def release(key: int = key) -> None:
            self.live_bytes -= self._seen.pop(key, 0)

        weakref.finalize(t, release)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        if torch.Tag.inplace_view not in func.tags and not func._schema.is_mutable:
            # An alias of an input (`detach`, a state dict's entries) shares its storage: nothing new.
            inputs = {_storage_ptr(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in outputs:
                if isinstance(t, torch.Tensor) and not t._is_view() and _storage_ptr(t) not in inputs:
                    self._track(t)
        return out


def _storage_ptr(t: torch.Tensor) -> int:
    """The storage's address; 0 for meta tensors and for wrapper subclasses (a DTensor has no storage
    of its own: its local tensor is tracked when an op creates it)."""
    if t.device.type == "meta":
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return 0
