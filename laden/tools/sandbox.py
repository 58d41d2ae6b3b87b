"""Python code from a model, run in a sandboxed subprocess (tool-integrated reasoning).

`run_python(code)` runs `code` in a fresh interpreter and returns what it printed. The child:

- runs in an empty temporary directory (its cwd, removed afterwards) with an empty environment and
  `python -I -B` (no PYTHON* variables, no user site, no bytecode written);
- has no network: in a network namespace of its own (`unshare --user --net`, where unprivileged user
  namespaces are allowed: only a loopback interface, down) and, in every case, an audit hook that refuses
  to create sockets;
- cannot write outside its directory: the audit hook refuses opening a file for writing, and removing,
  renaming, linking or changing a path, anywhere but under the cwd; it also refuses starting processes
  (`subprocess`, `os.system`, `exec*`, `fork`), signalling processes, and, through `ctypes`, loading a
  native library, looking up a symbol or calling a foreign function, each of which could step around the
  hook (importing `ctypes`, as numpy and sympy do, is allowed);
- is bounded: `memory_mb` of address space (`RLIMIT_AS`: an allocation beyond it raises `MemoryError`),
  CPU seconds (`RLIMIT_CPU`), no core files, `max_file_bytes` per file written (`RLIMIT_FSIZE`, which also
  bounds its output: a write past it fails with `OSError: File too large`), and a wall-clock `timeout` after which its whole process group is killed;
- reads its code from stdin (so `input()` gets end-of-file), and its stdout and stderr go to files outside
  its directory, of which the first `max_output_chars` characters each come back.

The audit hook is Python-level: it stops what Python code can reach through the standard library and
`ctypes`, not a C extension that makes system calls of its own; the namespace is the kernel-level barrier
for the network. Run untrusted code of real consequence in a container or VM as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_MB = 1024
DEFAULT_MAX_OUTPUT_CHARS = 2048
DEFAULT_MAX_FILE_BYTES = 1 << 20

_BOOTSTRAP = r"""
import os, sys
_cwd = os.path.realpath(os.getcwd())
_refused = frozenset({
    "socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyaddr", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn",
    "os.spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg", "pty.spawn", "ctypes.dlsym",
    "ctypes.cdata", "ctypes.call_function", "os.startfile", "webbrowser.open", "sys.remote_exec",
})
_paths = {  # the event's arguments that are paths written or removed (a symlink's target is not)
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.link": (0, 1),
    "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
    "shutil.rmtree": (0,), "os.chflags": (0,), "os.lchmod": (0,), "os.lchown": (0,), "os.setxattr": (0,),
    "os.removexattr": (0,), "shutil.copyfile": (1,), "shutil.copytree": (1,), "shutil.move": (0, 1),
}
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def _inside(path):
    if isinstance(path, int):
        return True  # an open file descriptor: its path was checked when it was opened
    full = os.path.realpath(os.path.join(_cwd, os.fsdecode(path)))
    return full == _cwd or full.startswith(_cwd + os.sep)

def _hook(event, args):
    if event in _refused:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "ctypes.dlopen" and args[0] is not None:  # None: ctypes' own handle on the process, at import
        raise PermissionError(f"sandbox: loading the native library {args[0]!r} is not allowed")
    if event == "open":
        path, mode, flags = args
        writes = any(c in (mode or "") for c in "wax+") or bool((flags or 0) & _WRITE)
        if writes and path is not None and not _inside(path):
            raise PermissionError(f"sandbox: writing outside the working directory is not allowed: {path!r}")
    elif event in _paths:
        for i in _paths[event]:
            if args[i] is not None and not _inside(args[i]):
                raise PermissionError(f"sandbox: {event} outside the working directory is not allowed: {args[i]!r}")

_code = sys.stdin.read()
sys.stdin.close()
sys.stdin = open(os.devnull)  # input() gets end-of-file
sys.addaudithook(_hook)
del _hook
_globals = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(compile(_code, "<code>", "exec"), _globals)
except SystemExit:
    raise
except BaseException as _err:
    import traceback
    _tb = _err.__traceback__.tb_next if _err.__traceback__ is not None else None
    sys.stdout.flush()
    traceback.print_exception(type(_err), _err, _tb)
    sys.exit(1)
