"""Starting the data-parallel servers of one rollout backend, or attaching to running ones.

One server per data-parallel rank, each on its own free port and, when there is more than one,
on its own `tp` GPUs (`CUDA_VISIBLE_DEVICES` slices of the visible devices). All are started
before any is waited for, so their model loads overlap.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from laden.rollout.servers.engine import ServerHandle
from laden.rollout.servers.process import (
    ServerKind,
    ServerProcess,
    ServerStartError,
    check_installed,
    free_port,
    resolve_python,
)

Command = Callable[[str, int], tuple[list[str], dict[str, str]]]
"""(python, port) -> (argv, extra environment) of one server."""


def option_flags(cfg: Any, names: Sequence[str], *, negatable: Sequence[str] = ()) -> list[str]:
    """The command-line flags of the settings `names` of `cfg`, each `--<name with dashes>`: None is left out
    (the server's default), True is the bare flag, False is `--no-<name>` for those in `negatable` (flags with a
    `--no-` form, whose default may be on) and left out for the rest, any other value follows its flag."""
    argv: list[str] = []
    for name in names:
        value = getattr(cfg, name)
        flag = "--" + name.replace("_", "-")
        if value is None or (value is False and name not in negatable):
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    """How to start the servers of one backend."""

    kind: ServerKind
    """Which server program (its package, install command, python variable)."""
    command: Command
    """(python, port) -> (argv, extra environment) of one server."""
    python: str | None = None
    """Python to run the server with; None = `$<kind.python_env_var>`, else this interpreter."""
    host: str = "127.0.0.1"
    """Address the servers bind."""
    health_path: str = "/health"
    """Path that answers 200 once a server can generate."""
    log_dir: str | None = None
    """Directory of the logs `<name>-<rank>.log`; None = a new temporary directory."""
    startup_timeout_s: float = 900.0
    """Deadline for all servers to become healthy."""
    grace_s: float = 10.0
    """Seconds between SIGTERM and SIGKILL when a server is ended."""
    first_device: int = 0
    """Visible GPUs left before the servers' own (the trainer's, beside them)."""
    ports: tuple[int, ...] = ()
    """Port of each server, in order; empty = a free port each."""


T = TypeVar("T")


def built_or_closed(servers: list[ServerHandle], build: Callable[[], T]) -> T:
    """`build()`, or, if it fails, the servers this run started are ended before the error propagates."""
    try:
        return build()
    except BaseException:
        for server in servers:
            if server.process is not None:
                server.process.close()
        raise


def launch_and_build(
    kind: ServerKind,
    cfg: Any,
    *,
    health_path: str,
    command: Callable[[str, int], tuple[list[str], dict[str, str]]],
    dp: int,
    tp: int,
    build: Callable[[list[ServerHandle]], T],
) -> T:
    """Start `dp` servers from a server config (`python`, `host`, `log_dir`, `startup_timeout_s`,
    `first_device`, `ports`), wait until every one is healthy, and `build` the engine on them (the
    servers end if that fails)."""
    spec = LaunchSpec(
        kind=kind, python=cfg.python, host=cfg.host, health_path=health_path, log_dir=cfg.log_dir,
        startup_timeout_s=cfg.startup_timeout_s, command=command, first_device=cfg.first_device,
        ports=tuple(cfg.ports),
    )  # fmt: skip
    servers = launch_servers(spec, dp=dp, tp=tp)
    return built_or_closed(servers, lambda: build(servers))


def launch_servers(spec: LaunchSpec, *, dp: int, tp: int) -> list[ServerHandle]:
    """Start `dp` servers and wait until every one answers its health path.

    Raise `ServerNotInstalledError` when the python cannot import the server, `ServerStartError`
    (with the log tail) when one exits or stays unhealthy; every started server is ended then.
    """
    if spec.ports and len(spec.ports) != dp:
        raise ValueError(
            f"{dp} {spec.kind.name} server(s) but {len(spec.ports)} port(s) {spec.ports}; give one each"
        )
    python = resolve_python(spec.python, spec.kind)
    check_installed(python, spec.kind)
    devices = device_groups(dp, tp, backend=spec.kind.name, first=spec.first_device)
    log_dir = (
        Path(spec.log_dir) if spec.log_dir else Path(tempfile.mkdtemp(prefix=f"laden-{spec.kind.name}-"))
    )
    started: list[tuple[ServerProcess, str]] = []
    try:
        for rank in range(dp):
            port = spec.ports[rank] if spec.ports else free_port(spec.host)
            argv, env = spec.command(python, port)
            if devices:
                env = {"CUDA_VISIBLE_DEVICES": ",".join(devices[rank]), **env}
            name = f"{spec.kind.name}[{rank}]"
            log_path = log_dir / f"{spec.kind.name}-{rank}.log"
            process = ServerProcess.start(argv, name=name, log_path=log_path, env=env, grace_s=spec.grace_s)
            started.append((process, base_url(spec.host, port)))
        deadline = time.monotonic() + spec.startup_timeout_s
        for process, url in started:
            process.wait_healthy(url + spec.health_path, timeout_s=max(1.0, deadline - time.monotonic()))
    except BaseException:
        for process, _ in started:
            process.close()
        raise
    return [ServerHandle(url=url, process=process) for process, url in started]


def attach_servers(
    urls: Sequence[str], *, health_path: str, timeout_s: float = 30.0, wait_s: float = 0.0
) -> list[ServerHandle]:
    """Handles of servers already running at `urls` (no process is started); each must answer `health_path`
    (each request within `timeout_s`), tried again every second for up to `wait_s` seconds in all (servers
    that are still loading their model)."""
    from laden.rollout.servers.http import ServerRequestError, request_json

    if not urls:
        raise ValueError("attach needs at least one server URL, e.g. 'http://127.0.0.1:8000'")
    deadline = time.monotonic() + wait_s
    handles = []
    for url in urls:
        url = url.rstrip("/")
        while True:
            try:
                request_json("GET", url + health_path, timeout_s=timeout_s)
                break
            except ServerRequestError as err:
                if time.monotonic() < deadline:
                    time.sleep(1.0)  # polling a server that may still be loading its model
                    continue
                waited = f" within {wait_s:.0f} s (rollout.setup_timeout)" if wait_s else ""
                raise ServerStartError(
                    f"no server answers at {url}{waited} ({err}); start it there first (a server on another node "
                    "must listen on an address this node reaches, e.g. --host 0.0.0.0), check "
                    "rollout.server_urls, or leave it empty for laden to start the servers"
                ) from None
        handles.append(ServerHandle(url=url))
    return handles


def device_groups(dp: int, tp: int, *, backend: str, first: int = 0) -> list[list[str]]:
    """`CUDA_VISIBLE_DEVICES` of each of `dp` servers of `tp` devices, after the `first` visible ones (the
    trainer's); [] when dp == 1 and first == 0 (the server sees what this process sees)."""
    if dp == 1 and first == 0:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = (
        [d.strip() for d in visible.split(",") if d.strip()]
        if visible
        else [str(i) for i in range(first + dp * tp)]
    )
    if len(devices) < first + dp * tp:
        beside = f" beside the {first} of the trainer processes on this node" if first else ""
        raise ValueError(
            f"rollout.backend={backend}:d{dp}t{tp} needs {dp * tp} GPUs{beside} but CUDA_VISIBLE_DEVICES="
            f"{visible!r} lists {len(devices)}; lower d or t, make more GPUs visible, or start the servers "
            "elsewhere and attach to them with rollout.server_urls"
        )
    return [devices[first + r * tp : first + (r + 1) * tp] for r in range(dp)]


def base_url(host: str, port: int) -> str:
    """`http://host:port`, connecting to loopback when the server binds every address."""
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"
