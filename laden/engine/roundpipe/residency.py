"""A stage resident on one device: its weights uploaded once for all micro-batches, its gradients.

Uploading: each owned parameter group is one host-to-device copy of its flat upload buffer
(or one copy per tensor when the weights are not packed), issued on the device's `weights`
stream so that it overlaps the previous stage's compute; the compute stream waits on one
event before the stage's first micro-batch. Parameters shared with another stage (tied
embeddings) and buffers (rotary frequencies) are copied per tensor, once per residency.

The layers run as *shells*: shallow copies of the host modules (same code, same config
objects, same hooks) whose parameter and buffer slots point at the device tensors. A shell
costs a few dictionary copies, so each residency makes its own; two residencies of one
layer (forward on one device, backward on another) never share mutable state.

Gradients: device parameters of a backward residency are leaves; their gradients are
accumulated over the micro-batches in the optimizer's dtype. When that is the compute
dtype, `.grad` is pre-set to a view of a flat accumulator and autograd adds into it in
place; otherwise (bf16 compute, fp32 master) each parameter's gradient is added into an
fp32 accumulator as soon as autograd has written it (a post-accumulate-grad hook), so
accumulation over micro-batches does not round to bf16 and no stage ever holds a full
bf16 copy of its gradients beside the accumulators. A module that computes its weights'
gradients itself (the lean gated MLP) skips that add: each such leaf carries a
`laden.model.patches.grad_sink.GradSink`, and the module adds the gradient's product into the fp32
accumulator directly (one fp32-output GEMM on CUDA). At the end of the residency each
group's accumulator goes back to the host in one copy, on the `d2h` stream, with its L2
norm computed on the device; in the last micro-batch of a residency an accumulator is
sent as soon as it is final (`arm_early_download`), overlapping the rest of the backward.

A tied weight used by an earlier backward stage than its owner's (the head of a causal LM
with tied embeddings, and the embedding layer) keeps that stage's gradient on the device
when both run on one device (`carry_out`): the owner's stage adds it into its own
accumulator before the one download. The host then receives one copy, with its norm from
the device, instead of two copies, a host add and a host norm pass at the end of the step.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from laden.engine.roundpipe.device import Event, Lane
from laden.engine.roundpipe.host.store import HostParam, HostStore, LayerInfo, ParamGroup
from laden.model.patches.grad_sink import accumulate_product, attach_sink
from laden.model.patches.stacked import stacked_rows


def make_shell(module: nn.Module) -> tuple[nn.Module, dict[str, nn.Module]]:
    """A structural copy of `module` sharing everything but its parameter/buffer/submodule dicts.

    Written as a loop, not a recursive closure: a closure that calls itself is a reference
    cycle, and the cycle would keep every shell (and the device weights bound to it) alive
    until Python's cycle collector happened to run, instead of until `release`.
    """
    root = _shallow_shell(module)
    by_path: dict[str, nn.Module] = {"": root}
    todo = [("", module, root)]
    while todo:
        path, mod, shell = todo.pop()
        for name, child in mod._modules.items():
            if child is None:
                shell._modules[name] = None
                continue
            child_path = f"{path}.{name}" if path else name
            child_shell = shell._modules[name] = by_path[child_path] = _shallow_shell(child)
            todo.append((child_path, child, child_shell))
    return root, by_path


def _shallow_shell(mod: nn.Module) -> nn.Module:
    shell = copy.copy(mod)
    shell._parameters = dict(mod._parameters)
    shell._buffers = dict(mod._buffers)
    shell._modules = dict.fromkeys(mod._modules)  # filled by make_shell, in the original order
    return shell


@dataclass(eq=False)
class GradLanding:
    """One device-to-host gradient copy: where it went and what must happen on the host after it."""

    group: ParamGroup | None  # a whole group (its flat accumulator), or
    param: HostParam | None  # one parameter used outside its owner layer
    staged: bool  # copied into a staging buffer: the host adds it into the inbox
    inbox: int
    event: Event
    # Staged group members whose inbox holds nothing of this window yet: the host copies
    # (not adds) their part, since their inbox still holds an earlier step's (or no) data.
    overwrite: list[HostParam] = field(default_factory=list)
    # The L2 norm of what was copied (fp32, a host scalar valid after `event`), computed on the
    # device, where it is a few milliseconds instead of a host pass over the gradient; only for a
    # direct copy (not staged), the one case where it is the inbox's norm.
    norm: torch.Tensor | None = None


@dataclass(eq=False)
class Residency:
    """Device copies of a stage's layers (see the module docstring)."""

    lane: Lane
    layer_ids: list[int]
    trainable: bool
    modules: dict[int, nn.Module] = field(default_factory=dict)
    device_params: dict[int, torch.Tensor] = field(default_factory=dict)  # HostParam.index -> device
    group_accs: dict[int, torch.Tensor] = field(default_factory=dict)  # ParamGroup.index -> flat acc
    param_accs: dict[int, torch.Tensor] = field(default_factory=dict)  # foreign HostParam.index -> acc
    late_adds: list[tuple[torch.Tensor, nn.Parameter]] = field(default_factory=list)
    # Early gradient download (see `arm_early_download`): which accumulator each parameter feeds
    # ("group" or "param", index), autograd's writes per parameter in this micro-batch and in
    # every earlier one, the download target once armed, and the accumulators already sent.
    feeds: dict[int, tuple[str, int]] = field(default_factory=dict)
    writes: dict[int, int] = field(default_factory=dict)
    writes_per_mb: dict[int, int] | None = None
    same_writes: bool = True
    early: tuple[HostStore, int, Callable[[GradLanding], None]] | None = None
    landed: set[tuple[str, int]] = field(default_factory=set)
    _members: dict[tuple[str, int], list[int]] | None = None
    layer_ready: dict[int, Event] = field(default_factory=dict)  # layer -> its upload, not yet waited on
    # Tied weights (see the module docstring): the foreign parameters whose accumulator stays on
    # the device, and the call's table of such accumulators (HostParam.index -> accumulator),
    # shared by its residencies: filled by the stage that uses them, emptied by their owner's.
    carry_out: frozenset[int] = frozenset()
    carried: dict[int, torch.Tensor] = field(default_factory=dict)

    def members_of(self, key: tuple[str, int]) -> list[int]:
        """The parameters whose gradients feed accumulator `key` (built once per residency)."""
        if self._members is None:
            self._members = {}
            for index, feeds in self.feeds.items():
                self._members.setdefault(feeds, []).append(index)
        return self._members.get(key, [])

    def layer(self, layer_id: int) -> nn.Module:
        """The layer's shell; the first call orders the compute stream after the layer's upload."""
        if layer_id in self.layer_ready:
            self.lane.wait(self.lane.compute, self.layer_ready.pop(layer_id))
        return self.modules[layer_id]

    def wait_uploads(self) -> None:
        """Order the compute stream after every upload not waited on yet (layers a stage never ran)."""
        for event in self.layer_ready.values():
            self.lane.wait(self.lane.compute, event)
        self.layer_ready.clear()


