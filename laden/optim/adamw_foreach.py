"""AdamW update math on lists of tensors, in plain PyTorch (`torch._foreach_*`), any device.

Two variants share one set of scalars:

- `adamw_foreach_`: fp32 params and moments (the ordinary AdamW step, grads may be bf16).
- `adamw_kahan_foreach_`: bf16 params, bf16 moments and a bf16 Kahan compensation buffer,
  8 bytes per parameter instead of 16, with close to fp32 update precision.

The Kahan form. Let `comp` hold the rounding residue of the stored bf16 weight `p`, so the
weight the optimizer tracks (the "master" weight) is `master = p - comp`. One step is

    t      = master * (1 - lr * wd) - step_size * m / denom     # fp32
    p_new  = bf16(t)                                             # round to nearest even
    comp   = bf16(p_new - t)                                     # exact in fp32 (Sterbenz)

This is the classic compensated sum `y = update - comp; t = p + y; comp = (t_rounded - p) - y`
rewritten with `master`: both give `t = master + update` and `comp = p_new - t`. The one fp32
rounding happens in `t`; `p_new - t` is exact because `p_new` is `t` with its low mantissa
bits dropped. Storing `comp` in bf16 keeps about 8 more bits below `p`'s last bit, so the
master weight carries a ~16-bit mantissa: updates far below bf16's resolution (lr 1e-5 on
weights near 1) accumulate instead of vanishing, which is what plain bf16 AdamW gets wrong.
The model always sees `p`, within half a bf16 ulp of the master weight.

Cost of bf16 moments (accepted, as in the seed's `adam_bf16`): the moments are updated in
fp32 and the update uses those fp32 values, but they are stored rounded (~0.4% relative
error per step), and `exp_avg_sq`'s per-step decay by beta2 = 0.999 is below half a bf16
ulp, so it only decays when new squared gradients pull it; when gradients shrink the step
is more conservative than fp32 AdamW, never larger.

Temporaries: the fp32 working copies are made per bucket of at most `max_chunk_numel`
elements (large tensors are split into flat chunks), so the peak extra memory is a few fp32
chunks, not a few fp32 copies of the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

DEFAULT_CHUNK_NUMEL = 1 << 22  # 4M elements: 16 MiB per fp32 temporary


class AdamWScalars(NamedTuple):
    """Per-step scalars, computed in double exactly as torch.optim.AdamW computes them."""

    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    step_size: float
    bias_correction2_sqrt: float
    eps: float
    decay: float


def adamw_scalars(
    *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
) -> AdamWScalars:
    """Scalars for step number `step` (1-based, already incremented)."""
    if step < 1:
        raise ValueError(f"step={step} must be >= 1 (the step count after incrementing)")
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return AdamWScalars(
        one_minus_beta1=1 - beta1,
        beta2=beta2,
        one_minus_beta2=1 - beta2,
        step_size=lr / bias_correction1,
        bias_correction2_sqrt=math.sqrt(bias_correction2),
        eps=eps,
        decay=1 - lr * weight_decay,
    )


def _flat_chunks(tensors: Sequence[torch.Tensor], max_numel: int) -> list[list[torch.Tensor]]:
    """Split aligned tensors (same numel) into aligned flat chunks; non-contiguous ones stay whole."""
    if not all(t.is_contiguous() for t in tensors):
        return [list(tensors)]
    flats = [t.view(-1) for t in tensors]
    return [list(pieces) for pieces in zip(*(f.split(max_numel) for f in flats))]


def iter_buckets(
    columns: Sequence[Sequence[torch.Tensor | None]], max_numel: int
) -> Iterator[list[list[torch.Tensor]]]:
    """Yield buckets of aligned tensor pieces, each bucket about `max_numel` elements.

    `columns[k][i]` is the k-th tensor of parameter i (param, grad, moments, ...); a column may
    hold `None` for every parameter (an absent optional buffer) and then yields `[]`.
    """
    present = [k for k, col in enumerate(columns) if col and col[0] is not None]
    bucket: list[list[torch.Tensor]] = [[] for _ in columns]
    bucket_numel = 0
    for i in range(len(columns[0])):
        row = [columns[k][i] for k in present]
        for pieces in _flat_chunks(row, max_numel):  # type: ignore[arg-type]
            for k, piece in zip(present, pieces):
                bucket[k].append(piece)
            bucket_numel += pieces[0].numel()
            if bucket_numel >= max_numel:
                yield bucket
                bucket, bucket_numel = [[] for _ in columns], 0
    if bucket_numel:
        yield bucket


def _as_fp32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t if t.dtype == torch.float32 else t.float() for t in tensors]


def _moments_(g: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor], s: AdamWScalars) -> None:
    torch._foreach_lerp_(m, g, s.one_minus_beta1)
    torch._foreach_mul_(v, s.beta2)
    torch._foreach_addcmul_(v, g, g, value=s.one_minus_beta2)


def _denom(v: list[torch.Tensor], s: AdamWScalars) -> list[torch.Tensor]:
    denom = list(torch._foreach_sqrt(v))
    torch._foreach_div_(denom, s.bias_correction2_sqrt)
    torch._foreach_add_(denom, s.eps)
    return denom


@torch.no_grad()
def adamw_foreach_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    scalars: AdamWScalars,
    *,
    params_out_bf16: Sequence[torch.Tensor] | None = None,
    max_chunk_numel: int = DEFAULT_CHUNK_NUMEL,
) -> None:
    """One AdamW step in place on fp32 params and moments; grads fp32 or bf16.

    `params_out_bf16`, when given, receives `param.to(bfloat16)` of each updated param.
    """
    out_column = list(params_out_bf16) if params_out_bf16 is not None else [None] * len(params)
    columns = [params, grads, exp_avgs, exp_avg_sqs, out_column]
    for p, g, m, v, out in iter_buckets(columns, max_chunk_numel):
        g = _as_fp32(g)
        _moments_(g, m, v, scalars)
        denom = _denom(v, scalars)
        if scalars.decay != 1.0:
            torch._foreach_mul_(p, scalars.decay)
        torch._foreach_addcdiv_(p, m, denom, value=-scalars.step_size)
        if out:
            torch._foreach_copy_(out, p)


@torch.no_grad()
def adamw_kahan_foreach_(
    params: Sequence[torch.Tensor],
    comps: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    scalars: AdamWScalars,
    *,
    max_chunk_numel: int = DEFAULT_CHUNK_NUMEL,
) -> None:
    """One AdamW step in place on bf16 params/comps/moments (see the module docstring)."""
    columns = [params, comps, grads, exp_avgs, exp_avg_sqs]
    for p, comp, g, m_bf16, v_bf16 in iter_buckets(columns, max_chunk_numel):
        g = _as_fp32(g)
        m, v = _as_fp32(m_bf16), _as_fp32(v_bf16)
        _moments_(g, m, v, scalars)
        torch._foreach_copy_(m_bf16, m)  # stored rounded; the update below uses fp32 m, v
        torch._foreach_copy_(v_bf16, v)
        denom = _denom(v, scalars)
        master = _as_fp32(p)
        torch._foreach_sub_(master, _as_fp32(comp))  # master = p - comp
        if scalars.decay != 1.0:
            torch._foreach_mul_(master, scalars.decay)
        torch._foreach_addcdiv_(master, m, denom, value=-scalars.step_size)  # master is now t
        torch._foreach_copy_(p, master)  # p_new = bf16(t), round to nearest even
        residue = denom  # reuse the buffer: residue = p_new - t, exact in fp32
        torch._foreach_copy_(residue, p)
        torch._foreach_sub_(residue, master)
        torch._foreach_copy_(comp, residue)
