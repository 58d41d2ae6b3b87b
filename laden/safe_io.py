"""Writing into a run directory without following links, tearing files or hiding a full disk.

A run directory is a place other people and tools can write to, and a place a kill or a full
disk interrupts. Every file laden writes there goes through this module (imports nothing of
laden, so the foundation's `dump_config` may use it too):

- `atomic_write_text` / `atomic_write_bytes` replace a whole file: the text goes to a new
  temporary in the same directory (`O_CREAT | O_EXCL | O_NOFOLLOW`: never an existing file,
  never through a link), is fsync'd, renamed over the final name (a link at that name is
  replaced, its target untouched) and the directory fsync'd. A reader sees the old file or the
  new one; a crash at any point leaves at most a `.NAME.tmp-PID-XXXXXXXX` file, which
  `remove_leftover_temporaries` deletes. Cost: two fsyncs per file (~ms on a local disk); these
  files are written a few times per run.
- `AppendLines` (`metrics.jsonl`) appends each line with one `os.write` of the whole line and,
  when that fails or comes back short (a full disk), truncates the file back to its size before
  the line: a line is whole or absent. The lines are not fsync'd one by one (a power loss can
  still cut the last one; `read_jsonl` reports it and the run directory drops it on resume).
  The file is opened with `O_NOFOLLOW`, and refused when it has other hard links, because it is
  written in place.
- A full disk (ENOSPC, or EDQUOT: a quota) is `DiskFullError`, an `OSError` naming the file, the
  bytes the write needed and what to do, instead of a traceback from deep inside a write.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "AppendLines",
    "BadLine",
    "DiskFullError",
    "JsonlScan",
    "UnsafePathError",
    "append_line",
    "atomic_write_bytes",
    "atomic_write_text",
    "fsync_dir",
    "is_disk_full",
    "open_in_place",
    "read_jsonl",
    "remove_leftover_temporaries",
]

_TMP_RE = re.compile(r"\..+\.tmp-(?P<pid>\d+)-[0-9a-f]{8}")
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_HEAD_BYTES = 60
DEFAULT_FIX = "free space on that file system, then rerun the same command"


class DiskFullError(OSError):
    """A write found no space (or no quota) left; the message names the file, the bytes and the fix."""

    def __init__(self, path: str | os.PathLike[str], *, num_bytes: int | None, done: str, fix: str) -> None:
        need = f" ({_size(num_bytes)} needed)" if num_bytes else ""
        message = f"no space left on the device holding {os.fspath(path)}{need}; {done}. To go on: {fix}"
        super().__init__(errno.ENOSPC, message, os.fspath(path))

    def __str__(self) -> str:
        return str(self.strerror)


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} bytes"


class UnsafePathError(ValueError):
    """A file laden writes in place is a link, a hard link or not a regular file."""


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` says the disk (or a quota) is full: an `OSError` with ENOSPC/EDQUOT, or a library's
    error that only carries the OS's text (safetensors writes from Rust: "... (os error 28)")."""
    if isinstance(exc, OSError):
        return exc.errno in _DISK_FULL_ERRNOS
    text = str(exc)
    return (
        any(f"(os error {code})" in text for code in _DISK_FULL_ERRNOS) or "No space left on device" in text
    )


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or a new entry in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems cannot fsync a directory; the rename happened all the same
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


# ----------------------------------------------------------------- whole files
def atomic_write_text(path: str | os.PathLike[str], text: str, *, fix: str = DEFAULT_FIX) -> Path:
    """Replace `path` with `text` (UTF-8), atomically and without following a link; returns `path`.
    `fix`: what a `DiskFullError` tells the user to do."""
    return atomic_write_bytes(path, text.encode("utf-8"), fix=fix)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, fix: str = DEFAULT_FIX) -> Path:
    """Replace `path` with `data` (see the module docstring); the directory must exist."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        # 0o666 less the umask, as open() would create it (mkstemp's 0o600 would outlive the rename)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if is_disk_full(exc):
            raise DiskFullError(
                path, num_bytes=len(data), done=f"{path.name} was left as it was", fix=fix
            ) from exc
        raise
    fsync_dir(path.parent)
    return path


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:  # a regular file takes at least a byte unless the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]


def remove_leftover_temporaries(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete the `atomic_write_*` temporaries in `directory` (regular files only) of writers that were
    killed; call it only while holding the directory (its lock), when no other writer can be at work."""
    removed = []
    for entry in Path(directory).iterdir():
        if _TMP_RE.fullmatch(entry.name) and stat.S_ISREG(entry.lstat().st_mode):
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                removed.append(entry)
    return removed


