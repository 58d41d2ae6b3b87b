"""Optimizers: AdamW / SGD / Kahan-compensated bf16 AdamW, LR schedules, and fast host AdamW.

- `OptimSettings` (from `actor.optimizer`), `build_optimizer` (the one builder, every engine),
  `build_lr_scheduler`, `clip_grad_norm_`, `param_groups_with_decay`.
- `named_state` / `load_named_state`: optimizer state by parameter name, the checkpoint layout.
- `Adam`: `roundpipe.optim.Adam`'s arguments (the RoundPipe-compatible API's host Adam/AdamW).
- `AdamWBF16`: `actor.optimizer.type: adam_bf16` (8 bytes per param, Kahan-compensated).
- `HostAdamW`, `adamw_step_`, `adamw_bf16_kahan_step_`, `adamw_fused_cpu_`: the CPU update of the offloaded
  engines (a vectorized C++ kernel built on first use, with a PyTorch fallback).
"""

from laden.optim.adam import Adam
from laden.optim.adam_bf16 import AdamWBF16
from laden.optim.adamw_foreach import adamw_foreach_, adamw_kahan_foreach_, adamw_scalars
from laden.optim.build import (
    ShardedStep,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_,
    is_no_decay,
    param_groups_with_decay,
)
from laden.optim.cpu_adam import (
    HostAdamW,
    adamw_bf16_kahan_step_,
    adamw_fused_cpu_,
    adamw_step_,
    backend_name,
)
from laden.optim.settings import OptimSettings
from laden.optim.state import init_state, load_named_state, named_state

__all__ = [
    "Adam",
    "AdamWBF16",
    "HostAdamW",
    "OptimSettings",
    "ShardedStep",
    "adamw_bf16_kahan_step_",
    "adamw_foreach_",
    "adamw_fused_cpu_",
    "adamw_kahan_foreach_",
    "adamw_scalars",
    "adamw_step_",
    "backend_name",
    "build_lr_scheduler",
    "build_optimizer",
    "clip_grad_norm_",
    "init_state",
    "is_no_decay",
    "load_named_state",
    "named_state",
    "param_groups_with_decay",
]
