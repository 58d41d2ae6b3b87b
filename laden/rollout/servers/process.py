"""Starting, watching and ending a rollout server process (vLLM, SGLang).

laden talks to a generation server over HTTP and never imports it, so the server may live in
its own virtual environment: the python that runs it is chosen explicitly (an argument, then
`LADEN_VLLM_PYTHON` / `LADEN_SGLANG_PYTHON`, then this interpreter).

Design decisions and what they cost:

- The server runs in a process group of its own (`start_new_session=True`) and is ended as a
  group: SIGTERM, then SIGKILL to whatever of the group is left after `grace_s`. vLLM and SGLang
  start worker processes of their own; ending only the leader would leave them holding the GPU.
  The group is also ended at interpreter exit (`atexit`), so no server outlives the run; a run
  killed by SIGKILL cannot run atexit hooks, which is the one case that leaks a server.
- The server's stdout and stderr go to a log file, not a pipe: nothing has to drain a pipe
  while the server runs, and when start-up fails the error quotes the log's last lines.
- Readiness is a poll of a health URL with a deadline (start-up of a real server takes a
  minute or more); a process that exits first fails at once, with its log tail.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


class ServerNotInstalledError(RuntimeError):
    """The server's Python package cannot be imported by the python that would run it."""


class ServerStartError(RuntimeError):
    """A server process exited, or never became healthy, during start-up."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerKind:
    """What laden needs to know about one server program to start it."""

    name: str
    """Backend name as written in `rollout.backend`, e.g. `vllm`."""
    module: str
    """Top-level Python package the server needs, e.g. `vllm`."""
    install_hint: str
    """Command that installs it, e.g. `pip install vllm`."""
    python_env_var: str
    """Environment variable naming the python to run it with, e.g. `LADEN_VLLM_PYTHON`."""


def resolve_python(explicit: str | None, kind: ServerKind) -> str:
    """The python that runs the server: `explicit`, else `$<kind.python_env_var>`, else this one."""
    return explicit or os.environ.get(kind.python_env_var) or sys.executable


def check_installed(python: str, kind: ServerKind) -> None:
    """Raise `ServerNotInstalledError` unless `python` can import `kind.module`.

    Only looks the package up (`importlib.util.find_spec`), which takes a fraction of a second
    even for vLLM, whose import takes many.
    """
    probe = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({kind.module!r}) else 3)"
    try:
        result = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        reason = f"the python {python!r} does not exist"
    except OSError as err:
        reason = f"the python {python!r} cannot be run ({err})"
    else:
        if result.returncode == 0:
            return
        reason = f"the python {python!r} cannot import {kind.module!r}"
        if result.returncode != 3:
            reason += f" (probe exited {result.returncode}: {result.stderr.strip()[-300:]})"
    raise ServerNotInstalledError(
        f"rollout.backend={kind.name!r} needs the {kind.name} server, but {reason}; install it with "
        f"`{kind.install_hint}` into that python, or point {kind.python_env_var} at a python that has "
        f"it (a separate virtual environment is fine), or use the embedded engine instead: "
        f"`rollout.backend: native:d1`"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on now (the OS picks it).

    The port is released before the server binds it, so another process could take it in
    between; the server then fails to bind and start-up reports that from its log.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def log_tail(path: Path, num_lines: int = 40) -> str:
    """The last `num_lines` lines of the text file at `path` ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-num_lines:])


class ServerProcess:
    """One server process (and its children, as a process group) that laden started.

    Use `ServerProcess.start(...)`, then `wait_healthy(...)`; `close()` ends the group and is
    idempotent. The group is ended at interpreter exit too.
    """

    def __init__(self, popen: subprocess.Popen, *, name: str, log_path: Path, grace_s: float) -> None:
        self._popen = popen
        self.name = name
        """Short name used in messages, e.g. `vllm[0]`."""
        self.log_path = log_path
        """The file the server's stdout and stderr go to."""
        self.grace_s = grace_s
        """Seconds between SIGTERM and SIGKILL at `close()`."""
        self._closed = False
        atexit.register(self._kill_at_exit)

    @classmethod
    def start(
        cls,
        argv: Sequence[str],
        *,
        name: str,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        grace_s: float = 10.0,
    ) -> ServerProcess:
        """Start `argv` in a process group of its own, stdout and stderr appended to `log_path`.

        `env` adds to (and overrides) this process's environment.
        """
        log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, **(env or {})}
        with open(log_path, "ab") as log:
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                list(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
            )
        return cls(popen, name=name, log_path=log_path, grace_s=grace_s)

    @property
    def pid(self) -> int:
        """Process id of the server (also its process-group id)."""
        return self._popen.pid

    def poll(self) -> int | None:
        """The exit code if the leader has exited, else None."""
        return self._popen.poll()

    def wait_healthy(self, url: str, *, timeout_s: float, poll_interval_s: float = 0.5) -> None:
        """Poll `url` (GET) until it answers 200; raise `ServerStartError` with the log tail if the
        process exits first or `timeout_s` passes (the process group is ended then)."""
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.poll()
            if code is not None:
                self.close()
                raise ServerStartError(
                    f"{self.name} server exited with code {code} during start-up (log {self.log_path}); "
                    f"last lines:\n{log_tail(self.log_path)}"
                )
            if _answers_ok(url, timeout_s=min(5.0, max(0.1, deadline - time.monotonic()))):
                return
            if time.monotonic() >= deadline:
                self.close()
                raise ServerStartError(
                    f"{self.name} server did not answer {url} within {timeout_s:.0f} s (log {self.log_path}); "
                    f"raise the start-up timeout if the model is large; last lines:\n{log_tail(self.log_path)}"
                )
            time.sleep(poll_interval_s)

    def close(self) -> None:
        """End the process group: SIGTERM, then SIGKILL after `grace_s`; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._kill_at_exit)
        end_process_group(self._popen, grace_s=self.grace_s)

    def _kill_at_exit(self) -> None:
        if not self._closed:
            self._closed = True
            end_process_group(self._popen, grace_s=min(self.grace_s, 5.0))


def end_process_group(popen: subprocess.Popen, *, grace_s: float) -> None:
    """SIGTERM the process group led by `popen`, wait up to `grace_s` for every member to exit,
    then SIGKILL what is left and reap the leader."""
    pgid = popen.pid  # start_new_session=True: the leader's pid is the group id
    if not _signal_group(pgid, signal.SIGTERM):
        popen.wait()
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        popen.poll()  # reap the leader so that it does not count as a member
        if not _group_alive(pgid):
            break
        time.sleep(0.05)
    else:
        _signal_group(pgid, signal.SIGKILL)
    popen.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send `sig` to the group; False when no member is left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def _group_alive(pgid: int) -> bool:
    """Whether a member of the group still runs; exited members not yet reaped (zombies, e.g.
    workers orphaned by the leader) do not count. Reads /proc where there is one."""
    proc = Path("/proc")
    if not proc.is_dir():
        return _signal_group(pgid, 0)  # type: ignore[arg-type]  # signal 0 only checks existence
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except (OSError, IndexError):
            continue  # exited while scanning
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _answers_ok(url: str, *, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False
