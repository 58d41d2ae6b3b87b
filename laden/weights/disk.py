"""Weight versions on disk: the trainer writes `root/v00000042/`, rollout engines read it.

A version is a directory of safetensors shards plus `manifest.json` (every tensor's name,
shape, dtype, byte size and shard, each shard's byte size and optionally its sha256, and
whether it is a `PartialUpdate`: only some of the model's weights, e.g. LoRA's). The
writer builds it under a hidden temporary name in `root`, fsyncs every file and the
directory, and renames it into place, so a version directory either is complete or does
not exist: a writer killed at any point leaves only its temporary directory, which
`latest_version` and `read_weights` never look at (the next write on the same host removes
it once its writer's process is gone). `read_weights` still checks a version against its
manifest before yielding anything (sizes always, checksums when written), so a version
copied half or damaged on the shared file system is refused with the file that is wrong.

Memory: tensors arrive one at a time (`TrainEngine.named_weights`) and are copied into the
current shard (a handed-out tensor may be reused for the next one), which is written and
dropped once the next tensor would push it past `shard_mb`: the writer holds at most one
shard plus one tensor, never the model. The reader holds one tensor at a time. Checksums
cost a second pass over each shard (its pages are still cached; ~1-2 GB/s for sha256), so
they are off by default; sizes catch truncation, the failure a crash or a partial copy
produces.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from laden.weights.partial import PartialUpdate

FORMAT = "laden-weights/1"
MANIFEST = "manifest.json"
DEFAULT_SHARD_MB = 1024
_VERSION_RE = re.compile(r"v(\d{8,})")
_TMP_PREFIX = ".tmp-"
_TMP_RE = re.compile(r"\.tmp-v\d{8,}-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}")
_HASH_CHUNK_BYTES = 8 * 2**20

ShardHook = Callable[[int, Path], None]

__all__ = [
    "FORMAT",
    "MANIFEST",
    "IncompleteVersionError",
    "latest_version",
    "list_versions",
    "read_weights",
    "version_dir",
    "write_weights",
]


class IncompleteVersionError(RuntimeError):
    """A version directory does not match its manifest (torn, truncated or damaged)."""


def version_dir(root: str | Path, version: int) -> Path:
    """`root/v{version:08d}`: where version `version` lives once complete."""
    return Path(root) / f"v{version:08d}"


def list_versions(root: str | Path) -> list[int]:
    """The complete versions under `root`, oldest first (temporary directories are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    versions = []
    for entry in root.iterdir():
        match = _VERSION_RE.fullmatch(entry.name)
        if match and (entry / MANIFEST).is_file():
            versions.append(int(match.group(1)))
    return sorted(versions)


def latest_version(root: str | Path) -> int | None:
    """The newest complete version under `root`, or None when there is none yet."""
    versions = list_versions(root)
    return versions[-1] if versions else None


@dataclass(slots=True)
class _Shards:
    """The shard being filled, and what the finished ones hold (for the manifest)."""

    tmp: Path
    max_bytes: int
    checksum: bool
    on_shard: ShardHook | None
    pending: dict[str, torch.Tensor] = field(default_factory=dict)
    pending_bytes: int = 0
    files: list[dict[str, Any]] = field(default_factory=list)
    tensors: list[dict[str, Any]] = field(default_factory=list)

    def add(self, name: str, t: torch.Tensor) -> None:
        if self.pending and self.pending_bytes + t.nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = t
        self.pending_bytes += t.nbytes
        shape, dtype = list(t.shape), _dtype_name(t.dtype)
        self.tensors.append(
            {"name": name, "shape": shape, "dtype": dtype, "nbytes": t.nbytes, "shard": len(self.files)}
        )

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        index = len(self.files)
        path = self.tmp / f"shard-{index:05d}.safetensors"
        save_file(self.pending, path, metadata={"format": "pt"})
        _fsync_file(path)
        entry: dict[str, Any] = {
            "file": path.name,
            "bytes": path.stat().st_size,
            "tensors": list(self.pending),
        }
        if self.checksum:
            entry["sha256"] = _sha256(path)
        self.files.append(entry)
        self.pending, self.pending_bytes = {}, 0  # the shard's tensors are dropped here
        if self.on_shard is not None:
            self.on_shard(index, path)


def write_weights(
    named_weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    root: str | Path,
    version: int,
    *,
    dtype: torch.dtype | None = None,
    shard_mb: float = DEFAULT_SHARD_MB,
    keep_last: int | None = None,
    checksum: bool = False,
    on_shard: ShardHook | None = None,
) -> Path:
    """Write `named_weights` (pairs or a mapping) as version `version` under `root`, atomically;
    return its directory.

    `dtype`: floating tensors are cast to it (default: kept). `shard_mb`: MiB per shard, the
    host memory the writer holds beyond one tensor. `keep_last`: afterwards delete all but the
    newest `keep_last` versions (keep at least 2 while engines may still be reading the previous
    one). `checksum`: record each shard's sha256 (read back once; `read_weights` verifies it).
    `on_shard(index, path)`: called after each shard is durable on disk (progress, tests).
    Writing a version that exists is an error: versions are written once. A `PartialUpdate`
    is recorded as partial, and read back as one.
    """
    _check_write_args(version, shard_mb, keep_last)
    root = Path(root)
    final = version_dir(root, version)
    if final.exists():
        latest = latest_version(root)
        raise ValueError(
            f"version={version}: {final} exists and versions are written once; write version "
            f"{(version if latest is None else latest) + 1} (latest_version(root) + 1) instead"
        )
    root.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(root)
    tmp = root / f"{_TMP_PREFIX}{final.name}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        shards = _Shards(tmp, max(1, int(shard_mb * 2**20)), checksum, on_shard)
        seen: set[str] = set()
        pairs = named_weights.items() if isinstance(named_weights, Mapping) else named_weights
        for name, t in pairs:
            if name in seen:
                raise ValueError(f"named_weights yielded {name!r} twice; each tensor must appear once")
            seen.add(name)
            shards.add(name, _owned_host_copy(t, dtype))
            del t  # the source may reuse it for the next tensor
        shards.flush()
        _write_manifest(tmp, version, shards, partial=isinstance(named_weights, PartialUpdate))
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last is not None:
        _prune(root, keep_last)
    return final


def _check_write_args(version: int, shard_mb: float, keep_last: int | None) -> None:
    problems = []
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        problems.append(f"version={version!r} must be an integer >= 0 (the trainer's engine.version)")
    if not shard_mb > 0:
        problems.append(f"shard_mb={shard_mb!r} must be > 0 MiB; e.g. 1024 (actor.weight_chunked_mem_mb)")
    if keep_last is not None and keep_last < 1:
        problems.append(f"keep_last={keep_last!r} must be >= 1 (or None to keep every version); e.g. 2")
    if problems:
        raise ValueError("write_weights: " + "; ".join(problems))


def _owned_host_copy(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`t` on the host in its own contiguous storage, never the caller's (which may be reused)."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t  # a DTensor: gathered
    target = dtype if dtype is not None and full.is_floating_point() else full.dtype
    out = full.detach().to("cpu", dtype=target).contiguous()
    if out.data_ptr() == full.data_ptr() or out.untyped_storage().nbytes() != out.nbytes:
        out = out.clone()
    return out


def _write_manifest(tmp: Path, version: int, shards: _Shards, *, partial: bool) -> None:
    manifest = {
        "format": FORMAT,
        "version": version,
        "partial": partial,
        "total_bytes": sum(t["nbytes"] for t in shards.tensors),
        "shards": shards.files,
        "tensors": shards.tensors,
    }
    path = tmp / MANIFEST
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    _fsync_file(path)


def _publish(tmp: Path, final: Path) -> None:
    """Make `tmp` durable, then rename it to `final` (a reader sees all of it or nothing)."""
    _fsync_dir(tmp)
    try:
        os.rename(tmp, final)
    except OSError as error:  # a concurrent writer published the same version first
        raise ValueError(
            f"version directory {final} appeared while this version was written; versions are written once, "
            "by one trainer: give each writer its own root or version"
        ) from error
    _fsync_dir(final.parent)


def _prune(root: Path, keep_last: int) -> None:
    for old in list_versions(root)[:-keep_last]:
        shutil.rmtree(version_dir(root, old), ignore_errors=True)


def _remove_abandoned(root: Path) -> None:
    """Delete temporary directories of writers on this host whose process has ended (killed)."""
    host = socket.gethostname()
    for entry in root.iterdir():
        match = _TMP_RE.fullmatch(entry.name)  # .tmp-v00000042-<host>-<pid>-<token>
        if match and match["host"] == host and not _alive(int(match["pid"])):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def read_weights(
    root: str | Path, version: int, *, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Version `version` under `root` as `(name, tensor)` pairs, one tensor at a time, in written order.

    The version is checked against its manifest first (every shard present with its recorded
    size and checksum, every tensor in its shard with its shape and dtype), so a torn or
    damaged version raises `IncompleteVersionError` here, before any tensor is handed out; a
    missing one raises `FileNotFoundError`. Each tensor is a fresh one on `device`. A version
    written from a `PartialUpdate` comes back as one (receivers keep the weights it lacks).
    """
    directory = version_dir(root, version)
    manifest = _read_manifest(directory, root, version)
    _verify(directory, manifest)
    tensors = _iter_tensors(directory, manifest, str(torch.device(device)))
    return PartialUpdate(tensors) if manifest.get("partial") else tensors


def _read_manifest(directory: Path, root: str | Path, version: int) -> dict[str, Any]:
    path = directory / MANIFEST
    if not directory.is_dir():
        available = list_versions(root)
        raise FileNotFoundError(
            f"weight version {version} does not exist under {root} (complete versions: {available[-5:] or 'none'}); "
            "read latest_version(root), or wait for the trainer to publish it"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise IncompleteVersionError(
            f"{path} is missing or unreadable ({error}); the version is incomplete: read another version "
            "(latest_version) or have the trainer write it again"
        ) from error
    if manifest.get("format") != FORMAT or manifest.get("version") != version:
        raise IncompleteVersionError(
            f"{path} is format {manifest.get('format')!r}, version {manifest.get('version')!r}; expected "
            f"{FORMAT!r}, version {version}: the directory holds something else"
        )
    return manifest


def _verify(directory: Path, manifest: dict[str, Any]) -> None:
    """Every shard as the manifest recorded it, and every tensor in its shard as described."""
    from safetensors import safe_open

    by_shard: dict[int, list[dict[str, Any]]] = {}
    for t in manifest["tensors"]:
        by_shard.setdefault(t["shard"], []).append(t)
    for index, shard in enumerate(manifest["shards"]):
        path = directory / shard["file"]
        size = path.stat().st_size if path.is_file() else None
        if size != shard["bytes"]:
            _torn(path, f"is {size} bytes, the manifest recorded {shard['bytes']}")
        if "sha256" in shard and _sha256(path) != shard["sha256"]:
            _torn(path, "does not match the sha256 the manifest recorded")
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            for t in by_shard.get(index, []):
                if t["name"] not in keys:
                    _torn(path, f"holds no tensor {t['name']!r}")
                sl = f.get_slice(t["name"])
                if list(sl.get_shape()) != t["shape"] or _st_dtype(sl.get_dtype()) != t["dtype"]:
                    _torn(
                        path,
                        f"holds {t['name']!r} as {sl.get_shape()} {sl.get_dtype()}, not {t['shape']} {t['dtype']}",
                    )


def _torn(path: Path, what: str) -> None:
    raise IncompleteVersionError(
        f"{path} {what}: the version is torn or damaged; read another version (latest_version) or have the "
        "trainer write it again"
    )


def _iter_tensors(
    directory: Path, manifest: dict[str, Any], device: str
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for shard in manifest["shards"]:
        with safe_open(str(directory / shard["file"]), framework="pt", device=device) as f:
            for name in shard["tensors"]:
                yield name, f.get_tensor(name)


_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}  # fmt: skip


def _st_dtype(name: str) -> str:
    """A safetensors header dtype as torch names it."""
    return _ST_DTYPES.get(name, name)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