def upload_stage(
    store: HostStore,
    lane: Lane,
    layer_ids: Sequence[int],
    *,
    buf: int,
    trainable: bool,
    carry_out: frozenset[int] = frozenset(),
    carried: dict[int, torch.Tensor] | None = None,
    buffer_source: dict[int, torch.Tensor] | None = None,
) -> Residency:
    """Queue the uploads of `layer_ids` (weights from upload buffer `buf`) and build their shells.

    Layer by layer on the weights stream: a layer's weights, then (training) its leaves and
    zeroed accumulators, then an event the compute stream waits on before the layer first
    runs (`Residency.layer`). A stage's first layer computes while its later layers are
    still crossing the bus, so even a stage that is the whole model (nothing to prefetch it
    behind) waits only for its first layer. `carry_out`, `carried`: see `Residency`.
    `buffer_source`: values to upload instead of some host buffers, by `id` (`buffers.py`).
    """
    res = Residency(
        lane=lane, layer_ids=list(layer_ids), trainable=trainable, carry_out=carry_out,
        carried={} if carried is None else carried,
    )  # fmt: skip
    buffers: dict[int, torch.Tensor] = {}
    owned = {g.index for i in layer_ids for g in store.layers[i].groups if g.trainable}
    with torch.no_grad(), lane.on(lane.weights):
        for layer_id in layer_ids:
            info = store.layers[layer_id]
            for group in info.groups:
                _upload_group(res, group, buf)
            for hp in info.foreign:
                if hp.index not in res.device_params:
                    res.device_params[hp.index] = _to_device(lane, hp.uploads[buf])
            for _, _, b in info.buffer_slots:
                if id(b) not in buffers:
                    buffers[id(b)] = _to_device(lane, (buffer_source or {}).get(id(b), b))
            if trainable:
                _make_leaves_and_accs(store, res, info, owned)
            # Compute waits on this event when the layer first runs, never earlier, so preparing
            # the next stage does not stall the current one.
            res.layer_ready[layer_id] = lane.record(lane.weights)
    for layer_id in layer_ids:
        res.modules[layer_id] = _bind_shell(store.layers[layer_id], res, buffers)
    return res


