"""Resumable training checkpoints, one layout for every engine, stored as data.

A checkpoint is a directory `step_<N>/`:

- `model*.safetensors` (+ index): every trained parameter's master weight under its Hugging
  Face name, in the master dtype; `optimizer*.safetensors`: each parameter's optimizer
  state as `<name>/<key>` (`exp_avg`, `exp_avg_sq`, `comp`, `step`, ...; `laden.optim.named_state`);
- `optimizer_groups.json` (hyper-parameters of the param groups), `scheduler.json`,
  `trainer.json` (step, data position), `meta.json` (what wrote it: engine, backend,
  data-parallel size, optimizer type, dtypes, laden's checkpoint format), `config.yaml` (the
  resolved config of the run that wrote it);
- `rng_rank<R>.pt`: Python, NumPy and torch generators of every rank (tensors, ints and lists,
  loaded with `weights_only=True`);
- one subdirectory per further trained engine of the run (`critic/`: PPO's value model), each
  with its own `model*`, `optimizer*`, `optimizer_groups.json`, `scheduler.json` and `version.json`.

Nothing is unpickled on load: safetensors, JSON and a `weights_only` load, so a run directory
from someone else cannot run code. Because tensors are stored whole under their names, any
engine reads any checkpoint at any data-parallel size: a sharded engine's DTensors are gathered
one at a time on save (a collective; rank 0 writes, one shard file of at most
`max_shard_bytes` held at a time) and each rank reads only its own slice on load
(`safe_open(...).get_slice`). The cost against `torch.distributed.checkpoint` is that one rank
writes everything; what it buys is that the files are plain data.

Everything is written into a temporary directory that rank 0 renames into place after all
ranks finished, so a crash mid-save never leaves a half checkpoint that resume would pick up.
Restoring every generator is what makes resumed == uninterrupted bitwise on the CPU.

Every file is hashed as it is written and fsynced, and `manifest.json` (each file's size and
sha256) is written last before the rename (`laden.engine.integrity`, with the measured cost:
about 1.3 s more per GiB of checkpoint on one core). Before resume the newest checkpoint is checked
against it (`laden.engine.rundir`); a file that still fails to read on load is a
`DamagedCheckpointError` naming it and the fix, never a traceback. Pruning (`keep_last`) counts only
checkpoints that pass the cheap check (sizes, parsing) and deletes none newer than the one just
written, nor any that fails it: laden never deletes a damaged checkpoint. A full disk removes the
partial directory and says how much space the checkpoint needs (`CheckpointDiskFullError`).
"""

from __future__ import annotations

import io
import json
import logging
import random
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from laden.engine.integrity import (
    CheckpointDiskFullError,
    CheckpointFiles,
    DamagedCheckpointError,
    find_damage,
    is_old_layout,
    read_config,
    read_json,
    reading,
    safetensors_chunks,
    shown,
)
from laden.model.hf.export import ShardWriter, host_copy
from laden.safe_io import fsync_dir

log = logging.getLogger("laden.checkpoint")

