"""Parameters of a sharded model: cast to their storage dtype, a DTensor's local shard, a rank's slice.

`cast_params_` runs before sharding (FSDP keeps the dtype it finds as the master's);
`local_shard` is what offload and checkpoint code copies (it shares the DTensor's storage);
`own_slice` lets a checkpoint of full plain tensors (one process wrote it, `torch.load` read
it) load into sharded parameters, each rank taking its slice without a collective.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def cast_params_(model: nn.Module, dtype: torch.dtype, *, frozen_dtype: torch.dtype | None = None) -> None:
    """Cast floating parameters (not buffers: RoPE tables keep their precision) in place; frozen ones
    (`requires_grad=False`: LoRA's base weights) to `frozen_dtype` when given (no optimizer reads them)."""
    for param in model.parameters():
        target = dtype if param.requires_grad or frozen_dtype is None else frozen_dtype
        if param.is_floating_point() and param.dtype != target:
            param.data = param.data.to(target)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The rank's shard of a DTensor (sharing storage); a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def own_slice(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`value`, a state laid out like `param`; a full plain tensor of a sharded `param` becomes this
    rank's slice of it (what DTensor's placements give this rank; no collective)."""
    if isinstance(value, DTensor) or not isinstance(param, DTensor) or value.shape != param.shape:
        return value
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return value[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
