"""The archon engine's gradients that FSDP does not handle, and the global gradient norm.

FSDP reduces the gradients of the parameters it shards (averaged over `dp x c`). Three kinds are
left to the engine, each taken here on the `ArchonEngine` that holds them:

- expert shards (`e > 1`, left out of FSDP): summed over their `edp` replicas and the context
  ranks (whose tokens differ), divided by `dp x c`;
- the MoE blocks' parameters under tensor parallel (whole and plain on every tensor rank):
  summed over every data and context rank, divided by `dp x c` (the tensor ranks computed the
  same values from the same tokens);
- a tied embedding split over the first and last pipeline stage: the two copies' gradients added.

`grad_norm` counts every parameter element once: each rank's local squares, weighted down by
how many ranks hold the same values (expert replicas, replicated tensor-parallel parameters, the
last stage's tied copy), then one all-reduce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from laden.engine.parallel.params import local_shard

if TYPE_CHECKING:
    from laden.engine.archon.engine import ArchonEngine
    from laden.engine.archon.pipeline import StageModule


def sync_sparse_gradients(engine: ArchonEngine) -> None:
    """The expert shards' and the replicated MoE parameters' gradients reduced as FSDP would (see the
    module docstring)."""
    if not engine.distributed:
        return
    dp_cp = engine.dp * engine.cp
    experts = [p.grad for p in engine.experts if p.grad is not None]
    sums = [engine.mesh[axis].get_group() for axis in ("edp", "cp") if engine.mesh[axis].size() > 1]
    for grad in experts:
        for group in sums:
            dist.all_reduce(grad, group=group)
        grad.div_(dp_cp)
    for p in engine.replicated:
        if p.grad is not None:
            if dp_cp > 1:
                dist.all_reduce(p.grad, group=engine.shard_mesh.get_group())
            p.grad.div_(dp_cp)


def tied_params(stages: list[StageModule]) -> list[torch.Tensor]:
    """The tied weight's copies on these stages: the first stage's embedding, the last stage's head."""
    out = []
    for stage in stages:
        steps: list[Any] = list(stage.steps)
        if stage.first:
            out.append(steps[0].embed_tokens.weight)
        if stage.last:
            out.append(steps[-1].lm_head.weight)
    return out


def sum_tied_gradients(engine: ArchonEngine) -> None:
    """The first and the last stage of each data-parallel index add their copies' gradients."""
    if engine.first and engine.last:  # one rank holds both copies (interleaved with p=1 is refused)
        return
    for p in tied_params(engine.stages):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(local_shard(p.grad), group=engine.tied_groups[engine.coord])


def grad_norm(engine: ArchonEngine) -> torch.Tensor:
    """The global gradient norm over every stage and shard, each element counted once."""
    edp = engine.mesh["edp"].size() if engine.distributed else 1
    copies = {"expert": edp * engine.cp * engine.tp, "replicated": engine.dp * engine.cp * engine.tp}
    expert_ids, replicated_ids = {id(p) for p in engine.experts}, {id(p) for p in engine.replicated}
    square = torch.zeros((), device=engine.device)
    seen: set[int] = set()
    for _, p in engine.named_params():
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        g: Any = p.grad
        local = local_shard(g).float()
        if id(p) in expert_ids:
            weight = 1.0 / copies["expert"]
        elif id(p) in replicated_ids:
            weight = 1.0 / copies["replicated"]
        else:
            weight = 1.0 / _tp_copies(g, engine.tp)
        square = square + local.pow(2).sum() * weight
    if engine.tied and engine.last and not engine.first:  # the tied weight counts once, on the first stage
        for t in tied_params(engine.stages)[-1:]:
            assert t.grad is not None
            square = square - local_shard(t.grad).float().pow(2).sum()
    if engine.distributed:
        dist.all_reduce(square)
    return square.sqrt()


def _tp_copies(t: Any, tp: int) -> int:
    """How many tensor-parallel ranks hold the same values of `t` (those replicated over `tp`)."""
    if tp == 1 or not isinstance(t, DTensor):
        return 1
    names = t.device_mesh.mesh_dim_names or ()
    if "tp" not in names:
        return 1
    return tp if t.placements[names.index("tp")].is_replicate() else 1
