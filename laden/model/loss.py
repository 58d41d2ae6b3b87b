"""Linear + cross-entropy and token log-probabilities without materialising `[T, V]` logits.

The output projection of a causal LM is where a long micro-batch runs out of memory first:
`T * V * 4` bytes of fp32 logits (4096 tokens x 152k vocabulary = 2.5 GB), plus as much again
for their gradient. Everything here walks the tokens in chunks of `chunk_size` rows, so at
most `[chunk_size, V]` logits exist at any time.

Two strategies, chosen by what the backward needs:

- `chunked_linear_cross_entropy` (SFT): the loss is a scalar, so the gradient wrt each chunk's
  logits (`softmax - onehot`) is known in the forward already. The forward computes it
  immediately and accumulates `grad_hidden` ([T, H]) and `grad_weight` ([V, H], fp32
  accumulator), and the backward only scales them by `grad_output`. Cost: the gradients are
  computed even if backward never runs (use `torch.no_grad()` for evaluation: it skips them),
  and `grad_weight` is held from forward to backward; in exchange there is no recompute.
- `chunked_token_logprobs` / `chunked_entropy` (RL): the output is per token, its gradient is
  only known in the backward, so the backward recomputes each chunk's logits (one extra
  `[chunk, H] x [H, V]` matmul per chunk) instead of storing them.

Matmuls run in the input dtype (producing fp32 logits directly where `torch.mm(...,
out_dtype=torch.float32)` exists, i.e. CUDA); log-softmax math runs in fp32. Double backward
is not supported (the functions are `once_differentiable`).

After each chunk's GEMM the cross-entropy runs three kernels over the `[c, V]` block: a
row-wise log-softmax, an in-place exp (the softmax), and the cast of softmax - onehot to the
input dtype; ignored tokens are masked on their `[c, H]` rows, not on the `[c, V]` gradient
(no broadcast passes over the block).

Extra memory (bf16, `c = chunk_size`): the cross-entropy holds two fp32 `[c, V]` buffers at
once (the logits and their log-softmax), then the softmax and its bf16 copy, plus a `[V, H]`
fp32 accumulator and a `[V, H]` bf16 partial product; the
log-prob backward holds two fp32 `[c, V]` buffers instead of one. Measured on an H200 at
T=16384, V=151936, H=4096: peak extra 8.2 GiB (c=4096) / 4.5 GiB (c=1024) against 27.8 GiB
for full logits, at 1.15x / 1.35x the time.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from laden.model.patches.grad_sink import accumulate_product

__all__ = [
    "DEFAULT_LOSS_CHUNK_SIZE",
    "chunked_entropy",
    "chunked_linear_cross_entropy",
    "chunked_token_logprobs",
    "chunked_token_logprobs_and_entropy",
    "linear_cross_entropy",
]

DEFAULT_LOSS_CHUNK_SIZE = 1024
"""Tokens per chunk when none is given; `actor.loss_chunk_size`'s default (a test keeps them equal)."""


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [T, H] and weight [V, H] with the same H; got hidden {tuple(hidden.shape)} "
            f"and weight {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [T] = [{hidden.shape[0]}]; got {tuple(labels.shape)}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be positive; use e.g. 4096")


@functools.cache
def _mm_has_fp32_out(device_type: str) -> bool:
    """Whether `torch.mm(bf16, bf16, out_dtype=torch.float32)` runs here (CUDA in recent torch)."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _logits_fp32(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[c, H] x [V, H]^T -> [c, V] fp32; straight from the GEMM's fp32 accumulator where supported."""
    if h.dtype in (torch.bfloat16, torch.float16) and _mm_has_fp32_out(h.device.type):
        return torch.mm(h, weight.t(), out_dtype=torch.float32)
    return torch.mm(h, weight.t()).float()