def _upload_group(res: Residency, group: ParamGroup, buf: int) -> None:
    lane = res.lane
    flat = group.upload_flats[buf] if buf < len(group.upload_flats) else None
    if flat is not None:
        dev = _to_device(lane, flat)  # one copy for the whole group
        for hp in group.members:
            res.device_params[hp.index] = dev[hp.offset : hp.offset + hp.numel].view(hp.param.shape)
    else:
        for hp in group.members:
            res.device_params[hp.index] = _to_device(lane, hp.uploads[buf])


def _to_device(lane: Lane, host: torch.Tensor) -> torch.Tensor:
    dev = torch.empty(host.shape, dtype=host.dtype, device=lane.device)
    dev.copy_(host, non_blocking=True)
    lane.keep_alive(dev, lane.compute)  # allocated on the weights stream, read on compute
    return dev


def _make_leaves_and_accs(store: HostStore, res: Residency, info: LayerInfo, owned: set[int]) -> None:
    """Turn a layer's trainable device params into leaves with zeroed accumulators (weights stream).

    `owned`: the trainable groups of the whole residency; a foreign parameter of one of them
    (a tied weight whose owner layer is in the same stage) shares its owner's leaf.
    """
    for group in info.groups:
        if not group.trainable:
            continue
        acc = _zeros(res.lane, (group.numel,), group.grad_dtype)
        res.group_accs[group.index] = acc
        for hp in group.members:
            view = acc[hp.offset : hp.offset + hp.numel].view(hp.param.shape)
            _make_leaf(res, hp, view, ("group", group.index))
    for hp in info.foreign:
        if hp.trainable and hp.group.index not in owned and hp.index not in res.param_accs:  # type: ignore[union-attr]
            acc = _zeros(res.lane, hp.param.shape, hp.grad_dtype)
            res.param_accs[hp.index] = acc
            _make_leaf(res, hp, acc, ("param", hp.index))


def _zeros(lane: Lane, shape, dtype: torch.dtype) -> torch.Tensor:
    acc = torch.zeros(shape, dtype=dtype, device=lane.device)
    lane.keep_alive(acc, lane.compute)  # allocated on the weights stream, accumulated on compute
    return acc


SINK_WEIGHT_GRADS = True
"""Give compute-dtype leaves with fp32 accumulators a `GradSink` (see `_AccumulatorSink`)."""


def _make_leaf(res: Residency, hp: HostParam, acc: torch.Tensor, feeds: tuple[str, int]) -> None:
    leaf = nn.Parameter(res.device_params[hp.index], requires_grad=True)
    fold = acc.dtype != leaf.dtype
    if fold:
        res.late_adds.append((acc, leaf))
        if SINK_WEIGHT_GRADS:
            attach_sink(leaf, _AccumulatorSink(res, hp.index, acc))
    else:
        leaf.grad = acc  # autograd accumulates in place into the flat accumulator
    res.feeds[hp.index] = feeds
    leaf.register_post_accumulate_grad_hook(functools.partial(_on_grad, res, hp.index, acc if fold else None))
    res.device_params[hp.index] = leaf


