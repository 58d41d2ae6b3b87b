"""Optimizer, LR schedule and gradient clipping from the `actor.optimizer` settings: the one builder.

Every engine builds its optimizer here, from one `OptimSettings`; only where the states live
differs. On the device, `adam` is `torch.optim.AdamW`, fused when every param is on CUDA (one
kernel for the whole step) or every param is an fp32 CPU tensor (PyTorch's fused CPU kernel:
5x faster than foreach on 32M params, `benchmarks/RESULTS.md`), foreach otherwise (mixed
devices, bf16 states on the CPU), and `adam_bf16` is `AdamWBF16`; on the host
(the roundpipe engine's master weights) both are `HostAdamW`'s vectorized update with the same
math; the `fsdp` engine's host-state modes use `ShardedAdamW`. `sgd` is `torch.optim.SGD`
everywhere (its weight decay is the coupled L2 form). Biases and 1-D params (norm weights) get no weight decay
when params come as `(name, param)` pairs, the usual choice for transformers: decaying a
norm's gain towards 0 fights the normalization it exists for.

`adam` on bf16 params keeps bf16 moments and applies updates straight to bf16 weights; the
seed reports ~3x higher late loss than fp32 master weights, so that combination warns and
names `adam_bf16`.

The schedule is a `LambdaLR` whose factor is a small callable object (not a closure), so the
scheduler's `state_dict` records the schedule's shape and a resumed run can check it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from laden.optim.adam_bf16 import AdamWBF16
from laden.optim.settings import OptimSettings, SchedulerType

_OPTIMIZER_TYPES = ("adam", "sgd", "adam_bf16")
_SCHEDULER_TYPES = ("constant", "linear", "cosine")
_DEFAULT_BETAS = (0.9, 0.999)
_DEFAULT_EPS = 1e-8

ParamsArg = Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]]


def is_no_decay(name: str, p: torch.Tensor) -> bool:
    """Biases and 1-D params (norm gains) get no weight decay."""
    return p.ndim < 2 or name == "bias" or name.endswith(".bias")


def param_groups_with_decay(
    named_params: Iterable[tuple[str, torch.Tensor]], weight_decay: float
) -> list[dict[str, Any]]:
    """Split trainable params into a decayed group and a no-decay group (biases, 1-D params).

    Empty groups are left out; frozen params (`requires_grad=False`) are skipped.
    """
    decay: list[torch.Tensor] = []
    no_decay: list[torch.Tensor] = []
    for name, p in named_params:
        if p.requires_grad:
            (no_decay if is_no_decay(name, p) else decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _param_groups(params: ParamsArg, weight_decay: float) -> list[dict[str, Any]]:
    items = list(params)
    if not items:
        raise ValueError("params is empty; pass model.named_parameters(), a list of tensors or param groups")
    if all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in items):
        return param_groups_with_decay(items, weight_decay)  # type: ignore[arg-type]
    if all(isinstance(x, dict) for x in items):
        return items  # type: ignore[return-value]
    if all(isinstance(x, torch.Tensor) for x in items):
        return [{"params": items}]
    raise ValueError(
        "params mixes kinds; pass only tensors, only (name, tensor) pairs, or only param-group dicts"
    )


@dataclass(kw_only=True, slots=True)
class ShardedStep:
    """Where `ShardedAdamW` keeps its states and runs its update (the `fsdp` engine's host-state modes)."""

    device: torch.device
    """The training device (the streamed update runs there)."""
    layer_groups: list[list[torch.nn.Parameter]]
    """Parameters in streaming order, one list per decoder layer, then the rest."""
    streamed: bool
    """Update on the device one layer group at a time (else on the host, in place)."""
    states_on_host: bool
    """Keep the Adam states in host memory between steps."""
    prefetch_layers: int = 1
    """Layer groups uploaded ahead of the one being updated (streamed update)."""


ADAM_BF16_PARAMS_WARNING = (
    "actor.optimizer.type=adam on bfloat16 master weights keeps bf16 Adam states and drops updates "
    "below bf16 resolution (late loss diverges, about 3x higher); set actor.optimizer.type=adam_bf16 "
    "(Kahan-compensated bf16 states) or actor.optimizer_dtype=float32"
)


def _warn_ignored(o: OptimSettings) -> None:
    if o.type == "sgd" and (tuple(o.betas) != _DEFAULT_BETAS or o.eps != _DEFAULT_EPS):
        warnings.warn(f"actor.optimizer.type=sgd ignores betas={o.betas} and eps={o.eps}", stacklevel=3)
    if o.type != "sgd" and o.momentum != 0.0:
        warnings.warn(
            f"actor.optimizer.type={o.type} ignores momentum={o.momentum}; betas[0] plays that role",
            stacklevel=3,
        )


def build_optimizer(
    params: ParamsArg,
    settings: OptimSettings,
    *,
    where: Literal["device", "host"] = "device",
    sharded: ShardedStep | None = None,
    num_threads: int | None = None,
) -> torch.optim.Optimizer:
    """The optimizer `settings` name, over tensors, `(name, tensor)` pairs or param groups: the one
    builder of every engine, so one config gives one optimizer and one set of warnings everywhere.

    where: "device" for parameters the engine steps where they are (`torch.optim`, `AdamWBF16`),
        "host" for host master weights stepped by the vectorized host AdamW (`HostAdamW`, the
        roundpipe engine; `num_threads` of them).
    sharded: the `fsdp` engine's host-state AdamW (`ShardedAdamW`) instead, for `adam`/`adam_bf16`.

    `adam` on bf16 master weights runs `torch.optim.AdamW` with bf16 states everywhere, as asked,
    with one warning (`ADAM_BF16_PARAMS_WARNING`); `adam_bf16` is the Kahan-compensated update.
    """
    o = settings
    if o.type not in _OPTIMIZER_TYPES:
        raise ValueError(f"actor.optimizer.type={o.type!r} is not supported; use one of {_OPTIMIZER_TYPES}")
    if not o.lr >= 0.0:
        raise ValueError(f"actor.optimizer.lr={o.lr} must be >= 0")
    _warn_ignored(o)
    groups = _param_groups(params, o.weight_decay)
    flat = [p for g in groups for p in g["params"]]
    adam: dict[str, Any] = {"lr": o.lr, "betas": o.betas, "eps": o.eps, "weight_decay": o.weight_decay}
    if o.type == "sgd":
        return torch.optim.SGD(
            groups, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, foreach=True
        )
    if o.type == "adam" and any(p.dtype == torch.bfloat16 for p in flat):
        warnings.warn(ADAM_BF16_PARAMS_WARNING, stacklevel=2)
        return torch.optim.AdamW(groups, **adam, **_torch_kind(flat))
    kahan = o.type == "adam_bf16"
    if sharded is not None:
        from laden.optim.sharded_adam import ShardedAdamW

        return ShardedAdamW(
            groups, **adam, kahan_bf16=kahan, streamed=sharded.streamed, states_on_host=sharded.states_on_host,
            device=sharded.device, layer_groups=sharded.layer_groups, prefetch_layers=sharded.prefetch_layers,
        )  # fmt: skip
    if where == "host":
        from laden.optim.cpu_adam import HostAdamW

        state_dtype = torch.bfloat16 if kahan else torch.float32
        return HostAdamW(groups, **adam, state_dtype=state_dtype, num_threads=num_threads)
    if kahan:
        return AdamWBF16(groups, **adam)
    return torch.optim.AdamW(groups, **adam, **_torch_kind(flat))


def _torch_kind(flat: list[torch.Tensor]) -> dict[str, Any]:
    """Fused AdamW when every param is on CUDA (one kernel for the step) or every param is fp32 on
    the CPU (one pass over memory, like the host C++ kernel); foreach otherwise."""
    on_cuda = all(p.device.type == "cuda" for p in flat)
    fp32_on_cpu = all(p.device.type == "cpu" and p.dtype == torch.float32 for p in flat)
    return {"fused": True} if on_cuda or fp32_on_cpu else {"foreach": True}


class WarmupDecay:
    """LR factor: linear warm-up 0 -> 1 over `warmup_steps`, then decay 1 -> `min_lr_ratio`."""

    def __init__(self, *, type: SchedulerType, total_steps: int, warmup_steps: int, min_lr_ratio: float):
        self.type = type
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return step / self.warmup_steps
        if self.type == "constant":
            return 1.0
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        if self.type == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    type: SchedulerType,
    total_steps: int,
    warmup_steps: int,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up from 0 over `warmup_steps`, then constant/linear/cosine decay to `min_lr_ratio * lr`.

    The decay ends at `total_steps` and the LR stays at its floor afterwards.
    """
    if type not in _SCHEDULER_TYPES:
        raise ValueError(f"lr scheduler type={type!r} is not supported; use one of {_SCHEDULER_TYPES}")
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1; set it to the number of optimizer steps")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps={warmup_steps} must be in [0, total_steps={total_steps}]")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]; 0.0 decays to zero")
    schedule = WarmupDecay(
        type=type, total_steps=total_steps, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip grads in place to total L2 norm `max_norm` (0 = no clipping); return the norm, no sync.

    With DTensor grads (FSDP2) the returned norm is the full (all-reduced) tensor.
    """
    if max_norm < 0:
        raise ValueError(f"max_norm={max_norm} must be >= 0; 0 disables clipping")
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return torch.zeros(())
    grads: list[torch.Tensor] = [p.grad for p in with_grad]  # type: ignore[misc]  # None filtered above
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()  # a collective, not a host sync
    return total
