"""Host-resident model state of the roundpipe engine: upload copies, master weights, gradients.

Every parameter lives in host memory in up to four forms:

- upload copy (compute dtype): what a device copies at the start of a residency. With
  `pin_model="alloc"` the copies of a layer are packed into one page-locked flat buffer per
  group (one host-to-device copy per layer group, the fastest path, ~1.5x the model in host
  memory because the pinned allocator rounds up). `register` page-locks the existing
  storage in place (`cudaHostRegister`, ~1x); `off` leaves it pageable (works with
  memory-mapped weights larger than host memory, slowest). Without CUDA nothing can be
  pinned and all three modes only choose the layout (flat for `alloc`, per-tensor otherwise).
  The model's own parameters become views of upload buffer 0, so the wrapped model always
  holds current weights in its compute dtype. The one-step-stale asynchronous update needs a
  second upload buffer (allocated on first use).
- master weight (optimizer dtype, trainable params only): what the optimizer updates.
- gradient inbox (optimizer dtype): where device gradients land, accumulated across
  micro-batches on the device and across `forward_backward` calls here; two inboxes in
  asynchronous mode so a step's update can read one while the next step fills the other.
  Inboxes are page-locked in place (whole pages, no power-of-two rounding) in both pinned
  modes: they are only copy targets, and rounding would waste up to a copy of the gradients.
- optimizer states: owned by the optimizer, not by this store.

Parameters are grouped per (owning layer, compute dtype, trainable, caller key); masters and
gradients of a group are flat too, so a layer's gradients come back in one copy. A
parameter shared by two layers (tied embeddings) is stored once, in its first layer's group;
other layers upload it separately and their gradient contributions are added to the same
inbox.

Generation counters per group and buffer order host writes against device reads: a
residency waits until every update queued before its step started has written the buffer it
reads (`wait_weights`).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

PinMode = Literal["alloc", "register", "off"]
PIN_MODES = ("alloc", "register", "off")
_PAGE_BYTES = 4096


@dataclass(eq=False, slots=True)
class HostParam:
    """One unique parameter of the wrapped model and its host-side copies."""

    index: int
    name: str
    param: nn.Parameter
    trainable: bool
    grad_dtype: torch.dtype
    group: ParamGroup | None = None
    offset: int = 0
    uploads: list[torch.Tensor] = field(default_factory=list)
    master: nn.Parameter | None = None
    filled: list[bool] = field(default_factory=lambda: [False, False])
    staging: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.param.numel()

    def grad(self, inbox: int) -> torch.Tensor:
        """This param's view of its group's gradient inbox `inbox`."""
        assert self.group is not None
        flat = self.group.grad_flats[inbox]
        return flat[self.offset : self.offset + self.numel].view(self.param.shape)


@dataclass(eq=False, slots=True)
class ParamGroup:
    """Params of one layer sharing dtype, trainability and key; flat host buffers per role."""

    index: int
    layer: int
    compute_dtype: torch.dtype
    grad_dtype: torch.dtype
    trainable: bool
    key: Hashable
    members: list[HostParam] = field(default_factory=list)
    numel: int = 0
    upload_flats: list[torch.Tensor | None] = field(default_factory=list)
    master_flat: torch.Tensor | None = None
    grad_flats: list[torch.Tensor] = field(default_factory=list)
    staging_flat: torch.Tensor | None = None
    pending: list[int] = field(default_factory=lambda: [0, 0])
    done: list[int] = field(default_factory=lambda: [0, 0])


@dataclass(eq=False, slots=True)
class LayerInfo:
    """Where a pipeline layer's tensors live: module slots, owned groups, params owned elsewhere."""

    module: nn.Module
    param_slots: list[tuple[str, str, HostParam]] = field(default_factory=list)
    buffer_slots: list[tuple[str, str, torch.Tensor]] = field(default_factory=list)
    groups: list[ParamGroup] = field(default_factory=list)
    foreign: list[HostParam] = field(default_factory=list)

    def weight_deps(self) -> list[ParamGroup]:
        """Groups whose upload copies this layer reads."""
        deps = list(self.groups)
        for hp in self.foreign:
            if hp.group not in deps:
                deps.append(hp.group)  # type: ignore[arg-type]
        return deps