def _on_grad(res: Residency, index: int, fold_into: torch.Tensor | None, leaf: torch.Tensor) -> None:
    """After autograd wrote a gradient of parameter `index`: fold it, count it, maybe send its accumulator."""
    if fold_into is not None:
        if leaf.grad is None:  # the module gave its sink the gradient (and the sink counted it) and
            return  # autograd no gradient; torch may still call the hook for that empty gradient
        _fold_grad(res.lane, fold_into, leaf)
    _count_write(res, index)


def _count_write(res: Residency, index: int) -> None:
    res.writes[index] = res.writes.get(index, 0) + 1
    if res.early is not None:
        _land_if_complete(res, res.feeds[index])


@dataclass(eq=False)
class _AccumulatorSink:
    """A compute-dtype leaf's `GradSink`: a module that computes the leaf's weight gradient itself
    (the lean gated MLP) adds it straight into the fp32 accumulator, in one fp32-output GEMM on
    CUDA, instead of writing `leaf.grad` for `_fold_grad` to add. The write is counted as the
    hook counts autograd's, so early downloads see it; on the compute stream, as `_fold_grad`."""

    res: Residency
    index: int
    acc: torch.Tensor

    def accumulate(self, grad_out: torch.Tensor, inp: torch.Tensor, weight_dtype: torch.dtype) -> None:
        with self.res.lane.on(self.res.lane.compute):
            accumulate_product(self.acc, grad_out, inp, weight_dtype)
        _count_write(self.res, self.index)

    @staticmethod
    def join(sinks: Sequence[Any]) -> _JointAccumulatorSink | None:
        """The sinks of weights stacked by rows, as one (`laden.model.patches.grad_sink.joint_sink`): when
        they feed one residency and their accumulators are stacked the same way (a group's flat
        accumulator holds its parameters in the order the module lists them)."""
        if not all(isinstance(s, _AccumulatorSink) and s.res is sinks[0].res for s in sinks):
            return None
        acc = stacked_rows([s.acc for s in sinks])
        if acc is None:
            return None
        return _JointAccumulatorSink(sinks[0].res, [s.index for s in sinks], acc)


@dataclass(eq=False)
class _JointAccumulatorSink:
    """Several `_AccumulatorSink`s whose accumulators are rows of `acc`: one GEMM adds the stacked
    gradient, and each parameter's write is counted."""

    res: Residency
    indices: list[int]
    acc: torch.Tensor

    def accumulate(self, grad_out: torch.Tensor, inp: torch.Tensor, weight_dtype: torch.dtype) -> None:
        with self.res.lane.on(self.res.lane.compute):
            accumulate_product(self.acc, grad_out, inp, weight_dtype)
        for index in self.indices:
            _count_write(self.res, index)


def _fold_grad(lane: Lane, acc: torch.Tensor, leaf: torch.Tensor) -> None:
    """Add a compute-dtype gradient into its accumulator the moment autograd has written it.

    The bf16 gradient of one parameter is then alive only until its own add, not until the
    micro-batch's whole backward is done, so a stage's backward never holds a second,
    compute-dtype copy of all its gradients. The add goes on the compute stream, where the
    backward that wrote `leaf.grad` runs (see `accumulate_microbatch`).
    """
    grad = leaf.grad
    assert grad is not None, "autograd calls the hook after writing the gradient"
    with torch.no_grad(), lane.on(lane.compute):
        acc.add_(grad)
    leaf.grad = None


