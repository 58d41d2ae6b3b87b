"""`adam_bf16`: AdamW with bf16 moments and Kahan-compensated bf16 weights.

Memory per bf16 parameter: weight 2 B + `exp_avg` 2 B + `exp_avg_sq` 2 B + Kahan
compensation 2 B = 8 B, against 16 B for bf16 weights with fp32 master weights and fp32
moments (or 12 B of states alone for fp32 AdamW). The compensation buffer keeps the update
precision close to fp32: plain bf16 AdamW silently drops every update smaller than half a
bf16 ulp of the weight (lr 1e-5 on a weight near 1 is 400x too small) and stalls, which is
the divergence the seed warns about for `adam` + `optimizer_dtype: bfloat16`. The math and
its remaining cost (bf16 moments) are documented in `laden.optim.adamw_foreach`.

fp32 parameters in the same optimizer get the ordinary fp32 AdamW step, so one optimizer can
hold a bf16 model and, say, an fp32 head. The step counter is a Python int per parameter:
bias corrections are computed on the host without reading a device tensor (no sync).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from laden.optim.adamw_foreach import adamw_foreach_, adamw_kahan_foreach_, adamw_scalars

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def validate_adamw_hparams(*, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Raise ValueError naming the first bad AdamW hyper-parameter."""
    if not lr >= 0.0:
        raise ValueError(f"lr={lr} must be >= 0; set a non-negative learning rate")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"betas[{i}]={beta} must be in [0, 1); typical values are (0.9, 0.999)")
    if not eps >= 0.0:
        raise ValueError(f"eps={eps} must be >= 0; typical value is 1e-8")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay={weight_decay} must be >= 0; use 0.0 to disable it")


def normalize_step_state(state: dict[Any, dict[str, Any]]) -> None:
    """Turn tensor step counters (torch.optim checkpoints) into Python ints, in place."""
    for param_state in state.values():
        step = param_state.get("step")
        if isinstance(step, torch.Tensor):
            param_state["step"] = int(step.item())  # load time, not a hot path


class AdamWBF16(torch.optim.Optimizer):
    """AdamW whose bf16 params keep bf16 moments and a bf16 Kahan compensation buffer.

    State per bf16 param: `exp_avg`, `exp_avg_sq`, `comp` (all bf16) and `step` (int).
    State per fp32 param: `exp_avg`, `exp_avg_sq` (fp32) and `step`: plain AdamW.
    Weight decay is decoupled (AdamW): `w <- w * (1 - lr * weight_decay)` before the update.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        validate_adamw_hparams(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        for i, p in enumerate(self.param_groups[-1]["params"]):
            if p.dtype not in _SUPPORTED_DTYPES:
                raise ValueError(
                    f"AdamWBF16 param {i} of group {len(self.param_groups) - 1} has dtype {p.dtype}; only "
                    "torch.bfloat16 (Kahan-compensated) and torch.float32 (plain AdamW) are supported; "
                    "cast the model to one of them"
                )

    def init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if p.dtype == torch.bfloat16:
                state["comp"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        normalize_step_state(self.state)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        # Params sharing (dtype, device, step count) go through one foreach call.
        buckets: dict[tuple[torch.dtype, torch.device, int], list[torch.Tensor]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdamWBF16 does not support sparse gradients")
            state = self.init_state(p)
            state["step"] += 1
            buckets.setdefault((p.dtype, p.device, state["step"]), []).append(p)
        beta1, beta2 = group["betas"]
        for (dtype, _, step), params in buckets.items():
            scalars = adamw_scalars(
                step=step, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=group["weight_decay"],
            )  # fmt: skip
            states = [self.state[p] for p in params]
            grads: list[torch.Tensor] = [p.grad for p in params]  # type: ignore[misc]  # None filtered above
            exp_avgs = [s["exp_avg"] for s in states]
            exp_avg_sqs = [s["exp_avg_sq"] for s in states]
            if dtype == torch.bfloat16:
                comps = [s["comp"] for s in states]
                adamw_kahan_foreach_(params, comps, grads, exp_avgs, exp_avg_sqs, scalars)
            else:
                adamw_foreach_(params, grads, exp_avgs, exp_avg_sqs, scalars)
