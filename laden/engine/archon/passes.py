"""How the archon engine's micro-batches cross its pipeline stages: the schedule, or one by one.

A training step runs PyTorch's pipeline schedule (`StepSchedule`): its `PipelineStage`s are
built with the step's shapes given (not inferred: the stage buffers of one length, see
`laden.engine.archon.pipeline`) and rebuilt only when the step's length or micro-batch count
changes, or recompute is switched on. The objective's scaled sum comes out of the last stage.

`prepared` makes a step's micro-batches fit both: the same count on every rank (an all-reduce
over the host group, then padding micro-batches) and, under a pipeline, one length.

`forward_only` (`forward`, `eval_batch`) runs without a schedule: micro-batch by micro-batch,
each stage receives the hidden states from the previous one and sends its own on
(point-to-point over the pipeline group), and the last stage's results are broadcast over the
pipeline, so every rank returns them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from laden.data.batch import PackedBatch
from laden.engine.archon.pipeline import build_schedule, pad_to, padded_count
from laden.engine.parallel.padding import padding_batch
from laden.engine.parallel.ulysses import shard_batch

if TYPE_CHECKING:
    from laden.engine.archon.engine import ArchonEngine


def prepared(engine: ArchonEngine, micro_batches: Sequence[PackedBatch]) -> list[PackedBatch]:
    """On the device, padded to the count every data-parallel rank runs (and the schedule takes),
    and, under a pipeline, to one length (padding micro-batches: one padding document); under
    context parallel, this rank's slice of every row (`laden.engine.parallel.ulysses`)."""
    mbs = [mb.to(engine.device, non_blocking=True) for mb in micro_batches]
    if not engine.distributed:
        if not mbs:
            raise ValueError("the engine got no micro-batches; pass at least one PackedBatch")
        return mbs
    count = torch.tensor([len(mbs)], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=engine.host_group)
    target = padded_count(int(count.item()), name=engine.schedule_name, num_ranks=engine.pp)  # host values
    mbs += [padding_batch().to(engine.device) for _ in range(target - len(mbs))]
    if engine.pp > 1:
        length = max(mb.num_tokens for mb in mbs)
        mbs = [pad_to(mb, length) for mb in mbs]
    if engine.cp > 1:
        mbs = [shard_batch(mb, cp_rank=engine.cp_rank, cp_size=engine.cp) for mb in mbs]
    return mbs


class StepSchedule:
    """The pipeline schedule of one step shape (tokens per micro-batch, micro-batches), kept across steps."""

    def __init__(self) -> None:
        self._shape: tuple[int, int] | None = None
        self._schedule: Any = None

    def reset(self) -> None:
        """Rebuild the stages at the next step (their modules changed, e.g. recompute switched on)."""
        self._shape = None

    def run(self, engine: ArchonEngine, mbs: list[PackedBatch]) -> torch.Tensor:
        """One step's forward and backward over the schedule; this rank's summed scaled objective
        (zero off the last stage)."""
        self._build(engine, mbs[0].num_tokens, len(mbs))
        losses: list[torch.Tensor] = []
        ids = torch.stack([mb.input_ids for mb in mbs])  # [M, T]: the schedule cuts [1, T] chunks
        target = torch.zeros(len(mbs), 1, device=engine.device)
        if engine.first and engine.last:  # both ends on this rank (interleaved)
            self._schedule.step(ids, target=target, losses=losses)
        elif engine.first:
            self._schedule.step(ids)
        elif engine.last:
            self._schedule.step(target=target, losses=losses)
        else:
            self._schedule.step()
        if not engine.last:
            return torch.zeros((), device=engine.device)
        return torch.stack(losses).sum().detach()

    def _build(self, engine: ArchonEngine, num_tokens: int, num_mbs: int) -> None:
        """The `PipelineStage`s (shapes given, not inferred) and the schedule, for this step's shape."""
        from torch.distributed.pipelining import PipelineStage

        if self._shape == (num_tokens, num_mbs):
            return
        device = engine.device
        width = int(engine.config.hidden_size)
        hidden = torch.zeros(
            1, num_tokens, width, dtype=engine.compute_dtype, device=device, requires_grad=True
        )
        stages = []
        for s, module in zip(engine.stage_ids, engine.stages):
            inputs = torch.zeros(1, num_tokens, dtype=torch.long, device=device) if module.first else hidden
            outputs = torch.zeros(1, device=device, requires_grad=True) if module.last else hidden
            stages.append(PipelineStage(module, s, engine.num_stages, device, input_args=(inputs,),
                                        output_args=(outputs,), group=engine.pp_group))  # fmt: skip
        self._schedule = build_schedule(stages, name=engine.schedule_name, num_micro_batches=num_mbs)
        self._shape = (num_tokens, num_mbs)


def forward_only(
    engine: ArchonEngine, mbs: list[PackedBatch], fn: Any, scale: float, keys: tuple[str, ...]
) -> Iterator[dict[str, torch.Tensor]]:
    """Each micro-batch through every stage in turn (no schedule); the last stage's values (`loss`:
    the scaled objective, `[1]`; a per-token output, `[T]`) broadcast over the pipeline."""
    for stage in engine.stages:
        stage.eval()
        stage.start(mbs, fn, scale)
    try:
        for mb in mbs:
            yield _forward_one(engine, mb, keys)
    finally:
        for stage in engine.stages:
            stage.train()
        engine.reshard()


def _forward_one(engine: ArchonEngine, mb: PackedBatch, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    x: Any = mb.input_ids[None]
    width = int(engine.config.hidden_size)
    out: Any = None
    pp = engine.pp
    piped = engine.distributed and pp > 1
    ranks: list[list[int]] = engine.ranks if piped else []  # global rank of (pipeline rank, place)
    coord = engine.coord
    for s in range(engine.num_stages):
        r = s % pp
        if r != engine.pp_rank:
            continue
        if s > 0 and piped and (s - 1) % pp != r:
            x = torch.empty(1, mb.num_tokens, width, dtype=engine.compute_dtype, device=engine.device)
            dist.recv(x, src=ranks[(s - 1) % pp][coord], group=engine.pp_group)
        with engine.autocast():
            out = x = engine.stages[engine.stage_ids.index(s)](x)
        if s < engine.num_stages - 1 and piped and (s + 1) % pp != r:
            dist.send(out.to(engine.compute_dtype).contiguous(), dst=ranks[(s + 1) % pp][coord],
                      group=engine.pp_group)  # fmt: skip
    values = (out if isinstance(out, dict) else {"loss": out}) if engine.last else {}
    if not piped:
        return values
    src = ranks[pp - 1][coord]
    for k in keys:
        shape = (1,) if k == "loss" else (mb.num_tokens,)
        buf = values[k].float().reshape(shape) if engine.last else torch.empty(shape, device=engine.device)
        dist.broadcast(buf, src=src, group=engine.pp_group)
        values[k] = buf
    return values
