"""`laden serve`: the rollout servers of a config, started on this node for trainers on other nodes.

On a node given to generation, `laden serve --config rl.yaml --port 8000` starts the `d` servers of
`rollout.backend` (each on `t` of this node's GPUs, on ports 8000, 8001, ...) on `actor.path`, with the
flags `laden rl`'s own servers get (`VLLM_SERVER_DEV_MODE`, processed log-probs, the seed), listening on
`rollout.server_host` (0.0.0.0 for other nodes to reach them), prints the `rollout.server_urls` the
trainer's config takes, and serves until it is interrupted (Ctrl-C, SIGTERM); then it ends them. A
server that exits meanwhile ends the others and the command, with its log's last lines.

The trainer hands these servers each weight version as a directory under `cluster.fileroot`, which they
read at the same path: this node and the trainer's must share that filesystem. `rollout.server_urls` and
`$AREAL_LLM_SERVER_ADDRS` in the config are left aside here: they name where these servers will be.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

from laden.config import AllocationMode, LadenConfig
from laden.errors import RunFailedError
from laden.rollout.servers.process import log_tail

log = logging.getLogger(__name__)

POLL_S = 1.0
"""How often the servers are checked while they serve."""


def serve(
    cfg: LadenConfig,
    *,
    port: int | None,
    announce: Callable[[list[str]], None],
    stop: threading.Event | None = None,
) -> None:
    """Start the servers of `cfg.rollout.backend` (ports `port`, `port + 1`, ...; None = free ports), call
    `announce` with the URLs other nodes reach them at, and serve until `stop` is set (default: until
    SIGTERM or Ctrl-C). `RunFailedError` when a server exits meanwhile."""
    from laden.rollout.servers import SERVER_BACKENDS, start_server_engine

    mode = AllocationMode.parse(cfg.rollout.backend)
    if mode.backend not in SERVER_BACKENDS:
        raise ValueError(
            f"rollout.backend={cfg.rollout.backend!r} generates in the trainer's processes; laden serve starts "
            f"servers: set rollout.backend: vllm:dN or sglang:dN (N servers)"
        )
    engine = start_server_engine(mode, model_dir=cfg.actor.path, cfg=cfg, first_device=0, first_port=port)
    try:
        announce(reachable_urls(engine.urls, cfg.rollout.server_host))
        _wait(engine.servers, stop)
    finally:
        asyncio.run(engine.close())


def reachable_urls(urls: list[str], host: str) -> list[str]:
    """The servers' URLs as another node writes them: this node's name where they listen on every address."""
    if host not in ("0.0.0.0", "", "::"):
        return urls
    name = socket.getfqdn()
    return [u.replace("127.0.0.1", name, 1) for u in urls]


def _wait(servers: list[Any], stop: threading.Event | None) -> None:
    own = stop is None
    stop = stop or threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set()) if own else None
    try:
        while not stop.wait(POLL_S):
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
