"""Exporting a trained model as a Hugging Face directory (safetensors + config), atomically.

We write the state dict ourselves with `safetensors.torch.save_file` instead of calling
`save_pretrained`, because `save_pretrained` refuses models that were loaded from GGUF and
would otherwise be the only path. The cost is re-implementing two of its details: tied
weights (the duplicate of a shared tensor is dropped; transformers re-ties it from
`tie_word_embeddings` on load) and sharding (`model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json` past `max_shard_size_bytes`).

Tensors arrive one at a time (an engine's `named_weights`: gathered from shards, or read from
a host store) and are cast and written shard by shard, so the extra host memory is one shard,
not a second copy of the model. Every engine exports through this one function. The directory is written under a temporary name next
to `out_dir` and renamed into place, so a reader (a rollout server reloading weights from
disk, say) never sees a half-written export.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = ["ShardWriter", "export_hf", "hf_state_names", "host_copy"]

DEFAULT_MAX_SHARD_SIZE_BYTES = 5 * 2**30
ADAPTER_DIRNAME = "adapter"
"""Where an export keeps a LoRA model's adapters (peft's layout), beside the merged weights."""


def hf_state_names(model: torch.nn.Module) -> list[str]:
    """The `model.state_dict()` names a Hugging Face loader reads, each tensor once.

    A tie target whose source is present (lm_head.weight when the config ties it to
    model.embed_tokens.weight) is dropped even when the two are separate copies, as in a
    state dict gathered from a sharded model; any other tensor stored under two names is kept
    under its first name. Every engine's `named_weights` yields exactly these names.
    """
    state = model.state_dict()
    tied = getattr(model, "all_tied_weights_keys", None) or {}  # {target: source}, config-aware
    names, seen = [], set()
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
        if key not in seen or local.device.type == "meta":
            seen.add(key)
            names.append(name)
    return names


def host_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` whole, on the host, owning its storage (what safetensors writes), floats cast to `dtype`
    (default: kept). A DTensor is gathered with `full_tensor()`: a collective every rank joins."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    cast = dtype if dtype is not None and full.is_floating_point() else full.dtype
    out = full.detach().to("cpu", dtype=cast).contiguous()
    if out.untyped_storage().nbytes() != out.numel() * out.element_size():
        out = out.clone()  # a view into a larger buffer: safetensors needs an owning tensor
    return out


class ShardWriter:
    """Safetensors shards of at most `max_bytes`, written as tensors arrive: one shard held at a time.

    `finish()` names them as transformers does (`<stem>.safetensors`, or numbered shards and an
    index); the checkpointer writes its tensors the same way under its own stem.
    """

    def __init__(self, out: Path, max_bytes: int, *, stem: str = "model") -> None:
        self.out, self.max_bytes, self.stem = out, max_bytes, stem
        self.files: list[tuple[str, list[str], int]] = []  # (file, names, bytes)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if self.pending and self.pending_bytes + t.nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = t
        self.pending_bytes += t.nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        file = f"{self.stem}-part-{len(self.files):05d}.safetensors"
        save_file(self.pending, self.out / file, metadata={"format": "pt"})
        self.files.append((file, list(self.pending), self.pending_bytes))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Name the shards as transformers does: `model.safetensors`, or numbered shards plus an index."""
        self.flush()
        if not self.files:  # nothing to write: an empty file, so the reader finds one
            from safetensors.torch import save_file

            save_file({}, self.out / f"{self.stem}.safetensors", metadata={"format": "pt"})
            return
        if len(self.files) == 1:
            os.rename(self.out / self.files[0][0], self.out / f"{self.stem}.safetensors")
            return
        weight_map: dict[str, str] = {}
        for i, (file, names, _) in enumerate(self.files, start=1):
            final = f"{self.stem}-{i:05d}-of-{len(self.files):05d}.safetensors"
            os.rename(self.out / file, self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": sum(b for *_, b in self.files)}, "weight_map": weight_map}
        (self.out / f"{self.stem}.safetensors.index.json").write_text(
            json.dumps(index, indent=2, sort_keys=True) + "\n"
        )


def _write_adapter(
    model: torch.nn.Module, out: Path, adapter: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> None:
    from laden.model.lora import adapter_config

    out.mkdir()
    shards = ShardWriter(out, max_bytes, stem="adapter_model")
    for name, t in adapter:
        shards.add(name, host_copy(t))
    shards.finish()
    adapter_config(model).save_pretrained(out)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move `tmp` to `out`; an existing export at `out` is swapped out by rename, then deleted."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old)


def _check_out_dir(out: Path, max_shard_size_bytes: int) -> None:
    if max_shard_size_bytes <= 0:
        raise ValueError(f"max_shard_size_bytes={max_shard_size_bytes} must be positive; use e.g. 5 GiB")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "config.json").exists())):
        raise ValueError(
            f"out_dir={str(out)!r} exists and is not a model export (no config.json); it would be replaced, "
            "so choose an empty or new directory"
        )


def export_hf(
    model: torch.nn.Module,
    out_dir: str | Path,
    *,
    dtype: torch.dtype,
    tokenizer=None,
    max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    write: bool = True,
    adapter: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> Path:
    """Write `model`'s weights (in `dtype`), config, generation config and `tokenizer` to `out_dir`.

    The result loads with `AutoModelForCausalLM.from_pretrained(out_dir)`. Returns `out_dir`.
    `weights`: the `(name, tensor)` pairs to write (an engine's `named_weights`), consumed one
    at a time; by default the model's own state (`hf_state_names`). DTensors are gathered with
    `full_tensor()`, a collective: under torch.distributed every rank calls this with its own
    iterator and only the rank with `write=True` writes (the others only consume the iterator).
    `model` supplies the config; its parameters may be empty or on the meta device then.
    `adapter`: a LoRA model's adapters in peft's layout (`laden.model.lora.peft_adapter_state`),
    written beside the weights as the directory `adapter/` that `peft.PeftModel.from_pretrained`
    loads (`adapter_model.safetensors` in their own dtype, `adapter_config.json`), gathered as
    `weights` are.
    """
    out = Path(out_dir)
    _check_out_dir(out, max_shard_size_bytes)
    if weights is None:
        state = model.state_dict()
        weights = ((name, state[name]) for name in hf_state_names(model))
    if not write:
        for _, t in itertools.chain(weights, adapter or ()):
            if hasattr(t, "full_tensor"):
                t.full_tensor()  # the collective every rank joins; the writer keeps the result
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        shards = ShardWriter(tmp, max_shard_size_bytes)
        for name, t in weights:
            shards.add(name, host_copy(t, dtype))
        shards.finish()
        config = copy.deepcopy(model.config)
        config.dtype = dtype
        if hasattr(config, "quantization_config"):  # the tensors written are plain `dtype` ones (a GGUF
            del config.quantization_config  # file is dequantized on load): readers must not look for quantized ones
        config.save_pretrained(tmp)
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if adapter is not None:
            _write_adapter(model, tmp / ADAPTER_DIRNAME, adapter, max_shard_size_bytes)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
