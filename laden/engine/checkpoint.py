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
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from laden.model.hf.export import ShardWriter, host_copy

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
    engine: Any, path: Path, *, rank: int = 0, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> None:
    """Write `engine.state_dict()` into `path` (every rank calls it; rank 0 writes)."""
    state = engine.state_dict()
    writers = {stem: ShardWriter(path, max_shard_bytes, stem=stem) for stem in ("model", "optimizer")}
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
    _write_json(path / "optimizer_groups.json", state["optimizer"]["param_groups"])
    _write_json(path / "scheduler.json", state["scheduler"])
    _write_json(path / "version.json", {"version": int(state["version"])})


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "__dict__"):  # the LR schedule's factor object
        return vars(value)
    raise TypeError(f"cannot store {type(value).__name__} in a checkpoint's JSON")


class _Reader:
    """Tensors of one stem (`model`, `optimizer`) by key, across its shard files."""

    def __init__(self, path: Path, stem: str) -> None:
        from safetensors import safe_open

        index = path / f"{stem}.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [f"{stem}.safetensors"]
        missing = [f for f in files if not (path / f).exists()]
        if missing:
            raise ValueError(
                f"checkpoint {path} is incomplete: {', '.join(missing)} missing; delete it to resume from an earlier one"
            )
        self.handles = [safe_open(str(path / f), framework="pt") for f in files]
        self.where = {key: h for h in self.handles for key in h.keys()}  # noqa: SIM118 - safe_open has no iterator

    def read_into(self, key: str, target: torch.Tensor, what: str) -> None:
        handle = self.where.get(key)
        if handle is None:
            raise KeyError(f"the checkpoint holds no {what} {key!r}")
        local, offsets = _local_and_offsets(target)
        piece = handle.get_slice(key)
        shape = tuple(piece.get_shape())
        if shape != tuple(target.shape):
            raise ValueError(
                f"{what} {key!r} is {shape} in the checkpoint but {tuple(target.shape)} in this model"
            )
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
    for key, handle in reader.where.items():
        yield key, handle.get_tensor(key)


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
    state["optimizer"]["param_groups"] = json.loads((path / "optimizer_groups.json").read_text())
    state["scheduler"] = json.loads((path / "scheduler.json").read_text())
    state["version"] = json.loads((path / "version.json").read_text())["version"]
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
    others: Mapping[str, Any] | None = None,
) -> Path:
    """Atomically write checkpoint `step` under `ckpt_root` (every rank calls this) and prune old ones.

    `others`: further engines trained by the run, each written to the subdirectory of its name.
    """
    final = ckpt_root / f"{_PREFIX}{step}"
    tmp = ckpt_root / f".tmp_{_PREFIX}{step}"
    if rank == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    save_engine(engine, tmp, rank=rank)
    for name, other in (others or {}).items():
        if rank == 0:  # only rank 0 writes into it
            (tmp / name).mkdir()
        save_engine(other, tmp / name, rank=rank)
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    barrier()
    if rank == 0:
        (tmp / "config.yaml").write_text(config_yaml)
        _write_json(tmp / "meta.json", {"format": FORMAT, **meta})
        _write_json(tmp / "trainer.json", {"step": step, **trainer_state})  # last: marks it complete
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in list_checkpoints(ckpt_root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old)
    barrier()
    return final


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints under `ckpt_root`, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)]
    found = [p for p in found if (p / "trainer.json").exists() and p.name[len(_PREFIX) :].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def read_meta(path: Path) -> dict[str, Any]:
    """What wrote checkpoint `path` (`{"format": 1}` for the old pickled layout)."""
    meta = path / "meta.json"
    return json.loads(meta.read_text()) if meta.exists() else {"format": 1}


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
        set_rng_state(torch.load(rng_file, weights_only=True))
    return json.loads((path / "trainer.json").read_text())


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