def arm_early_download(
    store: HostStore, res: Residency, inbox: int, on_landed: Callable[[GradLanding], None]
) -> None:
    """Before the last micro-batch's backward: send each accumulator home as soon as it is final.

    An accumulator is final once every parameter feeding it has received as many gradient
    writes in this micro-batch as in each earlier one (autograd's post-accumulate-grad
    hooks count them), so its device-to-host copy overlaps the rest of the backward instead
    of following it: for a stage that is the whole model, the gradient download no longer
    adds its full time to the step. Needs an earlier micro-batch to count from, and the
    same writes in every one of them (a data-dependent graph is left to the download at
    the end of the residency).
    """
    if res.writes_per_mb is not None and res.same_writes:
        res.early = (store, inbox, on_landed)


def _land_if_complete(res: Residency, key: tuple[str, int]) -> None:
    if key in res.landed:
        raise RuntimeError(
            f"a gradient of {key[0]} {key[1]} was written after its accumulator was sent to the host: the "
            "last micro-batch wrote it more often than the earlier ones (a data-dependent graph); the layers "
            "must run the same backward for every micro-batch of a call"
        )
    expected = res.writes_per_mb or {}
    members = res.members_of(key)
    if all(res.writes.get(i, 0) >= expected.get(i, 0) for i in members):
        store, inbox, on_landed = res.early  # type: ignore[misc]
        _download(store, res, key, inbox, on_landed)


def _bind_shell(info: LayerInfo, res: Residency, buffers: dict[int, torch.Tensor]) -> nn.Module:
    shell, by_path = make_shell(info.module)
    for path, attr, hp in info.param_slots:
        by_path[path]._parameters[attr] = res.device_params[hp.index]  # type: ignore[assignment]
    for path, attr, b in info.buffer_slots:
        by_path[path]._buffers[attr] = buffers[id(b)]
    return shell


def accumulate_microbatch(res: Residency) -> None:
    """After a micro-batch's backward: fold any gradient still in the compute dtype into its accumulator.

    `_fold_grad` (a post-accumulate-grad hook) normally did it already, during the backward;
    this catches a gradient written without the hook running.

    The adds go on the compute stream, behind the backward that produced `leaf.grad` (same
    stream: no event needed) and ahead of the gradient download (which waits for the
    compute stream). Issued on the thread's current stream instead (the default stream,
    which does not synchronise with the engine's non-blocking streams), they would read
    gradients not yet written, race the reuse of the freed `leaf.grad` blocks, and be
    downloaded half done: garbage (NaN) gradients on CUDA, invisible on the CPU.
    """
    for acc, leaf in res.late_adds:
        if leaf.grad is not None:
            _fold_grad(res.lane, acc, leaf)
    if res.writes_per_mb is None:
        res.writes_per_mb = res.writes
    elif res.writes != res.writes_per_mb:
        res.same_writes = False
    res.writes = {}


def download_grads(
    store: HostStore, res: Residency, inbox: int, on_landed: Callable[[GradLanding], None]
) -> None:
    """Queue the gradient copies of a finished backward residency and report each one.

    Accumulators already sent during the last micro-batch (`arm_early_download`) are skipped.
    """
    res.wait_uploads()
    keys = [("group", gid) for gid in res.group_accs] + [("param", pid) for pid in res.param_accs]
    for key in keys:
        if key not in res.landed:
            _download(store, res, key, inbox, on_landed)


