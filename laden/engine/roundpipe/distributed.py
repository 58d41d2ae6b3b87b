"""Data parallelism across nodes: replicas all-reduce their host gradients before the update.

Each node runs one replica (its GPUs form the replica's device pool); the gradients live
in host memory, so they are reduced with a gloo process group over CPU tensors, one flat
buffer per parameter group. When the default group is NCCL (GPU tensors only), a gloo
group over the same ranks is created once. The engine reduces group by group as soon as a
group's gradient is complete (in a fixed order, see `step_grads`), overlapping the
reduction with the rest of the backward; the library API reduces everything at `step`.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def host_grad_group(process_group: Any = None) -> Any:
    """The group to all-reduce host gradients over, or None when there is a single replica."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(process_group) == 1:
        return None
    if dist.get_backend(process_group) == "gloo":
        return process_group if process_group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
    return dist.new_group(ranks=ranks, backend="gloo")
