"""The native engine's weights: in-place updates by Hugging Face name, and the release and restore
of their storage around `sleep(weights=True)`.

An update copies the new tensors into the model's own parameters (`laden.weights.fill_in_place`),
so there is never a second copy of the model on the device; under tensor parallel the source
gives whole tensors, one at a time, and each rank copies its slice (`ShardLayout.slices`).
Releasing replaces every parameter's storage by an empty tensor (a colocated trainer holds the
same weights) and keeps the shapes, so the next update can allocate and fill them again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from laden.rollout.native.tensor_parallel import ShardLayout


class EngineWeights:
    """`model`'s parameters on `device`; `layout` is this rank's shard under tensor parallel (None
    without); `group_rank` is this process's rank in an xccl weight group (default 1)."""

    def __init__(
        self, model: nn.Module, device: torch.device, layout: ShardLayout | None = None, group_rank: int = 1
    ) -> None:
        self.model, self.device, self.layout, self.group_rank = model, device, layout, group_rank
        self.released = False
        self._shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._groups: dict[tuple, Any] = {}

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """The weights by Hugging Face name (what updates are copied into)."""
        from laden.model.hf.export import hf_state_names

        state = self.model.state_dict(keep_vars=True)
        return {name: state[name].data for name in hf_state_names(self.model)}

    def load(self, source: Any, version: int) -> None:
        """Copy `source` into the parameters (their storage made again first if released): a
        `WeightUpdateMeta` (disk: the directory of `version`; xccl: a broadcast from the trainer,
        received bucket by bucket straight into the parameters), a path (a disk root), or
        `(name, tensor)` pairs / a mapping."""
        if self.released:
            for name, p in self.model.named_parameters():
                shape, dtype = self._shapes[name]
                p.data = torch.empty(shape, dtype=dtype, device=self.device)
        if self.layout is not None:
            self._apply_sharded(source, self.named_parameters(), version)
        else:
            self._apply_source(source, self.named_parameters(), version)
        self.released = False

    def release(self) -> None:
        """Free every parameter's storage (shapes kept for the next `load`)."""
        self._shapes = {}
        for name, p in self.model.named_parameters():
            self._shapes[name] = (p.shape, p.dtype)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.released = True

    def _apply_source(self, source: Any, params: dict[str, torch.Tensor], version: int) -> None:
        from laden.weights import WeightUpdateMeta, fill_in_place, read_weights, receive_into

        if isinstance(source, WeightUpdateMeta):
            if source.type == "disk":
                assert source.path is not None
                fill_in_place(read_weights(source.path, version, device=self.device), params)
            elif source.type == "xccl":
                receive_into(self._weight_group(source), params)
            else:
                raise ValueError(
                    "an inplace WeightUpdateMeta carries no tensors: pass the trainer's "
                    "named_weights(...) to update_weights in the same process"
                )
        elif isinstance(source, (str, Path)):
            fill_in_place(read_weights(source, version, device=self.device), params)
        else:
            fill_in_place(source, params)

    def _apply_sharded(self, source: Any, params: dict[str, torch.Tensor], version: int) -> None:
        """`_apply_source` under tensor parallel: the source gives whole tensors, one at a time (a
        disk version, an xccl broadcast, pairs); this rank copies its slice of each in place."""
        from laden.weights import WeightUpdateMeta, fill_in_place, read_weights, receive

        assert self.layout is not None
        pairs: Any = source
        if isinstance(source, WeightUpdateMeta) and source.type == "xccl":
            pairs = receive(self._weight_group(source), expect=self.layout.full_specs(params))
        elif isinstance(source, WeightUpdateMeta) and source.type == "disk":
            assert source.path is not None
            pairs = read_weights(source.path, version, device=self.device)
        elif isinstance(source, WeightUpdateMeta):
            raise ValueError(
                "an inplace WeightUpdateMeta carries no tensors: pass the trainer's "
                "named_weights(...) to update_weights in the same process"
            )
        elif isinstance(source, (str, Path)):
            pairs = read_weights(source, version, device=self.device)
        fill_in_place(self.layout.slices(pairs), params)

    def _weight_group(self, meta: Any):
        """The xccl group of `meta`, joined once as rank `group_rank`."""
        from laden.weights import init_weight_group

        key = (meta.master_addr, meta.master_port, meta.group_name)
        if key not in self._groups:
            self._groups[key] = init_weight_group(meta, self.group_rank, device=self.device)
        return self._groups[key]
