"""The host store under Hugging Face names: weights one tensor at a time, checkpoint tensors, loading.

The newest weights of a trainable parameter are its master (in the asynchronous step the
upload buffer a step reads holds the weights of one update earlier, and with fp32 masters
the upload copies are rounded to the compute dtype), so everything here reads and writes
masters (`named_weights` reads the current upload copy instead when asked, see below); a
frozen parameter has none and is read from the model itself (upload buffer 0). Callers
drain the host jobs first: an update in flight would be read half written.

`named_weights` hands out the live master when it already has the dtype and device asked
for (no copy at all), else one converted tensor per name, made when the consumer asks for
it and not kept by the iterator: a consumer that drops each tensor before taking the next
holds one tensor beyond the model, never a second copy of it.

Upload copies as the source (`upload_buf`): an upload copy is the master rounded to the
compute dtype, bit for bit (the update writes it from the master, `updates.update_group`),
and it is page-locked with `pin_model=alloc|register`. So when the compute dtype is asked
for, the caller that knows which upload buffer holds the newest weights may pass it, and a
parameter with a separate master is handed out as that upload copy: no conversion on the
host, and a colocated engine's update becomes a pinned host-to-device copy. Which buffer is
current is the engine's knowledge (`RoundPipeEngine._newest_upload_buf`): once the host jobs
are drained, the synchronous step's buffer 0; the asynchronous step's `1 - read_buf` (the
buffer the last update wrote; the other one, which the next step reads, is one update old).
A shared master already is an upload copy, the current one, and is handed out as before.

`model_state` and `load_model_state` are the `"model"` part of the engine's checkpoint
layout (one entry per trainable `model.named_parameters()` name, tied weights once), holding the live
tensors so that a checkpointer loads into them in place.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from laden.engine.roundpipe.host.store import HostParam, HostStore
from laden.model.hf.export import hf_state_names
from laden.model.lora import merged_weights


def _by_param(store: HostStore) -> dict[int, HostParam]:
    return {id(hp.param): hp for hp in store.params}


def _live(t: torch.Tensor, by_param: Mapping[int, HostParam]) -> torch.Tensor:
    """The tensor holding `t`'s newest value: its master when it has one, else `t` itself."""
    hp = by_param.get(id(t))
    master = hp.master if hp is not None else None
    return master if master is not None else t


def named_weights(
    store: HostStore,
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device | str | None,
    *,
    upload_buf: int | None = None,
    trained_only: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` for every name of `hf_state_names(model)`, floating tensors in `dtype`; a LoRA
    model's merged view (`laden.model.lora.merged_weights`; `trained_only`: its adapted projections).

    `upload_buf`: the upload buffer that holds the newest weights (see the module docstring);
    given, a separate master's parameter asked for in its compute dtype comes from it."""
    state = model.state_dict(keep_vars=True)  # the live parameters and buffers, no copies
    by_param = _by_param(store)

    def fetch(name: str, dt: torch.dtype, dev: torch.device | str | None) -> torch.Tensor:
        return _handout(_source(state[name], by_param, dt, upload_buf), dt, dev)

    # Handed out as made: the iterator keeps no reference to a tensor it handed out while it makes the next.
    yield from merged_weights(model, hf_state_names(model), fetch, dtype, device, trained_only=trained_only)


def _source(
    t: torch.Tensor, by_param: Mapping[int, HostParam], dtype: torch.dtype, upload_buf: int | None
) -> torch.Tensor:
    """What `named_weights` reads for `t`: the current upload copy when it is asked for and has
    `dtype`, else the newest value (`_live`)."""
    hp = by_param.get(id(t))
    group = hp.group if hp is not None else None
    if upload_buf is None or hp is None or hp.master is None or group is None or group.shares_master:
        return _live(t, by_param)
    upload = hp.uploads[upload_buf]
    return upload if upload.dtype == dtype else hp.master


def _handout(t: torch.Tensor, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    target = dtype if t.is_floating_point() else t.dtype
    return t.detach().to(device=device, dtype=target)  # the tensor itself when nothing changes


def model_state(store: HostStore, model: nn.Module) -> dict[str, torch.Tensor]:
    """`{name: live master}` for each trainable `model.named_parameters()` name: what training changes
    (a LoRA model's adapters; its frozen base is the one loaded from `actor.path`).

    The master parameters themselves: in the asynchronous step an update may re-point a shared
    master at the other upload buffer, and the parameter object follows it."""
    by_param = _by_param(store)
    return {name: _live(p, by_param) for name, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def load_model_state(store: HostStore, model: nn.Module, saved: Mapping[str, Any]) -> None:
    """Write `saved` (plain tensors or DTensors, by trainable `model.named_parameters()` name, as
    `model_state` has them) into the masters; tensors that already are the live ones are left alone.
    The caller refreshes the upload copies afterwards."""
    by_param = _by_param(store)
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    missing = [name for name, _ in trained if name not in saved]
    if missing:
        raise KeyError(
            f"the checkpoint holds no weights for {missing[:5]}; it was written for another model (or other "
            "actor.use_lora settings)"
        )
    for name, p in trained:
        target = _live(p, by_param)
        value = saved[name]
        value = value.full_tensor() if hasattr(value, "full_tensor") else value  # a DTensor: gathered
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(
                f"weight {name!r} is {tuple(value.shape)} in the checkpoint but {tuple(target.shape)} in this model"
            )
        if value.data_ptr() != target.data_ptr():
            target.copy_(value)
