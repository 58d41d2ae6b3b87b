"""Exporting a trained model as a Hugging Face directory (safetensors + config), atomically.

We write the state dict ourselves with `safetensors.torch.save_file` instead of calling
`save_pretrained`, because `save_pretrained` refuses models that were loaded from GGUF and
would otherwise be the only path. The cost is re-implementing two of its details: tied
weights (the duplicate of a shared tensor is dropped; transformers re-ties it from
`tie_word_embeddings` on load) and sharding (`model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json` past `max_shard_size_bytes`).

Tensors are cast to the export dtype one shard at a time, so the extra host memory is one
shard, not a second copy of the model. The directory is written under a temporary name next
to `out_dir` and renamed into place, so a reader (a rollout server reloading weights from
disk, say) never sees a half-written export.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

__all__ = ["export_hf"]

DEFAULT_MAX_SHARD_SIZE_BYTES = 5 * 2**30
_INDEX_NAME = "model.safetensors.index.json"


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain local tensor (gathers a DTensor when the model is sharded)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _unique_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with each tied or shared tensor once.

    A tie target whose source is present (lm_head.weight when the config ties it to
    model.embed_tokens.weight) is dropped even when the two are separate copies, as in a
    state dict gathered from a sharded model; any other tensor stored under two names is kept
    under its first name.
    """
    tied = getattr(model, "all_tied_weights_keys", None) or {}  # {target: source}, config-aware
    unique: dict[str, torch.Tensor] = {}
    seen = set()
    for name, t in state.items():
        if name in tied and tied[name] in state:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t  # DTensor: its shard identifies it
        key = (
            local.device,
            local.untyped_storage().data_ptr(),
            local.storage_offset(),
            tuple(t.shape),
            t.dtype,
        )
        if key not in seen:
            seen.add(key)
            unique[name] = t
    return unique


def _export_tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = _full(t.detach()).to("cpu", dtype=dtype if t.is_floating_point() else t.dtype).contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()  # a view into a larger buffer: safetensors needs an owning tensor
    return t


def _plan_shards(
    state: dict[str, torch.Tensor], dtype: torch.dtype, max_shard_size_bytes: int
) -> list[list[str]]:
    """Greedy, in state-dict order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    item_bytes = torch.empty((), dtype=dtype).element_size()
    for name, t in state.items():
        num_bytes = t.numel() * (item_bytes if t.is_floating_point() else t.element_size())
        if shards[-1] and shard_bytes + num_bytes > max_shard_size_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += num_bytes
    return shards


def _write_weights(
    model: torch.nn.Module,
    state: Mapping[str, torch.Tensor],
    out: Path,
    dtype: torch.dtype,
    max_shard_size_bytes: int,
) -> None:
    from safetensors.torch import save_file

    state = _unique_state(model, state)
    shards = _plan_shards(state, dtype, max_shard_size_bytes)
    if len(shards) == 1:
        tensors = {name: _export_tensor(state[name], dtype) for name in shards[0]}
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for i, names in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _export_tensor(state[name], dtype) for name in names}
        save_file(tensors, out / file_name, metadata={"format": "pt"})
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file_name))
        del tensors  # one shard of cast copies alive at a time
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out / _INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move `tmp` to `out`; an existing export at `out` is swapped out by rename, then deleted."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old)


def export_hf(
    model: torch.nn.Module,
    out_dir: str | Path,
    *,
    dtype: torch.dtype,
    tokenizer=None,
    max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write `model` (weights in `dtype`), its config, generation config and `tokenizer` to `out_dir`.

    The result loads with `AutoModelForCausalLM.from_pretrained(out_dir)`. Returns `out_dir`.
    `state_dict` replaces `model.state_dict()` when given: a sharded engine gathers the full
    state on one rank (DTensors left in it are gathered with `full_tensor()`, a collective)
    and passes it here; `model` then only supplies the config and the tied-weight names.
    """
    out = Path(out_dir)
    if max_shard_size_bytes <= 0:
        raise ValueError(f"max_shard_size_bytes={max_shard_size_bytes} must be positive; use e.g. 5 GiB")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "config.json").exists())):
        raise ValueError(
            f"out_dir={str(out)!r} exists and is not a model export (no config.json); it would be replaced, "
            "so choose an empty or new directory"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        state = model.state_dict() if state_dict is None else state_dict
        _write_weights(model, state, tmp, dtype, max_shard_size_bytes)
        config = copy.deepcopy(model.config)
        config.dtype = dtype
        config.save_pretrained(tmp)
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
