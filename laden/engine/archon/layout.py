"""Where the archon engine's pieces live: the process layout checked, each weight's pipeline rank,
FSDP2 over the stages, what leaves this rank.

`check_layout` refuses an `archon:dXpYtZcVeW` layout the world cannot run before anything is
built. `stage_owners` maps every Hugging Face name to the pipeline rank holding it (the
first stage for a tied weight), which gathers it for `named_weights` and writes it into
checkpoints. `shard_stages` puts FSDP2 over each decoder layer and each stage root, with the
expert shards and the replicated MoE parameters left out (the engine reduces their gradients,
`laden.engine.archon.grads`). `release_others` frees the parameters of the other ranks' stages.
`build_mesh` lays the process group out as the engine's five-axis `StageMesh`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from laden.engine.archon.pipeline import SCHEDULES, StageModule
from laden.engine.parallel.params import local_shard


def check_layout(dp: int, pp: int, ep: int, tp: int, cp: int, schedule: str, virtual_stages: int) -> None:
    """ValueError unless every size is at least 1, `e` divides `d`, the schedule is known and the world
    has `d x p x t x c` processes."""
    sizes = (("d", dp), ("p", pp), ("e", ep), ("t", tp), ("c", cp), ("virtual_stages", virtual_stages))
    for name, size in sizes:
        if size < 1:
            raise ValueError(f"actor.backend: {name}={size} must be at least 1")
    if dp % ep:
        raise ValueError(f"actor.backend=archon:d{dp}p{pp}e{ep}: e={ep} must divide d={dp} (e overlays d)")
    if schedule not in SCHEDULES:
        raise ValueError(f"actor.archon.pp_schedule={schedule!r}: use one of {', '.join(SCHEDULES)}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if dp * pp * tp * cp != world:
        raise ValueError(
            f"actor.backend=archon:d{dp}p{pp}t{tp}c{cp}e{ep} needs d x p x t x c = {dp * pp * tp * cp} processes but {world} were "
            f"started; launch with torchrun --nproc_per_node {dp * pp * tp * cp}, or change actor.backend"
        )  # fmt: skip


def stage_owners(
    bounds: Sequence[range], steps: list[nn.Module], names: dict[int, str], hf_names: Iterable[str], pp: int
) -> dict[str, int]:
    """Each Hugging Face name -> the pipeline rank that holds it (the first stage for a tied weight)."""
    owner: dict[str, int] = {}
    for s, r in enumerate(bounds):
        for i in r:
            for p in steps[i].parameters():
                owner.setdefault(names[id(p)], s % pp)
    missing = [n for n in hf_names if n not in owner]
    if missing:
        raise RuntimeError(f"archon: {missing[:3]} are on no pipeline stage; the split left them out")
    return owner


def shard_stages(
    stages: list[StageModule],
    shard_mesh: Any,
    *,
    compute_dtype: torch.dtype,
    storage_dtype: torch.dtype,
    ignored: set[nn.Parameter],
) -> None:
    """`fully_shard` each decoder layer and each stage over `shard_mesh` (masters in `storage_dtype`,
    gathered in `compute_dtype`, fp32 reduce-scatter), leaving the `ignored` parameters plain."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from laden.model.split import DecoderStep

    mp = MixedPrecisionPolicy(
        param_dtype=None if compute_dtype == storage_dtype else compute_dtype, reduce_dtype=torch.float32
    )
    for stage in stages:
        for step in stage.steps:
            if isinstance(step, DecoderStep):
                own = {p for p in step.layer.parameters() if p in ignored}
                fully_shard(step.layer, mesh=shard_mesh, mp_policy=mp, ignored_params=own or None)
        fully_shard(stage, mesh=shard_mesh, mp_policy=mp, ignored_params=ignored or None)


def release_others(model: nn.Module, kept: set[int]) -> None:
    """Every parameter not on this rank's stages moves to the meta device (its memory is freed)."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) not in kept and not p.is_meta:
                meta = torch.empty_like(
                    local_shard(p), device="meta"
                )  # a DTensor (tensor parallel): its shard's
                module._parameters[name] = nn.Parameter(meta, p.requires_grad)


@dataclass(frozen=True, slots=True)
class StageMesh:
    """The `("pp", "edp", "ep", "cp", "tp")` device mesh of a process group and this rank's place in it."""

    mesh: Any
    """The 5-D mesh: pipeline outermost, tensor parallel innermost (closest GPUs), expert parallel next to it."""
    dp_mesh: Any
    """`edp x ep` flattened: which share of the batch a rank trains on."""
    shard_mesh: Any
    """`edp x ep x cp` flattened: what FSDP shards over (context ranks are data ranks to it)."""
    ranks: list[list[int]]
    """The global rank of (pipeline rank, place in the stage)."""
    coord: int
    """This rank's place in its stage."""
    host_group: Any
    """A gloo group over every rank (checkpoint transfers to rank 0, the micro-batch count)."""


def build_mesh(pp: int, dp: int, ep: int, cp: int, tp: int, device_type: str) -> StageMesh:
    """The stage mesh over the started process group (`check_layout` passed)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (pp, dp // ep, ep, cp, tp)  # tensor parallel innermost
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "edp", "ep", "cp", "tp"))
    ranks = mesh.mesh.reshape(pp, -1).tolist()
    pp_rank = mesh["pp"].get_local_rank()
    return StageMesh(
        mesh=mesh, dp_mesh=mesh[("edp", "ep")]._flatten("dp"), shard_mesh=mesh[("edp", "ep", "cp")]._flatten("dp_cp"),
        ranks=ranks, coord=ranks[pp_rank].index(dist.get_rank()), host_group=dist.new_group(backend="gloo"),
    )  # fmt: skip
