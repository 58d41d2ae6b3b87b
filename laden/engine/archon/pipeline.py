"""Pipeline parallel training of a causal LM over `torch.distributed.pipelining` (the `p` of `archon:`).

The first part of the `archon` engine: one process per pipeline stage (`archon:d1pP`), each holding a
contiguous run of the model's pipeline steps (`laden.model.split`: the embedding, decoder layers, the
final norm and head), cut where the per-step costs balance (`stage_bounds`: parameter bytes plus
what a micro-batch's forward keeps, `laden.model.split.activation_bytes`, not the layer count), and
PyTorch's schedules (`GPipe`, `1F1B`) over the step's token-budget micro-batches.

How laden's packed micro-batches cross the pipeline: the schedule moves one tensor between stages
(the hidden states `[1, T, H]`; the token ids into the first stage, the objective's sum out of the
last). Every stage holds the step's micro-batches (they are packed from the same samples on every
rank of a `d1` pipeline), and reads the positions, document boundaries, labels and per-token fields
of the one it computes from them: the schedules run each stage's forwards in micro-batch order. The
micro-batches of a step are padded to one length (a padding document: no loss, no attention across)
so the stage buffers have one shape; the stages and the schedule are rebuilt when the step's length
or micro-batch count changes. Stage shapes are given, not inferred, so no forward runs outside the
schedule.

A tied embedding and head (`tie_word_embeddings`) live on the first and the last stage as two copies;
their gradients are summed between the two before the optimizer step, so both take the same update.
The gradient norm for clipping is taken over every stage (the tied copy counted once).
Not yet here (issue [10]): data, expert, tensor and context parallel within the pipeline, the
interleaved schedules, `forward` / `named_weights` / checkpoints, and the `actor.backend: archon:`
wiring; `laden sft` and `laden rl` still refuse `archon:`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn

from laden.data.batch import PackedBatch

Schedule = Literal["GPipe", "1F1B"]
SCHEDULES: tuple[str, ...] = ("GPipe", "1F1B")


def stage_bounds(costs: Sequence[int], num_stages: int) -> list[range]:
    """Contiguous ranges of `costs` (one per pipeline step) into `num_stages` stages with the smallest
    largest stage cost (exact, by dynamic programming; ties go to earlier cuts)."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} pipeline steps into {num_stages} stages: use 1 to {n} stages")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds, j = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][j]
        bounds.append(range(i, j))
        j = i
    return bounds[::-1]


def step_costs(
    steps: Sequence[nn.Module], num_tokens: int, *, dtype: torch.dtype, loss_chunk_size: int
) -> list[int]:
    """Per pipeline step: its parameter bytes plus what a `num_tokens` micro-batch's forward keeps."""
    from laden.model.split import activation_bytes

    out = []
    for step in steps:
        kept, _ = activation_bytes(step, num_tokens, dtype=dtype, loss_chunk_size=loss_chunk_size)
        out.append(sum(p.numel() * p.element_size() for p in step.parameters()) + kept)
    return out


def pad_to(batch: PackedBatch, num_tokens: int) -> PackedBatch:
    """`batch` with a padding document appended up to `num_tokens` tokens (no loss, attends to itself)."""
    extra = num_tokens - batch.num_tokens
    if extra < 0:
        raise ValueError(f"a micro-batch of {batch.num_tokens} tokens cannot be padded to {num_tokens}")
    if extra == 0:
        return batch
    dev = batch.input_ids.device
    bounds = batch.cu_seqlens.tolist() + [num_tokens]
    return replace(
        batch,
        input_ids=torch.cat([batch.input_ids, batch.input_ids.new_zeros(extra)]),
        position_ids=torch.cat(
            [batch.position_ids, torch.arange(extra, device=dev, dtype=batch.position_ids.dtype)]
        ),
        labels=torch.cat([batch.labels, batch.labels.new_full((extra,), -100)]),
        cu_seqlens=torch.tensor(bounds, dtype=batch.cu_seqlens.dtype, device=dev),
        max_seqlen=max(batch.max_seqlen, extra),
        fields={k: torch.cat([v, v.new_zeros(extra)]) for k, v in batch.fields.items()},
    )


