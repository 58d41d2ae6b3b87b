"""Sharded state of the `fsdp` engine: DCP checkpoints and the Hugging Face export.

- Checkpoints use `torch.distributed.checkpoint` (DCP): each rank writes its shards with
  their global offsets, so a run saved at `d4` resumes at `d2` (or `d1`, one plain process):
  the loader reads whichever pieces its own shards need. Master weights and optimizer
  states keep the storage dtype (fp32), so resumed training is exact.
- Hugging Face export gathers one tensor at a time (`full_tensor`, a collective every rank
  joins) and only rank 0 keeps it, cast to the compute dtype, in a host buffer written out
  as a safetensors shard every `max_shard_bytes`. Cost: one all-gather per tensor (slower
  than a bulk gather) in exchange for no full model copy on any rank.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

DEFAULT_SHARD_BYTES = 2 << 30


# -------------------------------------------------------------- state dicts


def model_state_dict(model: nn.Module, *, distributed: bool) -> dict[str, Any]:
    """FQN -> tensor; DTensor shards under FSDP (no gathering)."""
    return get_model_state_dict(model) if distributed else dict(model.state_dict())


def load_model_state_dict(model: nn.Module, state: dict[str, Any], *, distributed: bool) -> None:
    if distributed:
        set_model_state_dict(model, state)
    else:
        model.load_state_dict(state)


def optimizer_state_dict(model: nn.Module, optimizer, *, distributed: bool) -> dict[str, Any]:
    """Optimizer state keyed by parameter FQN (the format DCP reshards)."""
    if hasattr(optimizer, "fqn_state_dict"):
        return optimizer.fqn_state_dict(model)
    return get_optimizer_state_dict(model, optimizer)


def load_optimizer_state_dict(
    model: nn.Module, optimizer, state: dict[str, Any], *, distributed: bool
) -> None:
    if hasattr(optimizer, "load_fqn_state_dict"):
        optimizer.load_fqn_state_dict(model, state)
    else:
        set_optimizer_state_dict(model, optimizer, state)


def save_dcp(state: dict[str, Any], path: Path) -> None:
    """Every rank writes its shards under `path` (a directory)."""
    Path(path).mkdir(parents=True, exist_ok=True)
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=str(path))


def load_dcp(state: dict[str, Any], path: Path) -> None:
    """Fill `state` (this engine's current state dict, any sharding) in place from `path`."""
    if not Path(path).is_dir():
        raise ValueError(f"checkpoint {path} does not exist; pass a directory written by save_checkpoint")
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path))


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns when it runs without a process group; for one plain process that is the intent."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ----------------------------------------------------------------- export


def export_hf(
    model: nn.Module,
    out_dir: Path,
    *,
    dtype: torch.dtype,
    tokenizer: Any | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Write `config.json`, safetensors shards (+ index) and the tokenizer; all ranks must call it."""
    from safetensors.torch import save_file

    is_writer = not dist.is_initialized() or dist.get_rank() == 0
    out_dir = Path(out_dir)
    if is_writer:
        out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    files: list[str] = []
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if id(tensor) in seen:  # tied weights are saved once, as transformers does
            continue
        seen.add(id(tensor))
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # collective
        if not is_writer:
            continue
        value = full.detach().to(dtype if full.is_floating_point() else full.dtype).cpu().contiguous()
        if shard_bytes and shard_bytes + value.nbytes > max_shard_bytes:
            files.append(_write_shard(save_file, out_dir, shards[-1], len(files)))
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = value
        shard_bytes += value.nbytes
    if is_writer:
        files.append(_write_shard(save_file, out_dir, shards[-1], len(files)))
        _finish_export(model, out_dir, files, shards, dtype, tokenizer)
    if dist.is_initialized():
        dist.barrier()


def _write_shard(save_file, out_dir: Path, tensors: dict[str, torch.Tensor], index: int) -> str:
    name = f"model-{index + 1:05d}.safetensors"
    save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
    tensors.clear()  # the host buffer is bounded by one shard
    return name


def _finish_export(model, out_dir: Path, files: list[str], shards, dtype, tokenizer) -> None:
    """Rename a single shard to `model.safetensors` or write the index; save config and tokenizer."""
    from safetensors import safe_open

    if len(files) == 1:
        (out_dir / files[0]).rename(out_dir / "model.safetensors")
    else:
        weight_map = {}
        for file in files:
            with safe_open(str(out_dir / file), framework="pt") as f:
                weight_map.update({k: file for k in f.keys()})  # noqa: SIM118 - safe_open has no iterator
        index = {"metadata": {}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = model.config
    config.dtype = dtype
    config.save_pretrained(out_dir)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