def _accumulate_mm(acc: torch.Tensor, grad: torch.Tensor, inp: torch.Tensor) -> None:
    """acc [V, H] += grad [c, V]^T @ inp [c, H], with `acc` possibly fp32 while `grad`, `inp` are bf16/fp16.

    Mixed: the [V, H] product summed across chunks in fp32, in one fp32-output GEMM where there
    is one (CUDA): no bf16 product and no mixed-dtype add over the vocabulary-sized gradient per
    chunk; elsewhere the product in the input dtype, then the add (`grad_sink.accumulate_product`).
    """
    if grad.dtype == acc.dtype:
        acc.addmm_(grad.t(), inp)
    else:
        accumulate_product(acc, grad, inp, grad.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, ignore_index, need_grad_hidden, need_grad_weight):
        num_tokens = hidden.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if need_grad_hidden else None  # [T, H]
        grad_weight = (  # [V, H], fp32 accumulator
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad_weight else None
        )
        for start in range(0, num_tokens, chunk_size):
            h = hidden[start : start + chunk_size]  # [c, H]
            y = labels[start : start + chunk_size]  # [c]
            logits = _logits_fp32(h, weight)  # [c, V]
            valid = y != ignore_index  # [c]
            safe_y = torch.where(valid, y, torch.zeros_like(y))
            logp = torch.log_softmax(logits, dim=-1)  # [c, V]: one row-wise kernel (max, sum, write)
            del logits
            target = logp.gather(1, safe_y[:, None]).squeeze(1)  # [c]
            loss -= torch.where(valid, target, torch.zeros_like(target)).sum()
            if grad_hidden is None and grad_weight is None:
                continue
            # d loss / d logits = softmax - onehot: exp of the log-probabilities in place, minus one
            # per row, then the cast. Ignored rows are not zeroed here, at [c, V]: their hidden rows
            # are zeroed for the weight gradient and their hidden gradient rows afterwards, at [c, H].
            grad_logits = logp.exp_()  # [c, V]
            grad_logits.scatter_add_(1, safe_y[:, None], -torch.ones_like(target)[:, None])
            grad_logits_in = grad_logits.to(hidden.dtype)
            del grad_logits
            keep = valid[:, None].to(hidden.dtype)  # [c, 1]
            if grad_hidden is not None:
                grad_hidden[start : start + chunk_size] = torch.mm(grad_logits_in, weight).mul_(keep)
            if grad_weight is not None:
                _accumulate_mm(grad_weight, grad_logits_in, h * keep)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)  # held until backward in the weight's dtype
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_output.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight * grad_output.to(grad_weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Sum over non-ignored tokens of `cross_entropy(hidden @ weight.T, labels)`, fp32, without [T, V].

    hidden: [T, H]; weight: [V, H] (an lm_head, possibly tied to the embeddings); labels: [T] long.
    Returns a 0-dim fp32 tensor; divide by the global number of loss tokens outside.
    """
    _check_inputs(hidden, weight, labels, chunk_size)
    grad_on = torch.is_grad_enabled()
    return _ChunkedLinearCrossEntropy.apply(
        hidden,
        weight,
        labels,
        chunk_size,
        ignore_index,
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
    )


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100
) -> torch.Tensor:
    """Non-chunked reference path (`actor.chunked_loss: false`): builds the full [T, V] fp32 logits."""
    _check_inputs(hidden, weight, labels, 1)
    logits = torch.mm(hidden, weight.t()).float()  # [T, V]
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


class _Chunk(NamedTuple):
    z: torch.Tensor  # [c, V] fp32 tempered logits
    probs: torch.Tensor  # [c, V] fp32 softmax(z)
    valid: torch.Tensor  # [c] bool, label >= 0
    safe_labels: torch.Tensor  # [c] long, invalid labels replaced by 0
    logp: torch.Tensor  # [c] fp32
    entropy: torch.Tensor  # [c] fp32
    mean_z: torch.Tensor  # [c] fp32, E_p[z]


def _logprob_entropy_chunk(h, weight, y, temperature) -> _Chunk:
    """Per-chunk fp32 quantities shared by forward and backward."""
    z = _logits_fp32(h, weight)  # [c, V]
    if temperature != 1.0:
        z.div_(temperature)
    valid = y >= 0
    safe_y = torch.where(valid, y, torch.zeros_like(y))
    lse = torch.logsumexp(z, dim=-1)  # [c]
    target = z.gather(1, safe_y[:, None]).squeeze(1)
    logp = torch.where(valid, target - lse, torch.zeros_like(lse))  # [c]
    probs = z.sub(lse[:, None]).exp_()  # [c, V]
    mean_z = (probs[:, None, :] @ z[:, :, None])[:, 0, 0]  # [c], E_p[z] without a [c, V] temporary
    entropy = lse - mean_z
    return _Chunk(z, probs, valid, safe_y, logp, entropy, mean_z)


class _ChunkedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, temperature):
        num_tokens = hidden.shape[0]
        logp = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        for start in range(0, num_tokens, chunk_size):
            sl = slice(start, start + chunk_size)
            chunk = _logprob_entropy_chunk(hidden[sl], weight, labels[sl], temperature)
            logp[sl], entropy[sl] = chunk.logp, chunk.entropy
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, labels = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_h else None  # [T, H]
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            sl = slice(start, start + ctx.chunk_size)
            h = hidden[sl]
            chunk = _logprob_entropy_chunk(h, weight, labels[sl], ctx.temperature)
            z, probs, mean_z = chunk.z, chunk.probs, chunk.mean_z
            # Gradient wrt the tempered logits, built in z's buffer (z is not needed afterwards):
            # d entropy / dz = p * (E[z] - z);  d logp / dz = onehot(y) - p.
            if grad_entropy is not None:
                grad_z = z.neg_().add_(mean_z[:, None]).mul_(grad_entropy[sl].float()[:, None])
            else:
                grad_z = z.zero_()
            if grad_logp is not None:
                g = grad_logp[sl].float() * chunk.valid  # [c]
                grad_z.sub_(g[:, None])
            grad_z.mul_(probs)
            if grad_logp is not None:
                grad_z.scatter_add_(1, chunk.safe_labels[:, None], g[:, None])
            if ctx.temperature != 1.0:
                grad_z.div_(ctx.temperature)
            grad_z_in = grad_z.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[sl] = torch.mm(grad_z_in, weight)
            if grad_weight is not None:
                _accumulate_mm(grad_weight, grad_z_in, h)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_token_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token `log softmax(hidden @ weight.T / temperature)[label]` and entropy, both [T] fp32.

    Differentiable wrt hidden and weight; the backward recomputes each chunk's logits.
    Negative labels (e.g. -100 on prompt tokens) give log-prob 0 and no log-prob gradient.
    """
    _check_inputs(hidden, weight, labels, chunk_size)
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive (gconfig.temperature); use 1.0")
    return _ChunkedLogprobEntropy.apply(hidden, weight, labels, chunk_size, float(temperature))


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probability of each label token, [T] fp32, differentiable, without [T, V] logits."""
    logp, _ = chunked_token_logprobs_and_entropy(
        hidden, weight, labels, chunk_size=chunk_size, temperature=temperature
    )
    return logp


def chunked_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Entropy of each token's next-token distribution, [T] fp32, differentiable, without [T, V]."""
    labels = torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)
    _, entropy = chunked_token_logprobs_and_entropy(
        hidden, weight, labels, chunk_size=chunk_size, temperature=temperature
    )
    return entropy
