"""The engine's optimizer work on the host optimizer thread: one parameter group's update at a time.

Each job updates one group's masters from its gradient inbox and writes the group's upload
copy, then marks the copy written (`HostStore.mark_done`) so that a residency waiting for
those weights may upload them. Two update paths, chosen by the optimizer the one builder
(`laden.optim.build_optimizer(..., where="host")`) made:

- `HostAdamW` (`adam` with fp32 masters, `adam_bf16`): `step_params` on just this group's
  masters; fp32 masters with bf16 compute write the bf16 upload copy in the same pass
  (`params_out_bf16`), so there is no separate cast pass; shared masters (optimizer dtype ==
  compute dtype) are updated in place, in the upload buffer a residency reads next;
- any other torch optimizer (`sgd`; `adam` on bf16 masters, which runs `torch.optim.AdamW`
  with the builder's warning): the group's masters get their gradients as `.grad` and the
  optimizer steps (it skips parameters without a gradient), then the upload copy is written.
"""

from __future__ import annotations

import torch
from torch import nn

from laden.engine.roundpipe.host.store import HostStore, ParamGroup
from laden.optim import HostAdamW


@torch.no_grad()
def update_group(
    store: HostStore, optimizer: torch.optim.Optimizer, group: ParamGroup, buf: int, coef: float
) -> None:
    """Update one group's masters from gradient inbox `buf` (scaled by `coef`) and write upload copy `buf`."""
    members = group.members
    grads = [hp.grad(buf) for hp in members]
    if coef < 1.0:
        group.grad_flats[buf].mul_(coef)
    store.move_masters_to(group, buf)
    masters = [hp.master for hp in members if hp.master is not None]
    fused_out = False
    if isinstance(optimizer, HostAdamW):
        fused_out = (
            not group.shares_master
            and optimizer.state_dtype == torch.float32
            and group.compute_dtype == torch.bfloat16
        )
        outs = [hp.uploads[buf] for hp in members] if fused_out else None
        optimizer.step_params(masters, grads=grads, params_out_bf16=outs)
    else:
        _subset_step(optimizer, masters, grads)
    if not fused_out:
        store.write_uploads([group], buf)
    for hp in members:
        hp.filled[buf] = False
    store.mark_done([group], buf)


def _subset_step(
    optimizer: torch.optim.Optimizer, masters: list[nn.Parameter], grads: list[torch.Tensor]
) -> None:
    """A torch optimizer steps only params with a gradient: give one only to this group's masters."""
    for p, g in zip(masters, grads):
        p.grad = g
    optimizer.step()
    for p in masters:
        p.grad = None


def scheduler_step(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Advance the LR schedule after this step's updates (optimizer thread, after them in order)."""
    # The updates call step_params, not step(); tell the scheduler the optimizer did step.
    scheduler.optimizer._opt_called = True  # type: ignore[attr-defined]
    scheduler.step()


def clip_coef(norm: torch.Tensor, max_norm: float) -> float:
    """The factor torch's clip_grad_norm_ applies: max_norm / (norm + 1e-6), at most 1."""
    return min(1.0, max_norm / (float(norm) + 1e-6))  # host tensor: no device sync