class HostStore:
    """The host copies of a pipeline's parameters (see the module docstring)."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        *,
        param_names: dict[int, str],
        pin_mode: PinMode,
        pin: bool,
        compute_dtype: torch.dtype | None = None,
        master_dtype: torch.dtype | None = None,
        group_key: Callable[[str, nn.Parameter], Hashable] | None = None,
        create_masters: bool = False,
    ) -> None:
        if pin_mode not in PIN_MODES:
            raise ValueError(f"pin_model={pin_mode!r} must be one of {PIN_MODES}")
        self.pin_mode: PinMode = pin_mode
        self.pin = pin  # whether page-locking is possible at all (a CUDA device is present)
        self.master_dtype = master_dtype
        self.cond = threading.Condition()
        self.lock = threading.Lock()
        self.layers: list[LayerInfo] = []
        self.params: list[HostParam] = []
        self.groups: list[ParamGroup] = []
        self.num_upload_buffers = 1
        self.num_inboxes = 0
        self.pinned_alloc_bytes = 0  # requested from the pinned allocator (which rounds up to 2^k)
        self.registered_bytes = 0  # page-locked in place (cudaHostRegister)
        self._registered: list[int] = []  # page-locked pointers, unregistered when the store dies
        self._registered_refs: list[torch.Tensor] = []  # keeps those storages alive until then
        weakref.finalize(self, _unregister_all, self._registered, self._registered_refs)
        self._collect(layers, param_names, compute_dtype, group_key)
        if create_masters:
            self.ensure_masters()  # before any cast to the compute dtype: masters keep full precision
        self._layout_uploads(compute_dtype)

    # ---- layout -------------------------------------------------------------------------
    def _collect(self, layers, names, compute_dtype, group_key) -> None:
        by_id: dict[int, HostParam] = {}
        groups: dict[tuple, ParamGroup] = {}
        for layer_index, layer in enumerate(layers):
            info = LayerInfo(module=layer)
            for path, mod in layer.named_modules(remove_duplicate=False):
                for attr, p in mod._parameters.items():
                    if p is None:
                        continue
                    hp = by_id.get(id(p))
                    if hp is None:
                        hp = self._new_param(p, names.get(id(p), f"layers.{layer_index}.{path}.{attr}"))
                        by_id[id(p)] = hp
                        key = self._group_of(hp, layer_index, compute_dtype, group_key)
                        group = groups.get(key)
                        if group is None:
                            group = groups[key] = self._new_group(hp, layer_index, compute_dtype, key[-1])
                            info.groups.append(group)
                        hp.group, hp.offset = group, group.numel
                        group.members.append(hp)
                        group.numel += hp.numel
                    elif hp.group.layer != layer_index and hp not in info.foreign:  # type: ignore[union-attr]
                        info.foreign.append(hp)
                    info.param_slots.append((path, attr, hp))
                for attr, b in mod._buffers.items():
                    if b is not None:
                        info.buffer_slots.append((path, attr, b))
            self.layers.append(info)

    def _new_param(self, p: nn.Parameter, name: str) -> HostParam:
        if p.device.type not in ("cpu", "meta"):
            raise ValueError(f"parameter {name} is on {p.device}; the wrapped model must be on the CPU")
        grad_dtype = self.master_dtype if self.master_dtype is not None and p.is_floating_point() else p.dtype
        hp = HostParam(
            index=len(self.params), name=name, param=p, trainable=p.requires_grad, grad_dtype=grad_dtype
        )
        self.params.append(hp)
        return hp

    def _group_of(self, hp, layer_index, compute_dtype, group_key) -> tuple:
        dtype = _upload_dtype(hp.param, compute_dtype)
        extra = group_key(hp.name, hp.param) if group_key is not None else None
        return (layer_index, dtype, hp.trainable, extra)

    def _new_group(self, hp, layer_index, compute_dtype, extra) -> ParamGroup:
        group = ParamGroup(
            index=len(self.groups), layer=layer_index, compute_dtype=_upload_dtype(hp.param, compute_dtype),
            grad_dtype=hp.grad_dtype, trainable=hp.trainable, key=extra,
        )  # fmt: skip
        self.groups.append(group)
        return group

    def _layout_uploads(self, compute_dtype: torch.dtype | None) -> None:
        to_register: list[torch.Tensor] = []
        for group in self.groups:
            if self.pin_mode == "alloc":
                flat = self.alloc(group.numel, group.compute_dtype)
                for hp in group.members:
                    view = flat[hp.offset : hp.offset + hp.numel].view(hp.param.shape)
                    view.copy_(hp.param.data)
                    hp.param.data = view
                group.upload_flats = [flat]
            else:
                for hp in group.members:
                    if hp.param.dtype != group.compute_dtype:
                        hp.param.data = hp.param.data.to(group.compute_dtype)
                group.upload_flats = [None]
                to_register.extend(hp.param.data for hp in group.members)
            for hp in group.members:
                hp.uploads = [hp.param.data]
        if self.pin_mode == "register" and self.pin:
            self._register(to_register)  # one call: params may share a storage

    def add_upload_buffer(self) -> None:
        """Allocate upload buffer 1 (asynchronous step) as a copy of buffer 0."""
        if self.num_upload_buffers == 2:
            return
        for group in self.groups:
            flat = self.alloc(group.numel, group.compute_dtype)
            for hp in group.members:
                view = flat[hp.offset : hp.offset + hp.numel].view(hp.param.shape)
                view.copy_(hp.uploads[0])
                hp.uploads.append(view)
            group.upload_flats.append(flat)
        self.num_upload_buffers = 2

    def ensure_masters(self) -> list[nn.Parameter]:
        """Create (once) the master weights of trainable params, flat per group; return them in order."""
        for group in self.groups:
            if not group.trainable or group.master_flat is not None:
                continue
            flat = torch.empty(group.numel, dtype=group.grad_dtype)
            for hp in group.members:
                view = flat[hp.offset : hp.offset + hp.numel].view(hp.param.shape)
                view.copy_(hp.param.data)
                hp.master = nn.Parameter(view, requires_grad=True)
            group.master_flat = flat
        return [hp.master for hp in self.params if hp.master is not None]

    def ensure_inboxes(self, count: int) -> None:
        """Allocate gradient inboxes 0..count-1 for trainable groups (page-locked: D2H targets)."""
        for group in self.groups:
            if group.trainable:
                while len(group.grad_flats) < count:
                    group.grad_flats.append(self.alloc(group.numel, group.grad_dtype, exact=True))
        self.num_inboxes = max(self.num_inboxes, count)

    def staging_for_group(self, group: ParamGroup) -> torch.Tensor:
        if group.staging_flat is None:
            group.staging_flat = self.alloc(group.numel, group.grad_dtype, exact=True)
        return group.staging_flat

    def staging_for_param(self, hp: HostParam) -> torch.Tensor:
        if hp.staging is None:
            hp.staging = self.alloc(hp.numel, hp.grad_dtype, exact=True).view(hp.param.shape)
        return hp.staging

    def alloc(self, numel: int, dtype: torch.dtype, *, exact: bool = False) -> torch.Tensor:
        """A host buffer, page-locked as `pin_model` says (plain memory when nothing can be pinned).

        `exact`: page-lock in place instead of through the pinned allocator, which rounds each
        allocation up to a power of two. Gradient buffers use it in both pinned modes: they are
        only device-to-host targets, and 2x on the gradients is too much host memory to waste.
        """
        if not self.pin or self.pin_mode == "off":
            return torch.empty(numel, dtype=dtype)
        if self.pin_mode == "alloc" and not exact:
            t = torch.empty(numel, dtype=dtype, pin_memory=True)
            self.pinned_alloc_bytes += t.numel() * t.element_size()
            return t
        t = _page_aligned_empty(numel, dtype)
        self._register([t])
        return t

    def _register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Page-lock the storages behind `tensors` in place (merged per page range)."""
        tensors = [t for t in tensors if t.numel() > 0 and not t.is_pinned()]
        spans = sorted({_span(t) for t in tensors})
        merged: list[list[int]] = []
        for ptr, size in spans:
            if merged and ptr < merged[-1][0] + merged[-1][1] + _PAGE_BYTES:
                merged[-1][1] = max(merged[-1][1], ptr + size - merged[-1][0])
            else:
                merged.append([ptr, size])
        cudart = torch.cuda.cudart()
        for ptr, size in merged:
            if int(cudart.cudaHostRegister(ptr, size, 0)) != 0:
                warnings.warn(
                    "pin_model='register': cudaHostRegister failed (read-only or memory-mapped weights?); "
                    "these weights stay pageable and upload slower. Use pin_model='off' to silence this",
                    stacklevel=3,
                )
                continue
            self._registered.append(ptr)
            self.registered_bytes += size
        self._registered_refs.extend(tensors)

    # ---- ordering of host writes and device reads --------------------------------------
    def required_gens(self, buf: int) -> list[int]:
        """Per group, the number of writes to upload buffer `buf` queued so far (what a step must see)."""
        with self.cond:
            return [g.pending[buf] for g in self.groups]

    def mark_pending(self, groups: Sequence[ParamGroup], buf: int) -> None:
        with self.cond:
            for g in groups:
                g.pending[buf] += 1

    def mark_done(self, groups: Sequence[ParamGroup], buf: int) -> None:
        with self.cond:
            for g in groups:
                g.done[buf] += 1
            self.cond.notify_all()

    def wait_weights(
        self, groups: Sequence[ParamGroup], buf: int, required: Sequence[int], abort: Callable[[], bool]
    ) -> bool:
        """Block until `groups` hold the writes required; with `abort` returning True, give up (False)."""

        def ready() -> bool:
            return all(g.done[buf] >= required[g.index] for g in groups)

        with self.cond:
            while not ready():
                if abort():
                    return False
                self.cond.wait(timeout=0.05)
        return True

    # ---- sizes --------------------------------------------------------------------------
    def pinned_bytes(self) -> int:
        """Page-locked host bytes this store holds (upload copies, gradient inboxes, staging).

        Allocator-pinned buffers are counted as requested; the pinned allocator rounds each
        one up to a power of two (see `torch.cuda.host_memory_stats()` for what it holds).
        """
        return self.pinned_alloc_bytes + self.registered_bytes

    def layer_bytes(self, *, with_grads: bool) -> list[int]:
        """Device bytes per layer: weights in the compute dtype, plus gradient accumulators if asked."""
        sizes = []
        for info in self.layers:
            seen = {id(hp) for _, _, hp in info.param_slots}
            hps = [hp for hp in self.params if id(hp) in seen]
            total = sum(hp.numel * _dtype_bytes(hp.group.compute_dtype) for hp in hps if hp.group is not None)
            if with_grads:
                total += sum(hp.numel * _dtype_bytes(hp.grad_dtype) for hp in hps if hp.trainable)
            total += sum(b.numel() * b.element_size() for _, _, b in info.buffer_slots)
            sizes.append(total)
        return sizes


def _page_aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised buffer on whole pages of its own, so registering it never overlaps a neighbour."""
    item = torch.empty((), dtype=dtype).element_size()
    nbytes = -(-numel * item // _PAGE_BYTES) * _PAGE_BYTES
    raw = torch.empty(nbytes + _PAGE_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % _PAGE_BYTES
    return raw[start : start + nbytes].view(dtype)[:numel]


def _upload_dtype(p: torch.Tensor, compute_dtype: torch.dtype | None) -> torch.dtype:
    if compute_dtype is None or not p.is_floating_point():
        return p.dtype
    return compute_dtype


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes to page-lock for `t`: its whole storage, or just its own pages when page-aligned."""
    start, nbytes = t.data_ptr(), t.numel() * t.element_size()
    if start % _PAGE_BYTES == 0 and nbytes % _PAGE_BYTES == 0:
        return start, nbytes
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _unregister_all(pointers: list[int], refs: list[torch.Tensor]) -> None:
    if not pointers or not torch.cuda.is_available():
        return
    cudart = torch.cuda.cudart()
    for ptr in pointers:
        cudart.cudaHostUnregister(ptr)