def _download(
    store: HostStore,
    res: Residency,
    key: tuple[str, int],
    inbox: int,
    on_landed: Callable[[GradLanding], None],
) -> None:
    """Copy one accumulator home, behind the compute work queued so far, and report the landing.

    A group copies straight into its inbox unless the inbox already holds a gradient of this
    accumulation window (an earlier call, or the other use of a tied weight); then it copies
    into a staging buffer and the host adds it. Decisions and reports happen under the
    store lock, so the host sees a direct copy before any staged add into the same inbox.
    """
    lane = res.lane
    kind, index = key
    acc = res.group_accs[index] if kind == "group" else res.param_accs[index]
    if kind == "param" and index in res.carry_out:  # stays on the device for its owner's stage
        res.carried[index] = acc
        res.landed.add(key)
        return
    if kind == "group":
        _add_carried(res, store.groups[index], acc)
    with torch.no_grad(), store.lock:
        if kind == "group":
            group = store.groups[index]
            busy = [inbox_busy(hp, inbox) for hp in group.members]
            staged = any(busy)
            # A staging buffer is free again: the previous call's staged adds were applied
            # before that call returned (RoundPipe waits for its landings).
            target = store.staging_for_group(group) if staged else group.grad_flats[inbox]
            fresh = [hp for hp, b in zip(group.members, busy) if not b] if staged else []
            landing = GradLanding(group, None, staged, inbox, None, overwrite=fresh)
            members = group.members
        else:
            hp = store.params[index]
            staged = inbox_busy(hp, inbox)
            target = store.staging_for_param(hp) if staged else hp.grad(inbox)
            landing = GradLanding(None, hp, staged, inbox, None)
            members = [hp]
        norm = None
        if not staged:  # the inbox will be exactly this copy: its norm, on the device
            with lane.on(lane.compute):
                norm = torch.linalg.vector_norm(acc, dtype=torch.float32)
        lane.wait(lane.d2h, lane.record(lane.compute))
        with lane.on(lane.d2h):
            target.copy_(acc, non_blocking=True)
            lane.keep_alive(acc, lane.d2h)
            if norm is not None:
                landing.norm = torch.empty((), dtype=torch.float32, pin_memory=lane.pin)
                landing.norm.copy_(norm, non_blocking=True)
                lane.keep_alive(norm, lane.d2h)
            landing.event = lane.record(lane.d2h)
        for hp in members:
            hp.filled[inbox] = True
        res.landed.add(key)
        on_landed(landing)


def _add_carried(res: Residency, group: ParamGroup, acc: torch.Tensor) -> None:
    """Add the gradients an earlier stage of this call left on the device for `group`'s members
    into its flat accumulator (compute stream: behind that stage's backward, on this device)."""
    for hp in group.members:
        carried = res.carried.pop(hp.index, None)
        if carried is not None:
            with torch.no_grad(), res.lane.on(res.lane.compute):
                acc[hp.offset : hp.offset + hp.numel].add_(carried.view(-1))


def carried_params(store: HostStore, plan: Any) -> frozenset[int]:
    """The tied parameters whose gradient a call keeps on the device (see the module docstring).

    A parameter qualifies when one backward stage uses it outside its owner layer, and that
    owner's stage runs later in the backward (stages run in plan order on one device).
    """
    users: dict[int, set[int]] = {}
    owner: dict[int, int] = {}
    for stage_index, stage in enumerate(plan.bwd_plan):
        owned = {g.index for layer in stage for g in store.layers[layer].groups if g.trainable}
        owner.update(dict.fromkeys(owned, stage_index))
        for layer in stage:
            for hp in store.layers[layer].foreign:
                if hp.trainable and hp.group.index not in owned:  # type: ignore[union-attr]
                    users.setdefault(hp.index, set()).add(stage_index)
    return frozenset(
        index
        for index, stages in users.items()
        if len(stages) == 1 and min(stages) < owner.get(store.params[index].group.index, -1)  # type: ignore[union-attr]
    )


def inbox_busy(hp: HostParam, inbox: int) -> bool:
    """Whether a new gradient must be added to (not copied over) `hp`'s inbox.

    True when this window already wrote it, or when the optimizer's master still points at
    it with a gradient the user did not clear (accumulation across steps).
    """
    if hp.filled[inbox]:
        return True
    grad = hp.master.grad if hp.master is not None else None
    return grad is not None and grad.data_ptr() == hp.grad(inbox).data_ptr()


def release(res: Residency) -> None:
    """Drop the device tensors; the allocator reuses them once the streams that used them are done."""
    res.wait_uploads()
    res.early = None
    res.modules.clear()
    res.device_params.clear()
    res.group_accs.clear()
    res.param_accs.clear()
    res.late_adds.clear()


def leaf_params(res: Residency) -> list[Any]:
    return [p for p in res.device_params.values() if isinstance(p, nn.Parameter)]
