"""`OptimSettings`: the optimizer and schedule every engine builds, mapped once from `actor.optimizer`.

Engines never read `actor.optimizer` themselves: the runtime turns the config into one
`OptimSettings` (`from_config`), and each engine hands it to `laden.optim.build_optimizer`
and `build_scheduler`, so the same config gives the same optimizer, the same schedule and
the same warnings under every engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

OptimizerType = Literal["adam", "sgd", "adam_bf16"]
SchedulerType = Literal["constant", "linear", "cosine"]


@dataclass(kw_only=True, slots=True)
class OptimSettings:
    """Optimizer and schedule settings, mapped from `actor.optimizer.*`."""

    type: OptimizerType = "adam"
    """adam | sgd | adam_bf16."""
    lr: float = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to biases and norm weights)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    momentum: float = 0.0
    """SGD momentum."""
    lr_scheduler_type: SchedulerType = "constant"
    """constant | linear | cosine, after warm-up."""
    warmup_steps: int = 0
    """Linear warm-up steps from 0 to the peak learning rate."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of the peak for linear/cosine decay."""
    total_steps: int = 1
    """Optimizer steps in the whole run (for the decay)."""
    gradient_clipping: float = 1.0
    """Max global gradient norm; 0 disables clipping."""

    @classmethod
    def from_config(cls, optimizer: Any, total_steps: int) -> OptimSettings:
        """From an `actor.optimizer` section (`laden.config.OptimizerConfig`) and the run's step count."""
        return cls(
            type=optimizer.type,
            lr=optimizer.lr,
            weight_decay=optimizer.weight_decay,
            betas=(optimizer.beta1, optimizer.beta2),
            eps=optimizer.eps,
            momentum=optimizer.momentum,
            lr_scheduler_type=optimizer.lr_scheduler_type,
            warmup_steps=math.ceil(optimizer.warmup_steps_proportion * total_steps),
            min_lr_ratio=optimizer.min_lr_ratio,
            total_steps=total_steps,
            gradient_clipping=optimizer.gradient_clipping,
        )

    def master_dtype(self, optimizer_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the master weights the optimizer updates: bf16 for `adam_bf16`, else `optimizer_dtype`."""
        return torch.bfloat16 if self.type == "adam_bf16" else optimizer_dtype

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """Warm-up then the configured decay, over `total_steps`."""
        from laden.optim.build import build_lr_scheduler

        return build_lr_scheduler(
            optimizer,
            type=self.lr_scheduler_type,
            total_steps=self.total_steps,
            warmup_steps=self.warmup_steps,
            min_lr_ratio=self.min_lr_ratio,
        )

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based), as the scheduler applies it."""
        from laden.optim.build import WarmupDecay

        schedule = WarmupDecay(
            type=self.lr_scheduler_type,
            total_steps=self.total_steps,
            warmup_steps=self.warmup_steps,
            min_lr_ratio=self.min_lr_ratio,
        )
        return self.lr * schedule(step)