FORMAT = 2
"""The checkpoint layout version in `meta.json`; older layouts (format 1: pickled engine state) are refused."""
_PREFIX = "step_"
DEFAULT_MAX_SHARD_BYTES = 2 * 2**30


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors, ints and lists (what `torch.load(weights_only=True)` reads)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [
            kind,
            torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------- engine state


def flat_tensors(state: dict[str, Any]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file stem, key, tensor) of an engine state: model weights, then optimizer state entries."""
    for name, t in state["model"].items():
        yield "model", name, t
    for name, entry in state["optimizer"]["state"].items():
        for key, t in entry.items():
            yield "optimizer", f"{name}/{key}", t


def save_engine(
    engine: Any,
    path: Path,
    *,
    rank: int = 0,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    files: CheckpointFiles | None = None,
) -> None:
    """Write `engine.state_dict()` into `path` (every rank calls it; rank 0 writes) through `files` (the
    checkpoint's, which records each file for the manifest; default: its own, raising a full disk's error)."""
    own = files is None
    files = CheckpointFiles(path) if files is None else files
    state = engine.state_dict()
    writers = {stem: TensorShards(files, path, max_shard_bytes, stem=stem) for stem in ("model", "optimizer")}
    items = getattr(engine, "checkpoint_items", None)  # a pipeline engine: every stage's tensors to rank 0
    flat = items(state) if items is not None else ((s, k, host_copy(t)) for s, k, t in flat_tensors(state))
    for stem, key, full in flat:  # every rank joins the gathers
        if rank == 0:
            assert full is not None
            writers[stem].add(key, full)
    if rank != 0:
        return
    for writer in writers.values():
        writer.finish()
    _write_json(files, path / "optimizer_groups.json", state["optimizer"]["param_groups"])
    _write_json(files, path / "scheduler.json", state["scheduler"])
    _write_json(files, path / "version.json", {"version": int(state["version"])})
    if own and files.full is not None:
        raise files.full


def _write_json(files: CheckpointFiles, path: Path, value: Any) -> None:
    files.write(path, [(json.dumps(value, indent=2, default=_jsonable) + "\n").encode()])


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "__dict__"):  # the LR schedule's factor object
        return vars(value)
    raise TypeError(f"cannot store {type(value).__name__} in a checkpoint's JSON")


class TensorShards(ShardWriter):
    """`laden.model.hf.export.ShardWriter`'s shards of one stem, written through `CheckpointFiles`, which
    hashes them as they are written."""

    def __init__(self, files: CheckpointFiles, out: Path, max_bytes: int, *, stem: str) -> None:
        super().__init__(out, max_bytes, stem=stem)
        self.files = files

    def _write_tensors(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        self.files.write(path, safetensors_chunks(tensors, {"format": "pt"}))

    def _rename(self, src: Path, dst: Path) -> None:
        self.files.rename(src, dst)

    def _write_text(self, path: Path, text: str) -> None:
        self.files.write(path, [text.encode()])


class _Reader:
    """Tensors of one stem (`model`, `optimizer`) by key, across its shard files."""

    def __init__(self, path: Path, stem: str) -> None:
        from safetensors import safe_open

        index = path / f"{stem}.safetensors.index.json"
        files = (
            sorted(set(read_json(index)["weight_map"].values()))
            if index.exists()
            else [f"{stem}.safetensors"]
        )
        self.where: dict[str, tuple[Any, Path]] = {}
        for name in files:
            with reading(path / name):
                handle = safe_open(str(path / name), framework="pt")
                self.where.update((key, (handle, path / name)) for key in handle.keys())  # noqa: SIM118

    def read_into(self, key: str, target: torch.Tensor, what: str) -> None:
        if key not in self.where:
            raise KeyError(f"the checkpoint holds no {what} {key!r}")
        handle, file = self.where[key]
        local, offsets = _local_and_offsets(target)
        with reading(file):
            piece = handle.get_slice(key)
            shape = tuple(piece.get_shape())
        if shape != tuple(target.shape):
            raise ValueError(
                f"{what} {key!r} is {shape} in the checkpoint but {tuple(target.shape)} in this model"
            )
        with reading(file):
            if local is target:  # a plain tensor: all of it
                value = handle.get_tensor(key)
            else:  # this rank's shard of a DTensor
                value = piece[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))]
        with torch.no_grad():
            local.copy_(value.reshape(local.shape))


def checkpoint_tensors(path: Path, stem: str = "model") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor a checkpoint directory stores under `stem` (`model`: the trained
    weights under their Hugging Face names), read one at a time."""
    reader = _Reader(path, stem)
    for key, (handle, file) in reader.where.items():
        with reading(file):
            tensor = handle.get_tensor(key)
        yield key, tensor


def checkpoint_tensor_names(path: Path, stem: str = "model") -> list[str]:
    """The names of the tensors a checkpoint directory stores under `stem`, read from the files' headers
    (no tensor is read)."""
    return list(_Reader(path, stem).where)


def _local_and_offsets(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's part of `t` and where it starts in the full tensor (all zeros for a plain tensor)."""
    if not hasattr(t, "to_local"):
        return t, (0,) * t.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t.to_local()  # type: ignore[attr-defined]
    _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
    return local, tuple(offsets)


def load_engine(
    engine: Any, path: Path, *, keep: Callable[[dict[str, Any]], dict[str, Any]] | None = None
) -> None:
    """Fill `engine.state_dict()` from `path` (each rank reads its own slices), then load it back.

    `keep(state)`: a chance to adjust what is loaded (the resume policy keeps the new config's
    schedule and hyper-parameters); it gets the filled state and returns what to load.
    """
    state = engine.state_dict()
    readers = {stem: _Reader(path, stem) for stem in ("model", "optimizer")}
    for stem, key, t in flat_tensors(state):
        readers[stem].read_into(key, t, "weight" if stem == "model" else "optimizer state")
    state["optimizer"]["param_groups"] = read_json(path / "optimizer_groups.json")
    state["scheduler"] = read_json(path / "scheduler.json")
    state["version"] = read_json(path / "version.json")["version"]
    engine.load_state_dict(keep(state) if keep is not None else state)


# ------------------------------------------------------------------------------ checkpoints


def save_checkpoint(
    ckpt_root: Path,
    *,
    step: int,
    engine: Any,
    trainer_state: dict[str, Any],
    meta: dict[str, Any],
    config_yaml: str,
    keep_last: int,
    rank: int = 0,
    barrier: Callable[[], None] = lambda: None,
    any_rank: Callable[[bool], bool] = lambda flag: flag,
    others: Mapping[str, Any] | None = None,
) -> Path:
    """Atomically write checkpoint `step` under `ckpt_root` (every rank calls this) and prune old ones.

    `others`: further engines trained by the run, each written to the subdirectory of its name.
    `any_rank(flag)`: whether `flag` holds on any rank (`Runtime.any_rank`), so that a full disk on any
    rank publishes nothing and raises `CheckpointDiskFullError` on every rank once all are through.
    """
    final = ckpt_root / f"{_PREFIX}{step}"
    tmp = ckpt_root / f".tmp_{_PREFIX}{step}"
    files = CheckpointFiles(tmp)
    if rank == 0:
        files.mkdir(ckpt_root)
        if tmp.exists():
            shutil.rmtree(tmp)
        files.mkdir(tmp)
    barrier()
    save_engine(engine, tmp, rank=rank, files=files)
    for name, other in (others or {}).items():
        if rank == 0:  # only rank 0 writes into it
            files.mkdir(tmp / name)
        save_engine(other, tmp / name, rank=rank, files=files)
    files.write(tmp / f"rng_rank{rank}.pt", [_torch_bytes(rng_state())])
    barrier()
    full_anywhere = any_rank(files.full is not None)
    error = None
    if rank == 0:
        error = _finish(files, final, full_anywhere=full_anywhere, step=step, trainer_state=trainer_state,
                        meta=meta, config_yaml=config_yaml)  # fmt: skip
        if error is None:
            _prune(ckpt_root, final, keep_last)
    elif full_anywhere:
        error = CheckpointDiskFullError(
            f"the disk filled while writing checkpoint {final}; nothing was published (rank 0 says how much "
            "space it needs)"
        )
    barrier()
    if error is not None:
        raise error
    return final


def _finish(
    files: CheckpointFiles, final: Path, *, full_anywhere: bool, step: int, trainer_state: dict[str, Any],
    meta: dict[str, Any], config_yaml: str,
) -> CheckpointDiskFullError | None:  # fmt: skip
    """Rank 0's part after every rank wrote its files: the run's files, the manifest, the rename (or, after a
    full disk on any rank, the partial directory removed and the error to raise)."""
    tmp = files.root  # after a full disk on rank 0 the files below are counted, not written
    files.write(tmp / "config.yaml", [config_yaml.encode()])
    _write_json(files, tmp / "meta.json", {"format": FORMAT, **meta})
    _write_json(files, tmp / "trainer.json", {"step": step, **trainer_state})
    for rng in sorted(tmp.glob("rng_rank*.pt")):  # the other ranks' generators
        if rng.name not in files.entries:
            files.add(rng)
    files.write_manifest()  # last: it lists every file, and fsyncs the directories
    if full_anywhere or files.full is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        return _disk_full(files, final)
    if final.exists():  # an earlier attempt at this step (a damaged checkpoint that resume skipped)
        aside = _free_name(final)
        final.rename(aside)
        log.warning("%s already existed; kept as %s (laden deletes no checkpoint it did not verify): "
                    "delete it once it is no longer needed", final, aside.name)  # fmt: skip
    tmp.rename(final)
    fsync_dir(final.parent)
    return None


def _free_name(final: Path) -> Path:
    aside = final.with_name(f"{final.name}.replaced")
    n = 2
    while aside.exists():
        aside, n = final.with_name(f"{final.name}.replaced.{n}"), n + 1
    return aside


def _disk_full(files: CheckpointFiles, final: Path) -> CheckpointDiskFullError:
    why = files.full.strerror if files.full is not None else "on another rank"
    previous = list_checkpoints(final.parent)
    then = (f"rerun the same command to resume from {previous[-1].name}" if previous
            else "rerun the same command (no earlier checkpoint: it starts from step 0)")  # fmt: skip
    left = files.total_bytes - files.written_bytes
    free = shutil.disk_usage(final.parent).free
    return CheckpointDiskFullError(
        f"the disk filled while writing checkpoint {final} ({why}); it needs "
        f"{_size(files.total_bytes)} free: {_size(files.written_bytes)} were written before the disk filled and "
        f"{_size(left)} were left to write, and {_size(free)} are free now that the partial directory is removed. "
        f"The earlier checkpoints are untouched: free the space, then {then}"
    )


def _size(num_bytes: int) -> str:
    unit, scale = next(
        (u, s)
        for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
        if num_bytes >= s or s == 1
    )
    return f"{num_bytes / scale:.1f} {unit} ({num_bytes} bytes)"


def _prune(ckpt_root: Path, newest: Path, keep_last: int) -> None:
    """Keep `newest` (just written) and the `keep_last - 1` newest older checkpoints that pass the cheap check;
    delete the older ones that pass it. A checkpoint that fails it, or one newer than `newest` (from an attempt
    that resume skipped as damaged), is neither counted nor deleted."""
    if keep_last <= 0:
        return
    if find_damage(newest, hashes=False):  # sizes as written, files parse
        log.warning("%s does not read back as written; no checkpoint is pruned", newest)
        return
    kept = 1
    for old in reversed([p for p in list_checkpoints(ckpt_root) if _step_of(p) < _step_of(newest)]):
        if find_damage(old, hashes=False):
            continue
        if kept < keep_last:
            kept += 1
        else:
            shutil.rmtree(old)


def _step_of(path: Path) -> int:
    return int(path.name[len(_PREFIX) :])


def _torch_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Published checkpoints under `ckpt_root` (`step_<N>`, renamed into place whole), oldest first;
    `laden.engine.integrity.find_damage` says whether each is still intact."""
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)]
    return sorted([p for p in found if p.name[len(_PREFIX) :].isdigit()], key=_step_of)


def read_meta(path: Path) -> dict[str, Any]:
    """What wrote checkpoint `path` (`{"format": 1}` for the old pickled layout)."""
    if is_old_layout(path):
        return {"format": 1}
    meta = read_json(path / "meta.json")
    if not isinstance(meta, dict):
        raise DamagedCheckpointError(
            f"{shown(path / 'meta.json')} holds no description of its writer; delete {path} to resume from the "
            "checkpoint before it"
        )
    return meta


def read_run_config(path: Path) -> dict[str, Any]:
    """The resolved config of the run that wrote checkpoint `path`."""
    return read_config(path / "config.yaml")


def load_checkpoint(
    path: Path,
    engine: Any,
    *,
    rank: int = 0,
    keep: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    others: Mapping[str, tuple[Any, Callable[[dict[str, Any]], dict[str, Any]] | None]] | None = None,
) -> dict[str, Any]:
    """Restore the engine and this rank's RNG state; return the trainer state.

    `others`: `{name: (engine, keep)}` of the further engines `save_checkpoint` wrote.
    """
    load_engine(engine, path, keep=keep)
    for name, (other, other_keep) in (others or {}).items():
        if not (path / name).is_dir():
            raise ValueError(
                f"checkpoint {path} holds no {name} state (it was written by a run without one); resume with "
                f"the config that wrote it, or set trial_name to a new name to start a new run"
            )
        load_engine(other, path / name, keep=other_keep)
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.exists():  # a different world size has no file for this rank: keep the seeded state
        with reading(rng_file):
            state = torch.load(rng_file, weights_only=True)
        set_rng_state(state)
    return read_json(path / "trainer.json")


def keep_new_hyperparameters(
    engine: Any, settings: Any, step: int
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The resume policy: optimizer state and step count from the checkpoint, the schedule and the
    param groups' hyper-parameters from this run's config (equal to the checkpoint's when unchanged)."""
    fresh = engine.state_dict()
    fresh_groups = [{k: v for k, v in g.items()} for g in fresh["optimizer"]["param_groups"]]
    fresh_schedule = dict(fresh["scheduler"])

    def keep(state: dict[str, Any]) -> dict[str, Any]:
        lr = settings.lr_at(step)
        state["optimizer"]["param_groups"] = [{**g, "lr": lr} for g in fresh_groups]
        saved = state["scheduler"]
        state["scheduler"] = {**fresh_schedule, "last_epoch": saved["last_epoch"], "_step_count": saved["_step_count"],
                              "_last_lr": [lr] * len(fresh_schedule.get("base_lrs", [lr]))}  # fmt: skip
        return state

    return keep


def checkpoint_meta(cfg: Any, engine: Any) -> dict[str, Any]:
    """What a checkpoint records about the engine and optimizer that wrote it (checked on resume)."""
    return {"backend": cfg.actor.backend, "engine": type(engine).__name__, "dp_size": engine.dp_size,
            "optimizer": cfg.actor.optimizer.type, "optimizer_dtype": cfg.actor.optimizer_dtype,
            "dtype": cfg.actor.dtype}  # fmt: skip
