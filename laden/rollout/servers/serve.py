"""`laden serve`: the rollout servers of a config that run on this node, for trainers on other nodes.

A config for servers on nodes of their own lists them in `rollout.server_urls` (one per `d` of
`rollout.backend`), which is what `laden rl` attaches to. On each node those URLs name,
`laden serve --config rl.yaml` starts the servers they name there, on their ports, each on `t` of this
node's GPUs, with the flags `laden rl`'s own servers get (`VLLM_SERVER_DEV_MODE`, processed log-probs,
the seed) on `actor.path`, listening on `rollout.server_host` (0.0.0.0 for other nodes to reach them).
It says which it serves and serves until interrupted (Ctrl-C, SIGTERM), then ends them; a server that
exits meanwhile ends the others and the command, with its log's last lines. One config, unchanged, on
every node: the trainer's nodes run `laden rl` with it, the generation nodes `laden serve`.

The trainer hands these servers each weight version as a directory under `cluster.fileroot`, which they
read at the same path: the nodes must share that filesystem.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any

from laden.config import AllocationMode, LadenConfig
from laden.config.validate_servers import attached_server_urls, normalize_server_url
from laden.errors import RunFailedError
from laden.rollout.servers.process import log_tail

log = logging.getLogger(__name__)

POLL_S = 1.0
"""How often the servers are checked while they serve."""

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve(
    cfg: LadenConfig,
    *,
    announce: Callable[[list[str]], None],
    stop: threading.Event | None = None,
    names: Iterable[str] | None = None,
) -> None:
    """Start the servers of `rollout.server_urls` that name this node (`names`: its host names and
    addresses, default `node_names()`), call `announce` with their URLs, and serve until `stop` is set
    (default: until SIGTERM or Ctrl-C). `RunFailedError` when a server exits meanwhile."""
    from laden.rollout.backend import resolve_rollout
    from laden.rollout.servers import start_server_engine

    backend = resolve_rollout(cfg)
    mode = backend.mode
    if backend.in_process:
        raise ValueError(
            f"rollout.backend={cfg.rollout.backend!r} generates in the trainer's processes; laden serve starts "
            "servers: set rollout.backend: vllm:dN or sglang:dN, and rollout.server_urls to the N servers"
        )
    mine = servers_of_this_node(cfg, set(names) if names is not None else node_names())
    ports = [urllib.parse.urlsplit(u).port or 0 for u in mine]
    here = AllocationMode.parse(f"{mode.backend}:d{len(mine)}t{mode.tp}")
    engine = start_server_engine(here, model_dir=cfg.actor.path, cfg=cfg, first_device=0, ports=ports)
    try:
        announce(mine)
        _wait(engine.servers, stop)
    finally:
        asyncio.run(engine.close())


def servers_of_this_node(cfg: LadenConfig, names: set[str]) -> list[str]:
    """The URLs of `rollout.server_urls` (or `$AREAL_LLM_SERVER_ADDRS`) whose host is one of `names`;
    ValueError with the fix when there are none, or when loopback listening would hide them."""
    urls, where = attached_server_urls(cfg)
    if not urls:
        raise ValueError(
            "laden serve starts the servers rollout.server_urls lists on this node, and it lists none; set it "
            "to every server's address, e.g. rollout.server_urls=[http://gen0:8000,http://gen0:8001]"
        )
    mine = [u for u in map(normalize_server_url, urls) if urllib.parse.urlsplit(u).hostname in names]
    if not mine:
        raise ValueError(
            f"none of {where}={urls} names this node ({', '.join(sorted(names))}); run laden serve on the "
            "nodes they name, or write this node's name in them"
        )
    remote = [u for u in mine if urllib.parse.urlsplit(u).hostname not in LOOPBACK]
    if remote and cfg.rollout.server_host in LOOPBACK:
        raise ValueError(
            f"rollout.server_host={cfg.rollout.server_host!r}: servers listening on loopback cannot be reached at "
            f"{remote[0]} from other nodes; set rollout.server_host: 0.0.0.0 (or this node's address)"
        )
    return mine


def node_names() -> set[str]:
    """This node's host names and addresses, as a URL in `rollout.server_urls` may name it."""
    host = socket.gethostname()
    names = {host, host.split(".")[0], socket.getfqdn(), *LOOPBACK}
    with contextlib.suppress(OSError):  # a host name that does not resolve: its names still count
        names.update(socket.gethostbyname_ex(host)[2])
    return names


def _wait(servers: list[Any], stop: threading.Event | None) -> None:
    own = stop is None
    event = stop or threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: event.set()) if own else None
    try:
        while not event.wait(POLL_S):
            for server in servers:
                code = server.process.poll()
                if code is not None:
                    raise RunFailedError(
                        f"{server.process.name} server at {server.url} exited with code {code} (log "
                        f"{server.process.log_path}); the other servers were ended; last lines:\n"
                        f"{log_tail(server.process.log_path)}"
                    )
    finally:
        if own:
            signal.signal(signal.SIGTERM, previous)