# ---------------------------------------------------------------- appended lines
class AppendLines:
    """A file opened for appending whole lines (`metrics.jsonl`); see the module docstring.

    `fix`: what a `DiskFullError` tells the user to do. Use as a context manager, or `close()`.
    """

    def __init__(self, path: str | os.PathLike[str], *, fix: str = DEFAULT_FIX) -> None:
        self.path, self.fix = Path(path), fix
        self._fd: int | None = open_in_place(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def append_line(self, line: str) -> None:
        """Append `line` and a line end, whole or not at all (one line: it holds no line end)."""
        assert "\n" not in line, "one line at a time"
        assert self._fd is not None, f"{self.path} is closed"
        data = (line + "\n").encode("utf-8")
        size = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, data)  # one write for the whole line: no reader sees half of it
            if written != len(data):  # short: the disk filled up mid-line
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)  # the line is absent, not cut off
            if is_disk_full(exc):
                raise DiskFullError(
                    self.path, num_bytes=len(data), done="the line was not written (the file is as it was)",
                    fix=self.fix,
                ) from None  # fmt: skip
            raise OSError(exc.errno, f"{exc.strerror} (appending to it)", os.fspath(self.path)) from exc

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> AppendLines:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def append_line(path: str | os.PathLike[str], line: str, *, fix: str = DEFAULT_FIX) -> None:
    """Append one whole line to `path` (opened and closed for it; `AppendLines` keeps it open)."""
    with AppendLines(path, fix=fix) as out:
        out.append_line(line)


def open_in_place(path: Path, flags: int) -> int:
    """A descriptor of `path` for writing in place: never through a link (`O_NOFOLLOW`), and only a
    regular file with no other hard link (whose other names would change too)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP or path.is_symlink():
            raise UnsafePathError(
                f"{path} is a symbolic link (to {os.readlink(path)}); laden does not write through links in a "
                f"run directory. Remove the link (rm {path}), or set trial_name to a new name for a new run"
            ) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        what = (
            "is not a regular file" if not stat.S_ISREG(info.st_mode) else f"has {info.st_nlink} hard links"
        )
        raise UnsafePathError(
            f"{path} {what}; laden writes it in place and would change what its other names hold. Remove it "
            "(after copying what you need), or set trial_name to a new name for a new run"
        )
    return fd


# ------------------------------------------------------------------ reading lines
@dataclass(kw_only=True, frozen=True, slots=True)
class BadLine:
    """A line of a JSON-lines file that is not a JSON object."""

    number: int
    """1-based line number."""
    head: bytes
    """Its first bytes (at most 60)."""
    cut_off: bool
    """The file's last line, without a line end: a write cut short (a kill, a full disk)."""

    def describe(self, path: str | os.PathLike[str]) -> str:
        what = "is cut off (no line end: a write interrupted by a kill or a full disk)" if self.cut_off else (
            "is not a JSON object"
        )  # fmt: skip
        return f"line {self.number} of {os.fspath(path)} {what}: {self.head!r}"


@dataclass(kw_only=True, frozen=True, slots=True)
class JsonlScan:
    """What `read_jsonl` found: the good rows (with their text, to keep as written) and the bad lines."""

    lines: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    """(1-based line number, the line as written, its object) of every good line, in order."""
    bad: list[BadLine] = field(default_factory=list)
    clean: bool = True
    """Nothing to repair: no bad or blank line, and the file ends with a line end (or is empty)."""

    @property
    def rows(self) -> list[dict[str, Any]]:
        return [row for _, _, row in self.lines]


def read_jsonl(path: str | os.PathLike[str]) -> JsonlScan:
    """The JSON objects of a JSON-lines file, tolerating what a kill or a full disk leaves: a last line
    without its line end, a line that is not JSON (both listed in `bad`, never raised). No file: empty."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return JsonlScan()
    chunks = data.split(b"\n")
    terminated = chunks[-1] == b""
    if terminated:
        chunks.pop()
    lines: list[tuple[int, str, dict[str, Any]]] = []
    bad: list[BadLine] = []
    blank = 0
    for number, chunk in enumerate(chunks, start=1):
        text = chunk.decode("utf-8", errors="replace")
        if not text.strip():
            blank += 1
            continue
        try:
            row = json.loads(text)
        except ValueError:
            row = None
        if isinstance(row, dict):
            lines.append((number, text, row))
        else:
            cut = number == len(chunks) and not terminated
            bad.append(BadLine(number=number, head=chunk[:_HEAD_BYTES], cut_off=cut))
    return JsonlScan(lines=lines, bad=bad, clean=terminated and not bad and not blank)
