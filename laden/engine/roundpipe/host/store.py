"""Host-resident model state of the roundpipe engine: upload copies, master weights, gradients.

Every parameter lives in host memory in up to four forms (grouped as `HostLayout` says):

- upload copy (compute dtype): what a device copies at the start of a residency. With
  `pin_model="alloc"` the copies of a layer are packed into one page-locked flat buffer per
  group (one host-to-device copy per layer group, the fastest path, ~1.5x the model in host
  memory because the pinned allocator rounds each buffer up to a power of two).
  `register` page-locks the existing storage in place (`cudaHostRegister`, ~1x); `off`
  leaves it pageable and, where the parameter already is in the compute dtype, *is* it: a
  weight memory-mapped from safetensors (`from_pretrained` in the compute dtype) stays a
  file-backed view that the kernel pages in on demand and drops under memory pressure, so a
  LoRA fine-tune of a model larger than host memory holds only adapters, their optimizer
  states and gradients in anonymous memory (slowest: every residency reads the pages anew).
  Without CUDA nothing can be pinned and all three modes only choose the layout (flat for
  `alloc`, per-tensor otherwise). The model's own parameters become views of upload buffer
  0, so the wrapped model always holds current weights in its compute dtype. The
  one-step-stale asynchronous update needs a second upload buffer (allocated on first use).
- master weight (optimizer dtype, trainable params only): what the optimizer updates. When
  the optimizer dtype is the compute dtype the master *is* an upload buffer (no copy; see
  `host.layout`): the update writes in place what the next residency uploads. In
  asynchronous mode the masters ping-pong between the two upload buffers: before an update
  writes buffer b, `move_masters_to(b)` copies the newest weights (in the other buffer,
  which the running step reads) into b and re-points the masters at b. Otherwise masters
  are a flat plain-memory buffer per group and each update writes the upload copy too.
- gradient inbox (optimizer dtype): where device gradients land, accumulated across
  micro-batches on the device and across `forward_backward` calls here; two inboxes in
  asynchronous mode so a step's update can read one while the next step fills the other.
  Inboxes are page-locked in place (whole pages, no power-of-two rounding) in both pinned
  modes: they are only copy targets, and rounding would waste up to a copy of the gradients.
- optimizer states: owned by the optimizer, not by this store.

A model whose parameters are on the meta device is materialised straight into these
buffers, layer by layer (`init_meta` fills each new parameter, e.g. a Hugging Face model's
`_init_weights`), so building never holds a second copy of the model; without `init_meta`
it stays a shapes-only skeleton (enough for planning, not for running). A real model is
converted group by group, and each group's original storage is freed as soon as its copies
exist: the peak is the final store plus one group.

Generation counters per group and buffer order host writes against device reads: a
residency waits until every update queued before its step started has written the buffer it
reads (`wait_weights`). `nbytes_by_kind` reports what was actually allocated.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import nn

from laden.engine.roundpipe.host.layout import HostLayout, HostParam, LayerInfo, ParamGroup

PinMode = Literal["alloc", "register", "off"]
PIN_MODES = ("alloc", "register", "off")
STORE_KINDS = ("weights", "weights_stale", "master", "grad", "grad_staging", "buffers", "pinned_rounding")
InitFn = Callable[[nn.Module], None]
_PAGE_BYTES = 4096

__all__ = [
    "PIN_MODES",
    "STORE_KINDS",
    "HostParam",
    "HostStore",
    "InitFn",
    "LayerInfo",
    "ParamGroup",
    "PinMode",
    "alloc_nbytes",
]


class HostStore:
    """The host copies of a pipeline's parameters (see the module docstring)."""

    def __init__(
        self,
        layout: HostLayout,
        *,
        pin_mode: PinMode,
        pin: bool,
        create_masters: bool = False,
        init_meta: InitFn | None = None,
    ) -> None:
        if pin_mode not in PIN_MODES:
            raise ValueError(f"pin_model={pin_mode!r} must be one of {PIN_MODES}")
        self.layout = layout
        self.layers: list[LayerInfo] = layout.layers
        self.params: list[HostParam] = layout.params
        self.groups: list[ParamGroup] = layout.groups
        self.pin_mode: PinMode = pin_mode
        self.pin = pin  # whether page-locking is possible at all (a CUDA device is present)
        self.cond = threading.Condition()
        self.lock = threading.Lock()
        self.num_upload_buffers = 1
        self.num_inboxes = 0
        self.pinned_alloc_bytes = 0  # requested from the pinned allocator (which rounds up to 2^k)
        self.pinned_rounding_bytes = 0  # what that rounding adds on top
        self.registered_bytes = 0  # page-locked in place (cudaHostRegister)
        # (pointer, bytes) of each page-locked range, unregistered when the store dies
        self._registered: list[tuple[int, int]] = []
        self._registered_refs: list[torch.Tensor] = []  # keeps those storages alive until then
        weakref.finalize(self, _unregister_all, self._registered, self._registered_refs)
        self._allocate(create_masters, init_meta)

    # ---- allocation ---------------------------------------------------------------------
    def _allocate(self, create_masters: bool, init_meta: InitFn | None) -> None:
        """Layer by layer: masters and upload copies per group, meta params materialised and filled."""
        to_register: list[torch.Tensor] = []
        if self.pin_mode == "off":
            _warn_cast_frozen(self.groups)
        for info in self.layers:
            fresh: list[HostParam] = []
            for group in info.groups:
                if init_meta is None and any(hp.param.is_meta for hp in group.members):
                    _leave_on_meta(group)
                    continue
                fresh += self._allocate_group(group, create_masters, to_register)
            if fresh:
                assert init_meta is not None  # meta groups without it were left on meta above
                _initialise(info, fresh, init_meta)
        meta_buffers = [f"{p}.{a}" for info in self.layers for p, a, b in info.buffer_slots if b.is_meta]
        if meta_buffers and init_meta is not None:
            raise ValueError(
                f"buffers {meta_buffers[:3]} are on the meta device; build the model with parameters on meta and "
                "real buffers (laden.engine.roundpipe.host.memory.meta_params) so rotary tables stay computed"
            )
        if create_masters:
            self.ensure_masters()
        if self.pin_mode == "register" and self.pin:
            self._register(to_register)  # one call: params may share a storage

    def _allocate_group(self, group: ParamGroup, create_masters: bool, to_register: list) -> list[HostParam]:
        """Allocate one group's buffers and fill them from real params; return its meta params (rebound)."""
        separate = create_masters and group.trainable and not group.shares_master
        masters = torch.empty(group.numel, dtype=group.grad_dtype) if separate else None
        flat = self.alloc(group.numel, group.compute_dtype) if self.pin_mode == "alloc" else None
        fresh = []
        with torch.no_grad():
            for hp in group.members:
                part, shape = slice(hp.offset, hp.offset + hp.numel), hp.param.shape
                master = masters[part].view(shape) if masters is not None else None
                if flat is not None:
                    upload = flat[part].view(shape)
                elif hp.param.is_meta or hp.param.dtype != group.compute_dtype:
                    upload = torch.empty(shape, dtype=group.compute_dtype)
                else:
                    upload = hp.param.data  # the param's own storage is the upload copy
                if hp.param.is_meta:
                    _rebind(hp, master if master is not None else upload)  # init_meta fills it
                    fresh.append(hp)
                else:
                    if master is not None:
                        master.copy_(hp.param.data)  # before any cast: masters keep full precision
                    if upload.data_ptr() != hp.param.data_ptr():
                        upload.copy_(hp.param.data)
                        hp.param.data = upload  # frees the original storage (nothing else holds it)
                hp.uploads = [upload]
                if flat is None:
                    to_register.append(upload)
        group.upload_flats = [flat]
        group.master_flat = masters
        return fresh

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
        """Create (once) the master weights of trainable params; return them in order.

        Shared masters view upload buffer `master_buf`; separate ones are a flat per group,
        copied from the current weights.
        """
        for group in self.groups:
            if not group.trainable or group.has_masters:
                continue
            if group.shares_master:
                for hp in group.members:
                    hp.master = nn.Parameter(hp.uploads[group.master_buf], requires_grad=True)
                continue
            if group.master_flat is None:
                group.master_flat = torch.empty(group.numel, dtype=group.grad_dtype)
                for hp in group.members:
                    group.master_flat[hp.offset : hp.offset + hp.numel].view(hp.param.shape).copy_(
                        hp.param.data
                    )
            for hp in group.members:
                view = group.master_flat[hp.offset : hp.offset + hp.numel].view(hp.param.shape)
                hp.master = nn.Parameter(view, requires_grad=True)
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
        `alloc_nbytes` gives the bytes a call takes without making it.
        """
        if not self.pin or self.pin_mode == "off":
            return torch.empty(numel, dtype=dtype)
        if self.pin_mode == "alloc" and not exact:
            t = torch.empty(numel, dtype=dtype, pin_memory=True)
            nbytes = t.numel() * t.element_size()
            self.pinned_alloc_bytes += nbytes
            self.pinned_rounding_bytes += _pow2_ceil(nbytes) - nbytes
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
            self._registered.append((ptr, size))
            self.registered_bytes += size
        self._registered_refs.extend(tensors)

    def page_locked(self, t: torch.Tensor) -> bool:
        """Whether `t`'s memory is page-locked: pinned-allocated, or inside a span this store registered.

        `Tensor.is_pinned()` sees only the first kind on recent torch (2.11 reports memory
        page-locked with `cudaHostRegister` as pageable), so `pin_model='register'` is checked here.
        """
        if t.is_pinned():
            return True
        ptr, size = _span(t)
        return any(start <= ptr and ptr + size <= start + length for start, length in self._registered)

    # ---- masters and upload copies ------------------------------------------------------
    def move_masters_to(self, group: ParamGroup, buf: int) -> None:
        """Shared masters: make upload buffer `buf` hold the newest weights and the masters view it.

        Called on the optimizer thread before an update that writes buffer `buf` in place. The
        copy reads the buffer the running step may be uploading from (reads only) and writes
        the one no step reads until this update is marked done.
        """
        if not group.shares_master or group.master_buf == buf:
            return
        self._copy_upload(group, group.master_buf, buf)
        for hp in group.members:
            if hp.master is not None:
                hp.master.data = hp.uploads[buf]
        group.master_buf = buf

    def write_uploads(self, groups: Sequence[ParamGroup], buf: int) -> None:
        """Write the masters of `groups` into upload buffer `buf` (cast to the compute dtype).

        A frozen group has no master: buffer 0 (the model's own parameters) is copied instead."""
        with torch.no_grad():
            for group in groups:
                if not group.trainable:
                    if buf != 0:
                        self._copy_upload(group, 0, buf)
                    continue
                if group.shares_master:
                    if group.master_buf != buf:
                        self._copy_upload(group, group.master_buf, buf)
                    continue
                assert group.master_flat is not None, "refreshing a group without master weights"
                flat = group.upload_flats[buf]
                if flat is not None:
                    flat.copy_(group.master_flat)
                else:
                    for hp in group.members:
                        hp.uploads[buf].copy_(hp.master.detach())  # type: ignore[union-attr]

    def _copy_upload(self, group: ParamGroup, src: int, dst: int) -> None:
        with torch.no_grad():
            a, b = group.upload_flats[src], group.upload_flats[dst]
            if a is not None and b is not None:
                b.copy_(a)
            else:
                for hp in group.members:
                    hp.uploads[dst].copy_(hp.uploads[src])

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
        with self.cond:
            while not self._written(groups, buf, required):
                if abort():
                    return False
                self.cond.wait(timeout=0.05)
        return True

    def weights_written(self, groups: Sequence[ParamGroup], buf: int, required: Sequence[int]) -> bool:
        """Whether `groups` hold the writes required now (`wait_weights` without the wait)."""
        with self.cond:
            return self._written(groups, buf, required)

    @staticmethod
    def _written(groups: Sequence[ParamGroup], buf: int, required: Sequence[int]) -> bool:
        return all(g.done[buf] >= required[g.index] for g in groups)

    # ---- sizes --------------------------------------------------------------------------
    def pinned_bytes(self) -> int:
        """Page-locked host bytes this store holds (upload copies, gradient inboxes, staging).

        Allocator-pinned buffers are counted as requested; the pinned allocator rounds each
        one up to a power of two (`pinned_rounding_bytes` more).
        """
        return self.pinned_alloc_bytes + self.registered_bytes

    def layer_bytes(self, *, with_grads: bool) -> list[int]:
        """Device bytes per layer: weights in the compute dtype, plus gradient accumulators if asked."""
        return self.layout.layer_bytes(with_grads=with_grads)

    def nbytes_by_kind(self) -> dict[str, int]:
        """Host bytes this store holds, by kind (`STORE_KINDS`), each storage counted once.

        `weights`: upload buffer 0 (also the masters when they are shared); `weights_stale`:
        upload buffer 1 (asynchronous step); `master`: separate masters; `grad`: inboxes;
        `grad_staging`; `buffers`: module buffers; `pinned_rounding`: what the pinned
        allocator adds by rounding up (0 without CUDA).
        """
        out = dict.fromkeys(STORE_KINDS, 0)
        seen: set[int] = set()

        def add(kind: str, tensors: Sequence[torch.Tensor | None]) -> None:
            for t in tensors:
                if t is None or t.numel() == 0:
                    continue
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    out[kind] += storage.nbytes()

        for group in self.groups:
            for buf, flat in enumerate(group.upload_flats):
                tensors = [flat] if flat is not None else [hp.uploads[buf] for hp in group.members]
                add("weights" if buf == 0 else "weights_stale", tensors)
            add("master", [group.master_flat, *(hp.master for hp in group.members)])
            add("grad", group.grad_flats)
            add("grad_staging", [group.staging_flat, *(hp.staging for hp in group.members)])
        add("buffers", [b for info in self.layers for _, _, b in info.buffer_slots])
        out["pinned_rounding"] = self.pinned_rounding_bytes
        return out


def alloc_nbytes(
    numel: int, dtype: torch.dtype, *, pin_mode: PinMode, pinned: bool, exact: bool
) -> tuple[int, int]:
    """(storage bytes, pinned-allocator rounding) that `HostStore.alloc` takes for such a buffer."""
    nbytes = numel * dtype.itemsize
    if not pinned or pin_mode == "off":
        return nbytes, 0
    if pin_mode == "alloc" and not exact:
        return nbytes, _pow2_ceil(nbytes) - nbytes
    return -(-nbytes // _PAGE_BYTES) * _PAGE_BYTES + _PAGE_BYTES, 0  # see _page_aligned_empty


def _warn_cast_frozen(groups: Sequence[ParamGroup]) -> None:
    """With `pin_model="off"` a frozen weight in the compute dtype stays the storage it was loaded in
    (a safetensors memory map stays file-backed, paged in on demand); one in another dtype is cast
    into host memory. Say so once, with the bytes it costs."""
    cast = [(hp, g.compute_dtype) for g in groups if not g.trainable for hp in g.members
            if not hp.param.is_meta and hp.param.dtype != g.compute_dtype]  # fmt: skip
    if cast:
        nbytes = sum(hp.numel * hp.param.dtype.itemsize for hp, _ in cast)
        (first, dtype) = cast[0]
        warnings.warn(
            f"pin_model='off': {len(cast)} frozen parameters ({nbytes / 2**30:.2f} GiB, e.g. {first.name} in "
            f"{first.param.dtype}) are cast to the compute dtype {dtype} in host memory, so they "
            "are no longer read on demand from a memory-mapped checkpoint; store the checkpoint in the compute "
            "dtype to keep them file-backed",
            stacklevel=4,
        )


def _rebind(hp: HostParam, data: torch.Tensor) -> None:
    """Replace a meta parameter by a real one over `data` in every module slot that holds it."""
    fresh = nn.Parameter(data, requires_grad=hp.param.requires_grad)
    for module, attr in hp.slots:
        module._parameters[attr] = fresh
    hp.param = fresh


def _leave_on_meta(group: ParamGroup) -> None:
    """Without `init_meta` a meta group stays a shapes-only skeleton: enough to plan, not to run."""
    for hp in group.members:
        hp.uploads = [hp.param]
    group.upload_flats = [None]


def _initialise(info: LayerInfo, fresh: list[HostParam], init_meta: InitFn) -> None:
    """Fill a layer's newly materialised params with `init_meta`, then cast them into their upload copies."""
    fresh_ids = {id(hp.param) for hp in fresh}
    with torch.no_grad():
        for module in info.module.modules():
            if any(id(p) in fresh_ids for p in module._parameters.values() if p is not None):
                init_meta(module)
        for hp in fresh:
            upload = hp.uploads[0]
            if upload.data_ptr() != hp.param.data_ptr():  # filled in full precision in the master
                upload.copy_(hp.param.data)
                hp.param.data = upload


def _pow2_ceil(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _page_aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised buffer on whole pages of its own, so registering it never overlaps a neighbour."""
    nbytes = -(-numel * dtype.itemsize // _PAGE_BYTES) * _PAGE_BYTES
    raw = torch.empty(nbytes + _PAGE_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % _PAGE_BYTES
    return raw[start : start + nbytes].view(dtype)[:numel]


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes to page-lock for `t`: its whole storage, or just its own pages when page-aligned."""
    start, nbytes = t.data_ptr(), t.numel() * t.element_size()
    if start % _PAGE_BYTES == 0 and nbytes % _PAGE_BYTES == 0:
        return start, nbytes
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _unregister_all(spans: list[tuple[int, int]], refs: list[torch.Tensor]) -> None:
    if not spans or not torch.cuda.is_available():
        return
    cudart = torch.cuda.cudart()
    for ptr, _ in spans:
        cudart.cudaHostUnregister(ptr)
