"""Colocated weight updates: trainer and rollout engine in one process, copied tensor by tensor.

`fill_in_place` copies each `(name, tensor)` of a trainer's `named_weights` into the engine's
parameter of that name with `copy_`, so the update holds no second copy of the model: the
engine's own tensors are written, the source tensors are read where they are.

Speed comes from the source. The roundpipe engine's `named_weights` in its compute dtype
hands out the host store's upload copies themselves (page-locked with `pin_model=alloc` or
`register`), so an update of a GPU-resident engine is a pure pinned host-to-device copy at
DMA speed, with nothing converted on the host. A source in pageable memory, or one converted
per tensor (another dtype), costs a host staging copy per tensor on the way.

Pinned sources are copied with `non_blocking=True`. A `TrainEngine.named_weights` iterator may
reuse a tensor it handed out for the next one, so by default each pinned copy is waited for
before the next tensor is pulled (the copy itself still runs at DMA speed; only the host and
the device take turns). `overlap=True` queues every copy and waits once at the end: for
sources that stay valid until the call returns (the roundpipe engine's upload copies, a dict).
Either way the copies are complete when `fill_in_place` returns, so the trainer may step again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from laden.weights.partial import PartialUpdate

__all__ = ["fill_in_place"]

_MAX_LISTED = 5


@torch.no_grad()
def fill_in_place(
    named_weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    *,
    overlap: bool = False,
    strict: bool = True,
) -> int:
    """Copy every `(name, tensor)` into `params[name]` in place; return the bytes written.

    `params`: the engine's tensors by Hugging Face name (parameters included). Each source must
    have its destination's shape (a dtype difference is cast by `copy_`, through a temporary);
    a name `params` lacks or a name given twice is an error, and with `strict` so is a name of
    `params` the source never gave, unless the source is a `PartialUpdate` (it leaves them out
    on purpose). Errors name the tensor; the ones before it were already copied. `overlap`: see
    the module docstring.
    """
    pairs = named_weights.items() if isinstance(named_weights, Mapping) else named_weights
    copied: set[str] = set()
    pending: set[torch.device] = set()  # devices with queued non-blocking copies
    num_bytes = 0
    for name, src in pairs:
        dst = _destination(params, name, src, copied)
        non_blocking = src.device.type == "cpu" and dst.device.type == "cuda" and src.is_pinned()
        dst.copy_(src, non_blocking=non_blocking)
        num_bytes += dst.nbytes
        copied.add(name)
        if non_blocking and not overlap:
            _wait(dst.device)  # deliberate sync: the source may be reused for the next tensor
        elif non_blocking:
            pending.add(dst.device)
        del src  # before the next one is made
    for device in pending:
        _wait(device)  # deliberate sync: the sources may change once this returns
    if strict and not isinstance(named_weights, PartialUpdate):
        _check_all_copied(params, copied)
    return num_bytes


def _destination(
    params: Mapping[str, torch.Tensor], name: str, src: torch.Tensor, copied: set[str]
) -> torch.Tensor:
    dst = params.get(name)
    done = f"{len(copied)} weights before it were already copied"
    if dst is None:
        raise ValueError(
            f"weight {name!r} has no destination in the engine ({done}): the source is another model; "
            "update from the same architecture (names as laden.model.hf.export.hf_state_names gives them)"
        )
    if name in copied:
        raise ValueError(f"weight {name!r} was given twice ({done}); each weight must come once")
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(
            f"weight {name!r} is {list(src.shape)} in the source but {list(dst.shape)} in the engine ({done}); "
            "update from the same architecture"
        )
    return dst.detach()


def _check_all_copied(params: Mapping[str, torch.Tensor], copied: set[str]) -> None:
    missing = [name for name in params if name not in copied]
    if missing:
        more = f" and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
        raise ValueError(
            f"the source gave no value for {len(missing)} engine weight(s): {missing[:_MAX_LISTED]}{more}; "
            "they keep their old values. Give every weight (named_weights of the same model), or pass "
            "strict=False for a partial update"
        )


def _wait(device: torch.device) -> None:
    torch.cuda.current_stream(device).synchronize()
