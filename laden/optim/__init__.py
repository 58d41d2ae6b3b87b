"""Optimizers: AdamW / SGD / Kahan-compensated bf16 AdamW, LR schedules, and fast host AdamW.

- `build_optimizer`, `build_lr_scheduler`, `clip_grad_norm_`, `param_groups_with_decay`:
  what `actor.optimizer` builds.
- `AdamWBF16`: `actor.optimizer.type: adam_bf16` (8 bytes per param, Kahan-compensated).
- `HostAdamW`, `adamw_step_`, `adamw_bf16_kahan_step_`: the CPU update of the offloaded
  engines (a vectorized C++ kernel built on first use, with a PyTorch fallback).
"""

from laden.optim.adam_bf16 import AdamWBF16
from laden.optim.adamw_foreach import adamw_foreach_, adamw_kahan_foreach_, adamw_scalars
from laden.optim.build import build_lr_scheduler, build_optimizer, clip_grad_norm_, param_groups_with_decay
from laden.optim.cpu_adam import HostAdamW, adamw_bf16_kahan_step_, adamw_step_, backend_name

__all__ = [
    "AdamWBF16",
    "HostAdamW",
    "adamw_bf16_kahan_step_",
    "adamw_foreach_",
    "adamw_kahan_foreach_",
    "adamw_scalars",
    "adamw_step_",
    "backend_name",
    "build_lr_scheduler",
    "build_optimizer",
    "clip_grad_norm_",
    "param_groups_with_decay",
]
