"""Which host buffers a pipeline's parameters need, and their sizes, before any is allocated.

`HostLayout` walks the pipeline layers once and groups their parameters per (owning layer,
compute dtype, trainable, caller key): every group later gets one flat host buffer per role
(upload copy, master weights, gradient inbox), so a layer's weights go up and its gradients
come back in one copy each. A parameter shared by two layers (tied embeddings) belongs to
its first layer's group; the other layer lists it as *foreign*.

The layout only reads shapes and dtypes, so it works on a model whose parameters are on the
meta device: that is how the host memory of a run is predicted before anything is
allocated (`laden.engine.roundpipe.host.memory`), and how `HostStore` materialises a model
straight into its final buffers.

Master sharing: a trainable group whose optimizer dtype equals its compute dtype
(`adam_bf16` with bf16 compute; fp32 master with fp32 compute) keeps no separate master
copy. Its masters are views of an upload buffer, the optimizer updates them in place and
devices upload what it wrote. That saves one copy of the weights (2 B/param for
`adam_bf16`) at no cost in the synchronous step; the asynchronous step pays one buffer copy
per update instead (see `HostStore.move_masters_to`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

GroupKey = Callable[[str, nn.Parameter], Hashable]


@dataclass(eq=False, slots=True)
class HostParam:
    """One unique parameter of the wrapped model and its host-side copies."""

    index: int
    name: str
    param: nn.Parameter
    trainable: bool
    grad_dtype: torch.dtype
    _group: weakref.ref[ParamGroup] | None = None  # see `group`
    offset: int = 0
    slots: list[tuple[nn.Module, str]] = field(default_factory=list)  # every (module, attr) holding it
    uploads: list[torch.Tensor] = field(default_factory=list)
    master: nn.Parameter | None = None
    filled: list[bool] = field(default_factory=lambda: [False, False])
    staging: torch.Tensor | None = None

    @property
    def group(self) -> ParamGroup | None:
        """The group holding this param's flat buffers. Held weakly: the group holds its members, and
        a strong reference back would make every pipeline a reference cycle, freed (with its host
        buffers and threads) only by the cyclic collector instead of when it is dropped."""
        return None if self._group is None else self._group()

    @group.setter
    def group(self, group: ParamGroup | None) -> None:
        self._group = None if group is None else weakref.ref(group)

    @property
    def numel(self) -> int:
        return self.param.numel()

    def grad(self, inbox: int) -> torch.Tensor:
        """This param's view of its group's gradient inbox `inbox`."""
        assert self.group is not None
        flat = self.group.grad_flats[inbox]
        return flat[self.offset : self.offset + self.numel].view(self.param.shape)


@dataclass(eq=False)  # not slots: members refer to it weakly (HostParam.group)
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
    master_flat: torch.Tensor | None = None  # separate masters only
    master_buf: int = 0  # shared masters: the upload buffer they view (it holds the newest weights)
    grad_flats: list[torch.Tensor] = field(default_factory=list)
    staging_flat: torch.Tensor | None = None
    pending: list[int] = field(default_factory=lambda: [0, 0])
    done: list[int] = field(default_factory=lambda: [0, 0])

    @property
    def shares_master(self) -> bool:
        """Masters are views of an upload buffer (optimizer dtype == compute dtype; see the module docstring)."""
        return self.trainable and self.grad_dtype == self.compute_dtype

    @property
    def has_masters(self) -> bool:
        return any(hp.master is not None for hp in self.members)


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


class HostLayout:
    """The parameter groups of a pipeline's layers (see the module docstring); allocates nothing."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        *,
        param_names: dict[int, str],
        compute_dtype: torch.dtype | None = None,
        master_dtype: torch.dtype | None = None,
        group_key: GroupKey | None = None,
    ) -> None:
        self.master_dtype = master_dtype
        self.layers: list[LayerInfo] = []
        self.params: list[HostParam] = []
        self.groups: list[ParamGroup] = []
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
                        hp = by_id[id(p)] = self._new_param(
                            p, param_names.get(id(p)), layer_index, path, attr
                        )
                        key = (layer_index, upload_dtype(p, compute_dtype), hp.trainable,
                               group_key(hp.name, p) if group_key is not None else None)  # fmt: skip
                        group = groups.get(key)
                        if group is None:
                            group = groups[key] = self._new_group(hp, key)
                            info.groups.append(group)
                        hp.group, hp.offset = group, group.numel
                        group.members.append(hp)
                        group.numel += hp.numel
                    elif hp.group.layer != layer_index and hp not in info.foreign:  # type: ignore[union-attr]
                        info.foreign.append(hp)
                    hp.slots.append((mod, attr))
                    info.param_slots.append((path, attr, hp))
                for attr, b in mod._buffers.items():
                    if b is not None:
                        info.buffer_slots.append((path, attr, b))
            self.layers.append(info)

    def _new_param(self, p: nn.Parameter, name: str | None, layer: int, path: str, attr: str) -> HostParam:
        name = name or f"layers.{layer}.{path}.{attr}"
        if p.device.type not in ("cpu", "meta"):
            raise ValueError(f"parameter {name} is on {p.device}; the wrapped model must be on the CPU")
        grad_dtype = self.master_dtype if self.master_dtype is not None and p.is_floating_point() else p.dtype
        hp = HostParam(
            index=len(self.params), name=name, param=p, trainable=p.requires_grad, grad_dtype=grad_dtype
        )
        self.params.append(hp)
        return hp

    def _new_group(self, hp: HostParam, key: tuple) -> ParamGroup:
        layer, dtype, trainable, extra = key
        group = ParamGroup(
            index=len(self.groups), layer=layer, compute_dtype=dtype, grad_dtype=hp.grad_dtype,
            trainable=trainable, key=extra,
        )  # fmt: skip
        self.groups.append(group)
        return group

    def layer_bytes(self, *, with_grads: bool) -> list[int]:
        """Device bytes per layer: weights in the compute dtype, plus gradient accumulators if asked."""
        sizes = []
        for info in self.layers:
            seen = {id(hp) for _, _, hp in info.param_slots}
            hps = [hp for hp in self.params if id(hp) in seen]
            total = sum(hp.numel * hp.group.compute_dtype.itemsize for hp in hps if hp.group is not None)
            if with_grads:
                total += sum(hp.numel * hp.grad_dtype.itemsize for hp in hps if hp.trainable)
            total += sum(b.numel() * b.element_size() for _, _, b in info.buffer_slots)
            sizes.append(total)
        return sizes

    def shared_bytes(self, *, with_grads: bool) -> list[tuple[frozenset[int], int]]:
        """Parameters several layers use (tied embeddings): (those layers, bytes of one copy) each.

        `layer_bytes` counts such a parameter in every layer that uses it; a stage holding
        several of those layers holds it once.
        """
        users: dict[int, set[int]] = {}
        for layer_index, info in enumerate(self.layers):
            for hp in info.foreign:
                users.setdefault(hp.index, {hp.group.layer}).add(layer_index)  # type: ignore[union-attr]
        out = []
        for index, layers in users.items():
            hp = self.params[index]
            nbytes = hp.numel * hp.group.compute_dtype.itemsize  # type: ignore[union-attr]
            if with_grads and hp.trainable:
                nbytes += hp.numel * hp.grad_dtype.itemsize
            out.append((frozenset(layers), nbytes))
        return out

    def tied_groups(self) -> list[ParamGroup]:
        """Trainable groups with a member another layer uses too (their gradients may be staged)."""
        tied = {hp.group.index for info in self.layers for hp in info.foreign if hp.trainable}  # type: ignore[union-attr]
        return [g for g in self.groups if g.index in tied]


def upload_dtype(p: torch.Tensor, compute_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a parameter is uploaded in: the compute dtype for floating params, else its own."""
    if compute_dtype is None or not p.is_floating_point():
        return p.dtype
    return compute_dtype
