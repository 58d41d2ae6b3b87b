"""`Adam`: the host optimizer of the RoundPipe-compatible API, with `roundpipe.optim.Adam`'s arguments.

It is `torch.optim.Adam` on fp32 CPU master weights, run by PyTorch's multi-tensor
(`foreach`) path (its per-tensor path when `lr` is a Tensor, which foreach refuses); `decoupled_weight_decay=True` is AdamW. The engine this API mirrors
ignores `foreach` / `fused` (with a warning) and refuses `capturable` / `differentiable`;
so does this one. Trade-off: PyTorch's foreach math instead of laden's fused C++ kernel
(`HostAdamW`, AdamW only), so AMSGrad, `maximize` and L2-coupled decay keep working and
the results equal `torch.optim.Adam` bit for bit; build `HostAdamW` directly for the faster
AdamW update.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch


class Adam(torch.optim.Adam):
    """Adam / AdamW on fp32 (or complex64) contiguous CPU parameters (the masters of
    `RoundPipe.optim_parameters()`)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
    ) -> None:
        if capturable or differentiable:
            raise ValueError(
                "Adam(capturable=True / differentiable=True) is not supported: the update runs eagerly on "
                "host master weights; leave both False"
            )
        for name, value in (("foreach", foreach), ("fused", fused)):
            if value is not None:
                warnings.warn(
                    f"Adam({name}={value}) is ignored: the host update runs foreach (per tensor with a Tensor lr)",
                    stacklevel=2,
                )
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            # PyTorch's foreach path takes no Tensor lr without capturable: the per-tensor loop then
            foreach=not isinstance(lr, torch.Tensor), maximize=maximize, decoupled_weight_decay=decoupled_weight_decay,
        )  # fmt: skip
        for group in self.param_groups:
            for p in group["params"]:
                _check_param(p)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            _check_param(p)


def _check_param(p: torch.Tensor) -> None:
    if p.device.type != "cpu" or p.dtype not in (torch.float32, torch.complex64) or not p.is_contiguous():
        raise ValueError(
            f"Adam updates fp32 (or complex64) contiguous CPU tensors; got {p.dtype} on {p.device}. Build it on "
            "RoundPipe(model, optim_dtype=torch.float32).optim_parameters(), or use torch.optim.Adam"
        )
