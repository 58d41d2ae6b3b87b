"""Pipeline stages of a causal LM for the archon engine (the `p` of `archon:`), over `torch.distributed.pipelining`.

The model is cut into contiguous runs of its pipeline steps (`laden.model.split`: the embedding, decoder
layers, the final norm and head) where the per-step costs balance (`stage_bounds`: parameter bytes plus
what a micro-batch's forward keeps, `laden.model.split.activation_bytes`, not the layer count), and
PyTorch's schedules (`1F1B`, `Interleaved1F1B` with looped virtual stages, `GPipe`) run them over the
step's token-budget micro-batches (`build_schedule`).

How laden's packed micro-batches cross the pipeline: the schedule moves one tensor between stages
(the hidden states `[1, T, H]`; the token ids into the first stage, the objective's scaled sum out of
the last). Every stage holds the step's micro-batches (the ranks of one pipeline pack the same
samples), and reads the positions, document boundaries, labels and per-token fields of the one it
computes from them (`StageModule`): the schedules run each stage's forwards in micro-batch order. The
micro-batches of a step are padded to one length (`pad_to`: a padding document, no loss, no attention
across) so the stage buffers have one shape, and to a count the schedule accepts (`padded_count`);
the engine rebuilds the schedule when the step's length or count changes. The cost of one length is
the padding's compute: micro-batches packed to one token budget differ by less than a sequence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from torch import nn

from laden.data.batch import PackedBatch
from laden.engine.parallel.objective import apply_objective

Schedule = Literal["1F1B", "Interleaved1F1B", "GPipe"]
SCHEDULES: tuple[str, ...] = ("1F1B", "Interleaved1F1B", "GPipe")


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


class StageModule(nn.Module):
    """A stage's pipeline steps; reads the micro-batch it computes from the step's list (module docstring).

    The first stage takes token ids `[1, T]`, the others hidden states `[1, T, H]`; the last returns
    the micro-batch's objective times `loss_scale` as a `[1]` tensor (or, with `outputs` set, the
    objective's per-token dictionary), the others hidden states. `before_micro_batch(mb)`, when set,
    runs before each micro-batch (the router loss's weight of that micro-batch, `laden.model.moe`).
    """

    def __init__(self, steps: Sequence[nn.Module], *, first: bool, last: bool) -> None:
        super().__init__()
        self.steps = nn.ModuleList(steps)
        self.first, self.last = first, last
        self.micro_batches: list[PackedBatch] = []
        self.objective: Any = None
        self.loss_scale = 1.0
        self.calls = 0
        self.before_micro_batch: Callable[[PackedBatch], None] | None = None
        self.tp_group: Any = None
        """Tensor parallel: the head weight is split on the vocabulary (`apply_objective`)."""
        self.head_dtype: torch.dtype | None = None
        """Under autocast: the dtype the objective sees the hidden states and head weight in (the fsdp
        engine's `ObjectiveRoot` has the reason: the loss's own GEMMs would otherwise run in fp32)."""

    def start(self, micro_batches: list[PackedBatch], objective: Any, loss_scale: float) -> None:
        """The step's micro-batches (read in order by the forwards that follow) and its objective."""
        self.micro_batches, self.objective = micro_batches, objective
        self.loss_scale, self.calls = float(loss_scale), 0

    def forward(self, x: torch.Tensor) -> Any:
        from laden.model.split import DecoderState

        mb = self.micro_batches[self.calls]
        self.calls += 1
        if self.before_micro_batch is not None:
            self.before_micro_batch(mb)
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
        hidden, weight = out.hidden_states[0], out.lm_head_weight  # [T, H], [V, H]
        if self.head_dtype is not None:
            hidden, weight = hidden.to(self.head_dtype), weight.to(self.head_dtype)
        value = apply_objective(self.objective, hidden, weight, mb, tp_group=self.tp_group)
        if isinstance(value, dict):  # forward's per-token outputs
            return value
        return (value.float() * self.loss_scale).reshape(1)


def build_schedule(stages: Sequence[Any], *, name: str, num_micro_batches: int) -> Any:
    """PyTorch's schedule `name` over this rank's `PipelineStage`s (one, or several for Interleaved1F1B).

    The loss is the last stage's output itself (already the objective's scaled sum), and the
    schedule does not rescale gradients (`scale_grads=False`): the objective's normalizer does.
    """
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    def loss_fn(out: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
        return out.sum()

    if name == "Interleaved1F1B":
        return ScheduleInterleaved1F1B(list(stages), n_microbatches=num_micro_batches, loss_fn=loss_fn,
                                       scale_grads=False)  # fmt: skip
    kind = Schedule1F1B if name == "1F1B" else ScheduleGPipe
    (stage,) = stages
    return kind(stage, n_microbatches=num_micro_batches, loss_fn=loss_fn, scale_grads=False)


def padded_count(count: int, *, name: str, num_ranks: int) -> int:
    """The micro-batch count a schedule accepts, at least `count`: 1F1B runs at least one per stage,
    Interleaved1F1B a multiple of the pipeline ranks (whole rounds), GPipe any count."""
    if name == "GPipe" or num_ranks == 1:
        return count
    if name == "1F1B":
        return max(count, num_ranks)
    return max(num_ranks, -(-count // num_ranks) * num_ranks)
