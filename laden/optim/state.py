"""Optimizer state keyed by parameter name: the one layout every engine checkpoints.

`torch.distributed.checkpoint`'s layout (`{"state": {name: {"step", "exp_avg", ...}},
"param_groups": [{..., "params": [names]}]}`), with Hugging Face parameter names, whatever
the optimizer class (`torch.optim.AdamW`/`SGD`, `AdamWBF16`, `HostAdamW`, `ShardedAdamW`) and
wherever the state lives (device, host, sharded). An engine's checkpoint therefore loads into
any engine with the same optimizer type, at any data-parallel size: the checkpoint reshards
the named tensors, and the names, not the classes, say what they are.

States that an optimizer creates lazily at its first step are created here (zeros, step 0)
when asked for, so a checkpoint can be loaded into a fresh engine in place; that costs the
states' memory before the first step, which the step would allocate anyway. `step` is
always a 0-dim float32 tensor in the layout, whatever the optimizer keeps (an int for laden's
own optimizers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["init_state", "load_named_state", "named_state"]

Wrap = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _group_of(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, Any]:
    for group in optimizer.param_groups:
        if any(q is p for q in group["params"]):
            return group
    raise KeyError("parameter is not optimized by this optimizer")


def init_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, Any]:
    """The state of `p`, created as the optimizer's first step would (zeros, step 0) if missing."""
    own = getattr(optimizer, "init_state", None)
    if own is not None:  # laden's optimizers create their states themselves
        return own(p)
    state = optimizer.state[p]
    if state:
        return state
    group = _group_of(optimizer, p)
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        # fused and capturable AdamW keep `step` on the parameter's device, the others on the host
        on_device = group.get("fused") or group.get("capturable")
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if group.get("amsgrad"):
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    elif isinstance(optimizer, torch.optim.SGD):
        if group["momentum"] != 0:  # a zero buffer gives the first step's momentum = grad, as SGD's clone
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    else:
        raise RuntimeError(
            f"cannot create the state of a {type(optimizer).__name__}; laden builds its optimizers"
        )
    return state


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def named_state(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], *, wrap: Wrap | None = None
) -> dict[str, Any]:
    """The optimizer's state by parameter name (`names`: `id(param)` -> name), holding the live tensors.

    `wrap(state_tensor, param)` turns a state tensor into what the checkpoint stores (a DTensor
    laid out like its sharded parameter, say); by default the tensor itself.
    """
    state: dict[str, dict[str, torch.Tensor]] = {}
    for p in _params(optimizer):
        entry: dict[str, torch.Tensor] = {}
        for key, value in init_state(optimizer, p).items():
            if key == "step":
                entry[key] = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            else:
                entry[key] = value if wrap is None else wrap(value, p)
        state[names[id(p)]] = entry
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    return {"state": state, "param_groups": groups}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def load_named_state(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], saved: Mapping[str, Any]
) -> None:
    """Copy a `named_state` layout into the optimizer (tensors already in place are left alone)."""
    for p in _params(optimizer):
        name = names[id(p)]
        if name not in saved["state"]:
            raise KeyError(f"the checkpoint holds no optimizer state for parameter {name!r}")
        state = init_state(optimizer, p)
        for key, value in saved["state"][name].items():
            if key not in state:
                raise KeyError(
                    f"the checkpoint's optimizer state of {name!r} has {key!r}, which this optimizer does not keep"
                )
            if key == "step" and not isinstance(state["step"], torch.Tensor):
                state["step"] = int(value)
                continue
            src, dst = _local(value), _local(state[key])
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src)
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
