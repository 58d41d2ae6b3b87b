"""Vocab-parallel chunked linear + cross-entropy for a tensor-parallel LM head.

Under tensor parallelism each rank holds rows `[vocab_start, vocab_start + V_local)` of the
LM head. The loss is computed in token chunks without ever forming `[T, V]` (nor even
`[T, V_local]`): per chunk, local logits `[C, V_local]`, then three small all-reduces over
the tensor-parallel group (row max, sum of exponentials, target logit) give the exact
log-sum-exp over the full vocabulary.

Gradients are computed in the same pass (the softmax of the chunk is at hand), so backward
only scales two stored tensors: `grad_hidden [T, H]` (all-reduced: every rank contributes
its vocabulary slice) and `grad_weight [V_local, H]`. Trade-off: those two buffers live from
forward to backward (the size of the hidden states plus one LM-head shard), in exchange for
never recomputing the chunk logits. Without gradients (evaluation) they are not computed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from laden.model.loss import DEFAULT_LOSS_CHUNK_SIZE

IGNORE_INDEX = -100


def vocab_shard_range(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of the vocabulary rows on `tp_rank` under DTensor's `Shard(0)` (torch.chunk) split."""
    rows_per_rank = -(-vocab_size // tp_size)
    start = min(tp_rank * rows_per_rank, vocab_size)
    return start, min(start + rows_per_rank, vocab_size)


def _chunk_stats(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_start: int, group
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [C, Vl] fp32, lse [C], target logit [C], local target [C], target-is-local [C])."""
    logits = (hidden @ weight.t()).float()  # [C, Vl]
    row_max = logits.detach().amax(dim=-1)  # [C]
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    sum_exp = torch.exp(logits - row_max[:, None]).sum(dim=-1)  # [C]
    dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
    lse = row_max + torch.log(sum_exp)  # [C]
    local_target = labels - vocab_start  # [C]
    is_local = (local_target >= 0) & (local_target < weight.shape[0]) & (labels != IGNORE_INDEX)
    safe_target = torch.where(is_local, local_target, torch.zeros_like(local_target))
    target_logit = logits.gather(1, safe_target[:, None])[:, 0] * is_local  # [C]
    dist.all_reduce(target_logit, op=dist.ReduceOp.SUM, group=group)
    return logits, lse, target_logit, safe_target, is_local


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_start, chunk_size, group):
        num_tokens = hidden.shape[0]
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if need_grad else None  # [T, H]
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_grad else None  # [Vl, H]
        for start in range(0, num_tokens, chunk_size):
            h = hidden[start : start + chunk_size]  # [C, H]
            y = labels[start : start + chunk_size]  # [C]
            logits, lse, target_logit, safe_target, is_local = _chunk_stats(h, weight, y, vocab_start, group)
            valid = (y != IGNORE_INDEX).float()  # [C]
            loss = loss + ((lse - target_logit) * valid).sum()
            if not need_grad:
                continue
            # d(lse - target)/d logits = softmax - onehot(target), zero on ignored rows.
            grad_logits = torch.exp(logits - lse[:, None])  # [C, Vl]
            grad_logits.scatter_add_(1, safe_target[:, None], -is_local.float()[:, None])
            grad_logits.mul_(valid[:, None])
            grad_logits = grad_logits.to(weight.dtype)  # matmuls in the input dtype, sums in fp32
            grad_hidden[start : start + chunk_size] = grad_logits @ weight
            grad_weight.add_(grad_logits.t() @ h)
        if need_grad:
            # Each rank holds the hidden gradient through its vocabulary slice only.
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=group)
            ctx.save_for_backward(grad_hidden, grad_weight)
            ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        return (
            (grad_hidden * grad_loss).to(hidden_dtype),
            (grad_weight * grad_loss).to(weight_dtype),
            None,
            None,
            None,
            None,
        )


def vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int,
    group: dist.ProcessGroup,
    chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
) -> torch.Tensor:
    """Summed token cross-entropy of `hidden [T, H]` against a vocab-sharded head `weight_shard [V_local, H]`.

    `hidden` and `labels [T]` are the same on every rank of `group`; `weight_shard` holds
    rows `[vocab_start, vocab_start + V_local)`. Labels equal to -100 are ignored. Returns
    the fp32 sum (the same value on every rank).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be a positive number of tokens")
    return _VocabParallelCrossEntropy.apply(hidden, weight_shard, labels, vocab_start, chunk_size, group)