class _StageModule(nn.Module):
    """A stage's pipeline steps; reads the micro-batch it computes from the step's list (module docstring)."""

    def __init__(self, steps: Sequence[nn.Module], *, first: bool, last: bool) -> None:
        super().__init__()
        self.steps = nn.ModuleList(steps)
        self.first, self.last = first, last
        self.micro_batches: list[PackedBatch] = []
        self.objective: Any = None
        self.normalizer = 1.0
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from laden.model.split import DecoderState

        mb = self.micro_batches[self.calls]
        self.calls += 1
        packed = dict(cu_seq_lens_q=mb.cu_seqlens, cu_seq_lens_k=mb.cu_seqlens, max_length_q=mb.max_seqlen,
                      max_length_k=mb.max_seqlen)  # fmt: skip
        steps = list(self.steps)
        if self.first:
            state = steps.pop(0)(x, position_ids=mb.position_ids[None], **packed)
        else:
            state = DecoderState(x, mb.position_ids[None], None, packed)
        head = steps.pop() if self.last else None
        for step in steps:
            state = step(state)
        if head is None:
            return state.hidden_states
        out = head(state)
        return (self.objective(out.hidden_states[0], out.lm_head_weight, mb) / self.normalizer).reshape(1)


class PipelineTrainer:
    """One pipeline stage of a causal LM and its optimizer, in this process (module docstring).

    model: the whole model, on this process's device (each process builds the same one); only this
    stage's steps are kept. group: the pipeline's process group (rank r computes stage r).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        optim: Any,
        group: Any = None,
        schedule: Schedule = "1F1B",
        device: torch.device | str = "cpu",
        plan_tokens: int = 4096,
        loss_chunk_size: int = 1024,
        bounds: Sequence[range] | None = None,
    ) -> None:
        from laden.model.attention import set_attention
        from laden.model.split import split_causal_lm
        from laden.optim import build_optimizer, param_groups_with_decay

        if schedule not in SCHEDULES:
            raise ValueError(f"actor.archon.pp_schedule={schedule!r}: use one of {SCHEDULES}")
        self.group: Any = group if group is not None else dist.group.WORLD  # a ProcessGroup
        self.rank, self.num_stages = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.device, self.schedule_name = torch.device(device), schedule
        set_attention(model, "auto")  # packed rows: the varlen kernel keeps the documents apart
        split = split_causal_lm(model)
        steps = list(split.layers)
        dtype = next(model.parameters()).dtype
        self.bounds = list(bounds) if bounds is not None else stage_bounds(
            step_costs(steps, plan_tokens, dtype=dtype, loss_chunk_size=loss_chunk_size), self.num_stages
        )  # fmt: skip
        mine = self.bounds[self.rank]
        self.first, self.last = mine.start == 0, mine.stop == len(steps)
        self.module = _StageModule([steps[i] for i in mine], first=self.first, last=self.last).to(self.device)
        self.hidden_size = int(split.config.hidden_size)
        names = {id(p): n for n, p in model.named_parameters()}
        self.named = [(names[id(p)], p) for p in self.module.parameters()]
        self.tied = bool(getattr(split.config, "tie_word_embeddings", False)) and self.num_stages > 1
        if self.tied:  # every rank takes part in creating it; the first and the last use it
            ends = [dist.get_global_rank(cast(Any, self.group), r) for r in (0, self.num_stages - 1)]
            self._tied_group = dist.new_group(ends)
        self.optim_settings = optim
        self.optimizer = build_optimizer(param_groups_with_decay(self.named, optim.weight_decay), optim)
        self.scheduler = optim.build_scheduler(self.optimizer)
        self._built: tuple[int, int] | None = None
        self._schedule: Any = None

    # ---- the schedule
    def _build(self, num_tokens: int, num_mbs: int) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if self._built == (num_tokens, num_mbs):
            return
        dtype = next(self.module.parameters()).dtype
        hidden = torch.zeros(
            1, num_tokens, self.hidden_size, dtype=dtype, device=self.device, requires_grad=True
        )
        inputs = torch.zeros(1, num_tokens, dtype=torch.long, device=self.device) if self.first else hidden
        outputs = torch.zeros(1, device=self.device, requires_grad=True) if self.last else hidden
        stage = PipelineStage(self.module, self.rank, self.num_stages, self.device, input_args=(inputs,),
                              output_args=(outputs,), group=self.group)  # fmt: skip
        kind = Schedule1F1B if self.schedule_name == "1F1B" else ScheduleGPipe
        self._schedule = kind(
            stage, n_microbatches=num_mbs, loss_fn=lambda out, _: out.sum(), scale_grads=False
        )
        self._built = (num_tokens, num_mbs)

    def forward_backward(
        self, micro_batches: Sequence[PackedBatch], objective: Any, *, normalizer: float
    ) -> torch.Tensor:
        """Fresh gradients of `sum(objective(mb)) / normalizer` on this stage; returns the loss (every stage)."""
        length = max(mb.num_tokens for mb in micro_batches)
        mbs = [pad_to(mb.to(self.device), length) for mb in micro_batches]
        self._build(length, len(mbs))
        self.optimizer.zero_grad(set_to_none=True)
        self.module.micro_batches, self.module.objective = mbs, objective
        self.module.normalizer, self.module.calls = float(normalizer), 0
        losses: list[torch.Tensor] = []
        if self.first:
            self._schedule.step(torch.stack([mb.input_ids for mb in mbs]))
        elif self.last:
            self._schedule.step(target=torch.zeros(len(mbs), 1, device=self.device), losses=losses)
        else:
            self._schedule.step()
        loss = torch.stack(losses).sum().detach() if self.last else torch.zeros((), device=self.device)
        dist.broadcast(loss, src=dist.get_global_rank(self.group, self.num_stages - 1), group=self.group)
        if self.tied:
            self._sum_tied_gradients()
        return loss

    def _tied_params(self) -> list[torch.Tensor]:
        """This stage's copy of the tied embedding / head weight (first and last stage), or none."""
        steps: list[Any] = list(self.module.steps)
        if self.first:
            return [steps[0].embed_tokens.weight]
        if self.last:
            return [steps[-1].lm_head.weight]
        return []

    def _sum_tied_gradients(self) -> None:
        """The first and the last stage add their copies' gradients (a group of those two ranks)."""
        for p in self._tied_params():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self._tied_group)

    def optimizer_step(self) -> dict[str, torch.Tensor]:
        """Clip the gradient norm over every stage, step the optimizer and the schedule."""
        grads = [p.grad for _, p in self.named if p.grad is not None]
        square = torch.zeros((), device=self.device)
        for g in grads:
            square = square + g.float().pow(2).sum()
        if self.tied and self.last:  # the tied weight counts once, on the first stage
            for p in self._tied_params():
                assert p.grad is not None
                square = square - p.grad.float().pow(2).sum()
        dist.all_reduce(square, group=self.group)
        norm = square.sqrt()
        clip = self.optim_settings.gradient_clipping
        if clip > 0:
            scale = torch.clamp(clip / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(scale)
        lr = torch.tensor(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        return {"grad_norm": norm, "lr": lr}

    def train_batch(
        self, micro_batches: Sequence[PackedBatch], *, global_num_loss_tokens: int, objective: Any = None
    ) -> dict[str, torch.Tensor]:
        from laden.model.objective import CrossEntropy

        objective = objective or CrossEntropy(chunked=True)
        loss = self.forward_backward(micro_batches, objective, normalizer=max(global_num_loss_tokens, 1))
        return {"loss": loss, **self.optimizer_step()}
