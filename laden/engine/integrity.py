"""Checkpoint integrity: every file written durably with its checksum, and checked before it is trusted.

What trusted trainers and databases do, applied to the layout of `laden.engine.checkpoint`:

- Each file of a checkpoint is written once through `CheckpointFiles`, which hashes its bytes
  (sha256) as they go out and fsyncs it. `manifest.json` (each file's path relative to the
  checkpoint, `critic/...` included, its size and its sha256) is written last, every directory is
  fsynced, and only then does the rename publish the checkpoint: a published checkpoint is complete
  and durable, and any later change to a file shows.
- Safetensors shards are serialized here one tensor at a time (`safetensors_chunks`, the layout of
  safetensors' own writer, no copy of the shard) rather than by `safetensors.torch.save_file`, whose
  Rust writer can neither hash as it writes nor report a full disk as an `OSError`.
- `find_damage` names what is wrong with a checkpoint, file by file: every file of the manifest
  present, of its size and (unless `hashes=False`, the cheap check before pruning) of its sha256;
  then every JSON, YAML and safetensors header parses. A checkpoint written before manifests existed
  is checked by parsing alone (and its `rng_rank*.pt` by a `weights_only` load).
- A full disk (ENOSPC, EDQUOT) does not stop the writer at once: it stops writing and keeps counting
  the bytes it would have written (so every rank still joins a sharded engine's gathers), so that the
  error can say how much space the checkpoint needs.

Cost, measured on this machine (2 shared cores with SHA-NI, a busy host): sha256 hashes 1.4-2.2 s
per GiB on one core (blake2b 3.3-5.1, md5 3.1: sha256 is the fastest hashlib has here, and
`sha256sum` checks a file by hand). A 1 GiB tensor written through `CheckpointFiles` (hashed and
fsynced) took 1.7-1.8 s, against 0.5 s for `safetensors.torch.save_file` into the page cache (no
hash, no fsync): about 1.3 s more per GiB of checkpoint, most of it the hash (a hashing thread beside
the writes gained nothing on two cores). Checking the newest checkpoint before resume reads it once
more: 1.6-1.8 s per GiB per core, its files hashed in parallel threads (hashlib releases the GIL).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import struct
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from laden.errors import RunFailedError
from laden.safe_io import fsync_dir

MANIFEST = "manifest.json"
"""Each file of a checkpoint: `{"format": 1, "hash": "sha256", "files": {path: {"bytes": n, "sha256": hex}}}`."""
_CHUNK_BYTES = 64 * 2**20
_STEP_DIR = re.compile(r"step_\d+")
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
_RUN_FILES = ("config.yaml", "meta.json", "trainer.json", "rng_rank0.pt")
_ENGINE_FILES = ("optimizer_groups.json", "scheduler.json", "version.json")


class DamagedCheckpointError(ValueError):
    """A checkpoint file is missing, cut off, changed since it was written or unreadable; the message names
    the file, what is wrong and the fix."""


class CheckpointDiskFullError(RunFailedError):
    """The disk filled while a checkpoint was written; the message says how much space it needs."""


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


# ------------------------------------------------------------------------------------ writing


class CheckpointFiles:
    """The files of one checkpoint written under `root`, each hashed as its bytes go out and fsynced.

    After a full disk nothing more is written: `full` holds the error, `written_bytes` counts what had
    reached the disk and `total_bytes` everything, written or not.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.entries: dict[str, dict[str, Any]] = {}
        self.full: OSError | None = None
        self.written_bytes = 0
        self.total_bytes = 0

    def mkdir(self, path: Path) -> None:
        if self.full is None:
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                self._filled(exc)

    def write(self, path: Path, chunks: Iterable[Any]) -> None:
        """File `path` from `chunks` (bytes or buffers), fsynced; its size and sha256 go into the manifest."""
        size, digest = self._write(path, chunks)
        self.entries[self._key(path)] = {"bytes": size, "sha256": digest}  # after a full disk: counts

    def add(self, path: Path) -> None:
        """Record a file another rank wrote (read back to hash it)."""
        if self.full is None:
            self.entries[self._key(path)] = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}

    def rename(self, old: Path, new: Path) -> None:
        if self.full is None:
            os.rename(old, new)
        self.entries[self._key(new)] = self.entries.pop(self._key(old))

    def write_manifest(self) -> None:
        """`manifest.json` (last: it lists every other file), then every directory under `root` fsynced."""
        manifest = {"format": 1, "hash": "sha256", "files": self.entries}
        self._write(self.root / MANIFEST, [(json.dumps(manifest, indent=1) + "\n").encode()])
        if self.full is None:
            for directory in [self.root, *(p for p in self.root.rglob("*") if p.is_dir())]:
                fsync_dir(directory)

    def _write(self, path: Path, chunks: Iterable[Any]) -> tuple[int, str]:
        digest = hashlib.sha256()
        size = 0
        out = None
        if self.full is None:
            try:
                out = open(path, "wb", buffering=0)  # noqa: SIM115 - closed below, early on a full disk
            except OSError as exc:
                self._filled(exc)
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                if out is not None:
                    try:
                        _write_all(out, view)
                    except OSError as exc:
                        self._filled(exc, out)
                        out = None
                    else:
                        digest.update(view)
                        self.written_bytes += view.nbytes
                size += view.nbytes
            if out is not None:
                try:
                    os.fsync(out.fileno())
                except OSError as exc:
                    self._filled(exc, out)
                    out = None
        finally:
            if out is not None:
                out.close()
        self.total_bytes += size
        return size, digest.hexdigest()

    def _filled(self, exc: OSError, out: Any = None) -> None:
        if out is not None:
            out.close()
        if not is_disk_full(exc):
            raise exc
        self.full = exc

    def _key(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()


def _write_all(out: Any, view: memoryview) -> None:
    """All of `view` into the unbuffered file `out` (a raw write may take only part of it)."""
    while view:
        view = view[out.write(view) :]


def safetensors_chunks(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> Iterator[bytes | memoryview]:
    """The bytes of a safetensors file of `tensors` (contiguous host tensors, a little-endian host) as
    safetensors lays them out: 8 bytes of header length, the JSON header padded to 8 bytes, then the
    tensors by decreasing element size and name, each as a view of its own memory."""
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        end = offset + t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    yield struct.pack("<Q", len(text)) + text
    for name in order:
        raw = tensors[name].detach().reshape(-1).view(torch.uint8).numpy()  # [bytes], no copy
        for start in range(0, raw.size, _CHUNK_BYTES):
            yield raw[start : start + _CHUNK_BYTES].data


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------ checking


@dataclass(frozen=True, slots=True)
class Damage:
    """What is wrong with one file of a checkpoint."""

    file: Path
    problem: str
    """A predicate: "is missing", "is cut off at byte 123 (it held 456 bytes when written)"."""

    def __str__(self) -> str:
        return f"{shown(self.file)} {self.problem}"


def has_checksums(path: Path) -> bool:
    return (path / MANIFEST).exists()


def is_old_layout(path: Path) -> bool:
    """Checkpoint format 1 (a pickled engine state): `trainer.json` without `meta.json`, manifest or safetensors."""
    return (
        (path / "trainer.json").exists()
        and not (path / "meta.json").exists()
        and not has_checksums(path)
        and not any(path.glob("*.safetensors*"))
    )


def find_damage(path: Path, *, hashes: bool = True) -> list[Damage]:
    """What is wrong with checkpoint `path`, file by file (empty: intact; see the module docstring)."""
    if has_checksums(path):
        try:
            entries = _manifest_entries(path)
        except _Bad as exc:
            return [Damage(path / MANIFEST, str(exc))]
        found = _against_manifest(path, entries, hashes=hashes)
        files = [path / rel for rel in entries]
    elif is_old_layout(path):
        return []  # not damaged: `read_meta` says format 1, and the resume refuses it
    else:
        found = [Damage(path / rel, "is missing") for rel in _required(path) if not (path / rel).exists()]
        files = sorted(p for p in path.rglob("*") if p.is_file())
    if found:
        return found
    deep = not has_checksums(path)
    return [Damage(f, problem) for f in files if (problem := _parse_problem(f, deep=deep)) is not None]


class _Bad(Exception):
    """What is wrong with a file, as a predicate ("is cut off at byte 123")."""


def _manifest_entries(path: Path) -> dict[str, dict[str, Any]]:
    manifest = _parse_json(path / MANIFEST)
    entries = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(entries, dict):
        raise _Bad("lists no files")
    for rel, entry in entries.items():
        if rel.startswith("/") or ".." in Path(rel).parts or not isinstance(entry, dict):
            raise _Bad(f"has a damaged entry {rel!r}")
    return entries


def _against_manifest(path: Path, entries: dict[str, dict[str, Any]], *, hashes: bool) -> list[Damage]:
    found = []
    present = []
    for rel, entry in entries.items():
        file = path / rel
        if not file.is_file():
            found.append(Damage(file, "is missing"))
            continue
        size, want = file.stat().st_size, int(entry["bytes"])
        if size == 0 and want > 0:
            found.append(Damage(file, f"is empty (it held {want} bytes when written)"))
        elif size < want:
            found.append(Damage(file, f"is cut off at byte {size} (it held {want} bytes when written)"))
        elif size > want:
            found.append(Damage(file, f"holds {size} bytes where {want} were written"))
        else:
            present.append((file, str(entry["sha256"])))
    if hashes and present:
        with ThreadPoolExecutor(max_workers=min(len(present), os.cpu_count() or 1, 8)) as pool:
            actual = list(pool.map(sha256_of, [file for file, _ in present]))
        for (file, want_hash), got in zip(present, actual):
            if got != want_hash:
                found.append(Damage(file, (
                    f"does not match its checksum: its sha256 is {got[:16]}... where {want_hash[:16]}... was "
                    f"written (same size, {file.stat().st_size} bytes: its contents changed after it was saved)"
                )))  # fmt: skip
    return found


def _required(path: Path) -> list[str]:
    """The files a checkpoint of format 2 holds (at least), relative to it."""
    needed = list(_RUN_FILES)
    for prefix in ["", *sorted(f"{p.name}/" for p in path.iterdir() if p.is_dir())]:
        needed += [prefix + name for name in _ENGINE_FILES]
        for stem in ("model", "optimizer"):
            index = f"{prefix}{stem}.safetensors.index.json"
            needed.append(index if (path / index).exists() else f"{prefix}{stem}.safetensors")
    return needed


def _parse_problem(file: Path, *, deep: bool) -> str | None:
    """What keeps `file` from being read, judged by its kind (None: it reads)."""
    try:
        if file.name.endswith(".json"):
            _check_json(file)
        elif file.name == "config.yaml":
            _parse_config(file)
        elif file.name.endswith(".safetensors"):
            return _safetensors_problem(file)
        elif deep and file.name.startswith("rng_rank") and file.name.endswith(".pt"):
            try:
                torch.load(file, weights_only=True)
            except Exception as exc:  # whatever a damaged file makes the reader raise
                raise _Bad(f"cannot be read ({type(exc).__name__}: {_first_line(exc)})") from None
    except _Bad as exc:
        return str(exc)
    return None


def _check_json(file: Path) -> None:
    value = _parse_json(file)
    if file.name == "trainer.json" and not (isinstance(value, dict) and isinstance(value.get("step"), int)):
        raise _Bad("holds no step number")
    if file.name.endswith(".index.json"):
        shards = value.get("weight_map", {}).values() if isinstance(value, dict) else []
        missing = sorted({f for f in shards if not (file.parent / f).exists()})
        if missing:
            raise _Bad(f"names {', '.join(missing)}, which is missing")


def _parse_json(file: Path) -> Any:
    data = file.read_bytes()
    if not data:
        raise _Bad("is empty")
    try:
        return json.loads(data)
    except UnicodeDecodeError:
        raise _Bad("is not JSON text") from None
    except json.JSONDecodeError as exc:
        if exc.pos >= len(data.rstrip()) or exc.msg.startswith("Unterminated string"):
            raise _Bad(f"is cut off at byte {len(data)}") from None
        raise _Bad(f"is not valid JSON ({exc.msg} at byte {exc.pos})") from None


def _parse_config(file: Path) -> dict[str, Any]:
    try:
        text = file.read_text()
        value = yaml.safe_load(text)
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise _Bad(f"is not a valid YAML config ({getattr(exc, 'problem', None) or exc}{at})") from None
    if text and not text.endswith("\n"):  # laden ends it with a newline: a cut inside a line may still parse
        raise _Bad(f"is cut off at byte {len(text.encode())}")
    if not isinstance(value, dict):
        raise _Bad("holds no config (a YAML mapping of fields)")
    return value


def _safetensors_problem(file: Path) -> str | None:
    size = file.stat().st_size
    if size == 0:
        return "is empty"
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return (
                f"is cut off at byte {size} (a safetensors file starts with the 8-byte length of its header)"
            )
        length = struct.unpack("<Q", head)[0]
        if length > min(size, 100 * 2**20):
            return f"is cut off or has a damaged header (it gives its header {length} bytes, the file {size})"
        try:
            header = json.loads(f.read(length))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "has a damaged header (not the JSON table of its tensors)"
    if 8 + length + end != size:
        return f"is cut off at byte {size} (its header promises {8 + length + end} bytes)" if size < 8 + length + end \
            else f"holds {size - 8 - length - end} bytes more than its header promises"  # fmt: skip
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt"):
            pass
    except Exception as exc:  # the library's own checks of the header (offsets, dtypes)
        return f"has a damaged header ({_first_line(exc)})"
    return None


# ------------------------------------------------------------------------------------ reading


def read_json(file: Path) -> Any:
    """A checkpoint's JSON file; a `DamagedCheckpointError` naming it and the fix when it cannot be read."""
    with reading(file):
        return _parse_json(file)


def read_config(file: Path) -> dict[str, Any]:
    """The run config a checkpoint stores (`config.yaml`); a `DamagedCheckpointError` when it cannot be read."""
    with reading(file):
        return _parse_config(file)


@contextlib.contextmanager
def reading(file: Path) -> Iterator[None]:
    """Turn an error reading checkpoint file `file` (JSON, YAML, safetensors, `torch.load`, I/O) into a
    `DamagedCheckpointError` naming it and the fix."""
    try:
        yield
    except DamagedCheckpointError:
        raise
    except _Bad as exc:
        raise _damaged(file, str(exc)) from None
    except FileNotFoundError:
        raise _damaged(file, "is missing") from None
    except Exception as exc:  # whatever a damaged file makes the reader raise
        raise _damaged(file, f"cannot be read ({type(exc).__name__}: {_first_line(exc)})") from exc


def _damaged(file: Path, problem: str) -> DamagedCheckpointError:
    checkpoint = next((p for p in file.parents if _STEP_DIR.fullmatch(p.name)), file.parent)
    return DamagedCheckpointError(
        f"{shown(file)} {problem}; delete {checkpoint} to resume from the checkpoint before it"
    )


def shown(file: Path) -> str:
    """`file` as found from its run directory (`checkpoints/step_8/model.safetensors`), else whole."""
    for parent in file.parents:
        if _STEP_DIR.fullmatch(parent.name):
            return file.relative_to(parent.parent.parent).as_posix()
    return str(file)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]