"""


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """What one run printed and how it ended."""

    stdout: str
    stderr: str
    returncode: int | None
    """The exit status (None when timed out); negative: killed by that signal."""
    timed_out: bool
    truncated: bool
    """Whether stdout or stderr was longer than `max_output_chars` and was cut. Output beyond `max_file_bytes`
    fails in the child (`OSError: File too large`, as a file written past it does)."""
    network_namespace: bool
    """Whether the child ran in a network namespace of its own (else the audit hook alone refused sockets)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def text(self) -> str:
        """The result as a tool turn shows it: stdout, then stderr, then how the run ended if not normally."""
        parts = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        if self.stderr.strip():
            parts.append(self.stderr.rstrip("\n"))
        if self.timed_out:
            parts.append("[timed out: the code ran past its time limit and was stopped]")
        elif self.returncode is not None and self.returncode < 0:
            parts.append(f"[killed by signal {-self.returncode}]")
        if self.truncated:
            parts.append("[output truncated]")
        return "\n".join(parts) if parts else "[no output]"


@functools.cache
def network_namespace_available() -> bool:
    """Whether `unshare --user --net` can start a process here (unprivileged user namespaces allowed)."""
    unshare = shutil.which("unshare")
    if unshare is None or not sys.platform.startswith("linux"):
        return False
    try:
        done = subprocess.run([unshare, "--user", "--map-root-user", "--net", "true"], capture_output=True,
                              timeout=30, env={}, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def run_python(
    code: str, *, timeout: float = DEFAULT_TIMEOUT_S, memory_mb: int = DEFAULT_MEMORY_MB,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    network_namespace: bool | None = None, python: str = sys.executable,
) -> SandboxResult:  # fmt: skip
    """Run `code` in a sandboxed Python subprocess (module docstring) and return what it printed.

    `network_namespace`: None uses one where available; True requires one (`RuntimeError` where it is not);
    False relies on the audit hook alone. Blocks until the child ends or `timeout` seconds pass."""
    if timeout <= 0 or memory_mb <= 0 or max_output_chars <= 0 or max_file_bytes <= 0:
        raise ValueError(
            f"run_python: timeout={timeout}, memory_mb={memory_mb}, max_output_chars={max_output_chars} and "
            f"max_file_bytes={max_file_bytes} must all be positive"
        )
    use_ns = network_namespace_available() if network_namespace is None else network_namespace
    if use_ns and not network_namespace_available():
        raise RuntimeError("run_python(network_namespace=True): `unshare --user --net` is not available here "
                           "(no unshare, or unprivileged user namespaces are disabled); pass None or False")  # fmt: skip
    command = [python, "-I", "-B", "-c", _BOOTSTRAP]
    if use_ns:
        command = [shutil.which("unshare") or "unshare", "--user", "--map-root-user", "--net", *command]
    limits = _Limits(memory_mb << 20, int(timeout) + 2, max_file_bytes)
    with tempfile.TemporaryDirectory(prefix="laden-sandbox-") as root:
        work = Path(root, "work")
        work.mkdir()
        out_path, err_path = Path(root, "stdout"), Path(root, "stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=work, env={},
                                    start_new_session=True, preexec_fn=limits.apply)  # fmt: skip
            timed_out = False
            try:
                proc.communicate(code.encode(), timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid)
                proc.wait()
        stdout, cut_out = _read_capped(out_path, max_output_chars)
        stderr, cut_err = _read_capped(err_path, max_output_chars)
    return SandboxResult(
        stdout=stdout, stderr=stderr, returncode=None if timed_out else proc.returncode, timed_out=timed_out,
        truncated=cut_out or cut_err, network_namespace=use_ns,
    )  # fmt: skip


async def arun_python(code: str, **kwargs) -> SandboxResult:
    """`run_python` in a worker thread, for agents on an event loop (same arguments)."""
    return await asyncio.to_thread(run_python, code, **kwargs)


@dataclass(frozen=True, slots=True)
class _Limits:
    address_space: int
    cpu_seconds: int
    file_bytes: int

    def apply(self) -> None:
        """In the child before exec: the resource limits (module docstring)."""
        resource.setrlimit(resource.RLIMIT_AS, (self.address_space, self.address_space))
        resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_seconds, self.cpu_seconds))
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.file_bytes, self.file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pid, signal.SIGKILL)


def _read_capped(path: Path, max_chars: int) -> tuple[str, bool]:
    """The first `max_chars` characters of the file (at most 4 bytes a character are read), and whether there
    was more."""
    with open(path, "rb") as f:
        data = f.read(4 * max_chars + 1)
    text = data.decode("utf-8", errors="replace")
    cut = len(text) > max_chars or len(data) > 4 * max_chars
    return text[:max_chars], cut
