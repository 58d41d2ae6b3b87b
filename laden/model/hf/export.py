"""Exporting a trained model as a Hugging Face directory (safetensors + config), atomically.

We write the state dict ourselves with `safetensors.torch.save_file` instead of calling
`save_pretrained`, because `save_pretrained` refuses models that were loaded from GGUF and
would otherwise be the only path. The cost is re-implementing two of its details: tied
weights (the duplicate of a shared tensor is dropped; transformers re-ties it from
`tie_word_embeddings` on load) and sharding (`model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json` past `max_shard_size_bytes`).

Tensors arrive one at a time (an engine's `named_weights`: gathered from shards, or read from
a host store) and are cast and written shard by shard, so the extra host memory is one shard,
not a second copy of the model. Every engine exports through this one function.

The directory is written under a temporary name next to `out_dir`
(`.NAME.tmp-<host>-<pid>`), every file and directory in it fsync'd, `laden_export.json` (each
file's size) written last, and only then renamed into place: a reader (a rollout server
reloading weights from disk, say) never sees a half-written export, a power loss cannot
publish one with empty files, and `export_complete` tells a whole export from anything else.
Cost: the fsyncs wait for the export to reach the disk (seconds per GiB on a slow disk), which a
published export needs anyway. A writer killed mid-export leaves its temporary directory; the
next export to the same `out_dir` removes those of this host whose process is gone (one of
another host is kept, with a warning: its process cannot be checked from here). A full disk
removes the partial export and raises `DiskFullError` with the bytes the export needs; under
torch.distributed the writer first joins the gathers the other ranks wait in, so none hangs.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import os
import re
import shutil
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from laden.safe_io import DiskFullError, atomic_write_text, fsync_dir, is_disk_full

__all__ = ["EXPORT_MANIFEST", "ShardWriter", "export_complete", "export_hf", "hf_state_names", "host_copy"]

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_SIZE_BYTES = 5 * 2**30
ADAPTER_DIRNAME = "adapter"
"""Where an export keeps a LoRA model's adapters (peft's layout), beside the merged weights."""
EXPORT_MANIFEST = "laden_export.json"
"""Written last into an export: `{"format": 1, "files": {path: bytes}}`, every other file and its size."""


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
        self.shards: list[tuple[str, list[str], int]] = []  # (file, names, bytes)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if self.pending and self.pending_bytes + t.nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = t
        self.pending_bytes += t.nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        file = f"{self.stem}-part-{len(self.shards):05d}.safetensors"
        self._write_tensors(self.out / file, self.pending)
        self.shards.append((file, list(self.pending), self.pending_bytes))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Name the shards as transformers does: `model.safetensors`, or numbered shards plus an index."""
        self.flush()
        if len(self.shards) <= 1:  # no tensors: an empty file, so the reader finds one
            name = self.out / f"{self.stem}.safetensors"
            if self.shards:
                self._rename(self.out / self.shards[0][0], name)
            else:
                self._write_tensors(name, {})
            return
        weight_map: dict[str, str] = {}
        for i, (file, names, _) in enumerate(self.shards, start=1):
            final = f"{self.stem}-{i:05d}-of-{len(self.shards):05d}.safetensors"
            self._rename(self.out / file, self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": sum(b for *_, b in self.shards)}, "weight_map": weight_map}
        self._write_text(
            self.out / f"{self.stem}.safetensors.index.json",
            json.dumps(index, indent=2, sort_keys=True) + "\n",
        )

    # how files are written: plainly here; the checkpointer's subclass hashes them as it writes

    def _write_tensors(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        save_file(tensors, path, metadata={"format": "pt"})

    def _rename(self, src: Path, dst: Path) -> None:
        os.rename(src, dst)

    def _write_text(self, path: Path, text: str) -> None:
        path.write_text(text)


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
    """Move `tmp` to `out`; an existing export at `out` is swapped out by rename, then deleted (a link
    there is removed, never followed)."""
    if not os.path.lexists(out):
        os.rename(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{socket.gethostname()}-{os.getpid()}")
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)  # the previous export stays in place
        raise
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _publish(tmp: Path, out: Path) -> None:
    """Make `tmp` durable, list its files in `EXPORT_MANIFEST` (last), and rename it to `out` (the parent
    directory is fsync'd after, by the caller: the export is in place then, whatever that fsync says)."""
    paths = sorted(p for p in tmp.rglob("*") if p.is_file())
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    files = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in paths}
    atomic_write_text(tmp / EXPORT_MANIFEST, json.dumps({"format": 1, "files": files}, indent=1) + "\n")
    for directory in (p for p in tmp.rglob("*") if p.is_dir()):
        fsync_dir(directory)
    _replace_dir(tmp, out)


def export_complete(out_dir: str | Path) -> bool:
    """Whether `out_dir` holds a whole `export_hf` export: its manifest, and every file it lists at its size.
    An export by a laden without manifests, a directory cut short or copied in part: False."""
    out = Path(out_dir)
    try:
        files = json.loads((out / EXPORT_MANIFEST).read_text())["files"]
        return bool(files) and all(
            ".." not in Path(rel).parts and (out / rel).is_file() and (out / rel).stat().st_size == int(size)
            for rel, size in files.items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def remove_abandoned_exports(out_dir: str | Path) -> list[Path]:
    """Delete the temporary directories (`.NAME.tmp-*`, `.NAME.old-*`) that writers killed mid-export left
    beside `out_dir`: those of this host whose process is gone; returns them. One of another host is kept
    (its process cannot be checked from here), with a warning naming it."""
    out = Path(out_dir)
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(?:tmp|old)-(?:(?P<host>.+)-)?(?P<pid>\d+)")
    host, removed = socket.gethostname(), []
    for entry in out.parent.iterdir() if out.parent.is_dir() else ():
        match = pattern.fullmatch(entry.name)
        if match is None:
            continue
        pid = int(match["pid"])
        if (match["host"] or host) != host:  # a name without a host: an older laden's, written here
            log.warning("%s was left by an export on host %s; delete it once no export runs there", entry,
                        match["host"])  # fmt: skip
        elif pid == os.getpid() or not _alive(pid):
            _remove(entry)
            removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


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
        _join_gathers(itertools.chain(weights, adapter or ()))
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_exports(out)
    tmp = out.with_name(f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    tmp.mkdir()
    count = _ByteCount()
    weights = count.through(weights, dtype)
    adapter = None if adapter is None else count.through(adapter, None)
    try:
        _write_export(model, tmp, dtype=dtype, tokenizer=tokenizer, weights=weights, adapter=adapter,
                      max_shard_size_bytes=max_shard_size_bytes)  # fmt: skip
        _publish(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_disk_full(exc):
            raise
        _join_gathers(itertools.chain(weights, adapter or ()))  # the other ranks wait in these gathers
        raise DiskFullError(
            out, num_bytes=count.num_bytes or None, done=f"the partial export was removed and {out} is as it was",
            fix="free that much there (the size of the export's weights) and export again; for a laden run, rerun "
            "the same command: it resumes from the last checkpoint, and a finished run writes its missing export "
            "from the final one",
        ) from exc  # fmt: skip
    fsync_dir(out.parent)  # the rename, durable
    return out


def _write_export(
    model: torch.nn.Module,
    tmp: Path,
    *,
    dtype: torch.dtype,
    tokenizer: object,
    weights: Iterable[tuple[str, torch.Tensor]],
    adapter: Iterable[tuple[str, torch.Tensor]] | None,
    max_shard_size_bytes: int,
) -> None:
    shards = ShardWriter(tmp, max_shard_size_bytes)
    for name, t in weights:
        shards.add(name, host_copy(t, dtype))
    shards.finish()
    config = copy.deepcopy(model.config)
    config.dtype = dtype
    if hasattr(config, "quantization_config"):
        # the tensors written are plain `dtype` ones (a GGUF file is dequantized on load): readers must not
        # look for quantized ones
        del config.quantization_config
    config.save_pretrained(tmp)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)  # type: ignore[attr-defined]
    if adapter is not None:
        _write_adapter(model, tmp / ADAPTER_DIRNAME, adapter, max_shard_size_bytes)


class _ByteCount:
    """The bytes of the tensors passed through `through` (in the dtype they are written in)."""

    def __init__(self) -> None:
        self.num_bytes = 0

    def through(
        self, pairs: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in pairs:
            size = dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size()
            self.num_bytes += t.numel() * size
            yield name, t


def _join_gathers(pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Consume `pairs`, joining the collective of each DTensor (what a rank that does not write does)."""
    for _, t in pairs:
        if hasattr(t, "full_tensor"):
            t.full_tensor()  # the collective every rank joins; the writer keeps the result
