"""Rollout servers started elsewhere (`rollout.server_urls`) and where laden's own listen (`rollout.server_host`).

A server address is written as a URL (`http://10.0.0.5:8000`) or as AReaL's `host:port` (`10.0.0.5:8000`,
what AReaL's launchers put in `AREAL_LLM_SERVER_ADDRS`); both mean `http://host:port`. The environment
variable is AReaL 1.0.4's way to hand a trainer its servers (its config has no field for them), so a run
whose `rollout.server_urls` is empty attaches to the servers it lists, as an AReaL trainer would. The
validator reads it for that reason only: the servers it names take none of this cluster's GPUs.
"""

from __future__ import annotations

import os
import urllib.parse
import warnings
from collections.abc import Mapping

from laden.config.schema import LadenConfig
from laden.config.validate_alloc import SERVER_ROLLOUT_BACKENDS, parse_or_none

__all__ = [
    "AREAL_ADDRS_ENV",
    "attached_server_urls",
    "normalize_server_url",
    "server_errors",
    "server_option_errors",
]

AREAL_ADDRS_ENV = "AREAL_LLM_SERVER_ADDRS"
"""AReaL's environment variable of the rollout servers' comma-separated `host:port` addresses."""


def normalize_server_url(text: str) -> str:
    """`scheme://host:port` of a server address written as a URL or as `host:port`; ValueError saying why not."""
    raw = str(text).strip()
    parts = urllib.parse.urlsplit(raw if "://" in raw else f"http://{raw}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError("a server address needs a host and a port, as http://host:port or host:port")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise ValueError("a server address is the server's root, without a path or a query")
    return f"{parts.scheme}://{parts.netloc}"


def attached_server_urls(cfg: LadenConfig, environ: Mapping[str, str] | None = None) -> tuple[list[str], str]:
    """(the addresses of servers started elsewhere, as written, and where they were given): `rollout.server_urls`,
    else `$AREAL_LLM_SERVER_ADDRS`; ([], '') when neither names any (laden starts the servers)."""
    if cfg.rollout.server_urls:
        return [str(u) for u in cfg.rollout.server_urls], "rollout.server_urls"
    env = os.environ if environ is None else environ
    listed = [a.strip() for a in env.get(AREAL_ADDRS_ENV, "").split(",") if a.strip()]
    return listed, (f"${AREAL_ADDRS_ENV}" if listed else "")


def server_errors(cfg: LadenConfig, *, rl: bool, environ: Mapping[str, str] | None = None) -> list[str]:
    """Addresses that are not `host:port`, servers given to a backend that does not attach to any, or as many
    as `d` of `rollout.backend` does not say; a warning for `rollout.server_host` where no server is started."""
    urls, where = attached_server_urls(cfg, environ)
    if rl and not cfg.rollout.server_host.strip():
        return [
            f"rollout.server_host={cfg.rollout.server_host!r} names no address; set it to 127.0.0.1 (the "
            "default), 0.0.0.0 or this node's address"
        ]
    if not rl or not urls:
        _warn_host(cfg, rl=rl)
        return []
    errors = []
    for i, url in enumerate(urls):
        try:
            normalize_server_url(url)
        except ValueError as err:
            shown = f"{where}[{i}]={url!r}" if where.startswith("rollout") else f"{where} entry {url!r}"
            errors.append(f"{shown}: {err}; e.g. http://10.0.0.5:8000")
    mode = parse_or_none(cfg.rollout.backend)
    if mode is None:
        return errors  # rollout.backend's own error is reported by `alloc_errors`
    if mode.backend not in SERVER_ROLLOUT_BACKENDS:
        errors.append(
            f"{where} lists {len(urls)} server(s) but rollout.backend={cfg.rollout.backend!r} generates in the "
            f"trainer's processes; set rollout.backend: vllm:d{len(urls)} (or sglang:d{len(urls)}), or clear {where}"
        )
    elif mode.dp != len(urls):
        errors.append(
            f"rollout.backend={cfg.rollout.backend!r} has d={mode.dp} but {where} lists {len(urls)} server(s); "
            f"set rollout.backend: {mode.backend}:d{len(urls)} (one d per server)"
        )
    _warn_host(cfg, rl=rl)
    return errors


def server_option_errors(cfg: LadenConfig, *, rl: bool) -> list[str]:
    """The `vllm` / `sglang` settings no range rule covers: a chunk size that is neither -1 nor positive, an
    attention backend that names none; a warning for a context limit below the longest request of `laden rl`."""
    if rl:
        _warn_context_limit(cfg)
    errors = []
    size = cfg.sglang.chunked_prefill_size
    if size is not None and not isinstance(size, bool) and isinstance(size, int) and size != -1 and size < 1:
        errors.append(
            f"sglang.chunked_prefill_size={size!r} must be -1 (no chunking) or at least 1; set it to e.g. 8192, "
            "-1, or null for SGLang's default"
        )
    backend = cfg.sglang.attention_backend
    if backend is not None and not str(backend).strip():
        errors.append(
            f"sglang.attention_backend={backend!r} names no backend; set it to e.g. fa3, flashinfer or triton, "
            "or null for SGLang's choice"
        )
    return errors


def _warn_context_limit(cfg: LadenConfig) -> None:
    """The longest request is a prompt of `train_dataset.max_length` tokens (longer ones are filtered or cut)
    plus `gconfig.max_new_tokens`; a server whose limit is below it refuses such a request."""
    mode = parse_or_none(cfg.rollout.backend)
    field = {"vllm": "vllm.max_model_len", "sglang": "sglang.context_length"}.get(
        mode.backend if mode else ""
    )
    limit = cfg.vllm.max_model_len if field == "vllm.max_model_len" else cfg.sglang.context_length
    longest = cfg.train_dataset.max_length + cfg.gconfig.max_new_tokens
    if field is None or not isinstance(limit, int) or limit >= longest:
        return
    warnings.warn(
        f"{field}={limit} is below train_dataset.max_length + gconfig.max_new_tokens = "
        f"{cfg.train_dataset.max_length} + {cfg.gconfig.max_new_tokens} = {longest}: the servers refuse a request "
        f"whose prompt plus max_new_tokens exceeds it; set {field}: {longest} (or null for the model's own limit), "
        "or lower train_dataset.max_length or gconfig.max_new_tokens",
        UserWarning,
        stacklevel=3,
    )


def _warn_host(cfg: LadenConfig, *, rl: bool) -> None:
    """`rollout.server_host` is read where servers are started: by `laden rl` (none attached) and by
    `laden serve` (those of `rollout.server_urls`); never with the embedded engine."""
    mode = parse_or_none(cfg.rollout.backend)
    if not rl or cfg.rollout.server_host == "127.0.0.1" or mode is None:
        return  # `laden sft` names every rollout field it ignores (`laden.config.usage`)
    if mode.backend not in SERVER_ROLLOUT_BACKENDS:
        warnings.warn(
            f"rollout.server_host={cfg.rollout.server_host!r} is ignored: rollout.backend={cfg.rollout.backend!r} "
            "starts no server; remove it",
            UserWarning,
            stacklevel=3,
        )
