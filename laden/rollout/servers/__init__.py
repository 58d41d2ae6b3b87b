"""Rollout servers: vLLM and SGLang started by laden (or attached to) and driven over HTTP.

`start_server_engine(AllocationMode.parse("vllm:d2t1"), model_dir=...)` starts one server per
`d`, each on `t` GPUs, bound to 127.0.0.1 (`rollout.server_host`) on a free port, and returns a
`RolloutEngine`; its `close()` (or the interpreter's exit) ends the server processes. laden never
imports vLLM or SGLang: they may live in a virtual environment of their own (`python=`,
`LADEN_VLLM_PYTHON`, `LADEN_SGLANG_PYTHON`). `laden serve` (`serve.py`) starts the servers of a
config on a node of their own, for `laden rl` elsewhere to attach to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laden.rollout.servers.engine import Segment, SegmentRequest, ServerDialect, ServerEngine, ServerHandle
from laden.rollout.servers.http import ServerRequestError
from laden.rollout.servers.process import ServerNotInstalledError, ServerProcess, ServerStartError
from laden.rollout.servers.sglang import SGLangDialect, SGLangEngine, SGLangServerConfig
from laden.rollout.servers.vllm import VLLMDialect, VLLMEngine, VLLMServerConfig

if TYPE_CHECKING:
    from laden.config.alloc import AllocationMode
    from laden.config.schema import LadenConfig

SERVER_BACKENDS = ("vllm", "sglang")
"""`rollout.backend` names served by this package."""


def start_server_engine(
    mode: AllocationMode,
    *,
    model_dir: str | Path,
    cfg: LadenConfig | None = None,
    urls: Sequence[str] | None = None,
    python: str | None = None,
    log_dir: str | Path | None = None,
    server: VLLMServerConfig | SGLangServerConfig | None = None,
    initial_version: int = 0,
    first_device: int | None = None,
    ports: Sequence[int] | None = None,
    **engine_kwargs: Any,
) -> ServerEngine:
    """Start (or, given `urls`, attach to) the servers `mode` describes and return the engine.

    `cfg` supplies the `vllm` / `sglang` section's settings, `seed`, `rollout.setup_timeout`, the listening
    address (`rollout.server_host`, unless `server` names another than loopback) and the log
    directory (`<run_dir>/logs/rollout`); `server` overrides every server setting; `python`,
    `log_dir`, `first_device` (visible GPUs left to the trainer) and `ports` (each server's) override
    those alone. `engine_kwargs` go to `ServerEngine` (e.g. `max_concurrent_requests`,
    `request_timeout_s`).
    """
    _check_mode(mode, urls)
    if log_dir is None and cfg is not None:
        log_dir = Path(cfg.run_dir) / "logs" / "rollout"
    if mode.backend == "vllm":
        if urls:
            return VLLMEngine.attach(urls, initial_version=initial_version, **engine_kwargs)
        vllm_cfg = replace(server) if isinstance(server, VLLMServerConfig) else VLLMServerConfig()
        if cfg is not None and not isinstance(server, VLLMServerConfig):
            _take_section(vllm_cfg, cfg.vllm)
        _override(vllm_cfg, cfg, python=python, log_dir=log_dir, first_device=first_device, ports=ports)
        return VLLMEngine.launch(
            model_dir, dp=mode.dp, tp=mode.tp, cfg=vllm_cfg, initial_version=initial_version, **engine_kwargs
        )
    if urls:
        return SGLangEngine.attach(urls, initial_version=initial_version, **engine_kwargs)
    sglang_cfg = replace(server) if isinstance(server, SGLangServerConfig) else SGLangServerConfig()
    if cfg is not None and not isinstance(server, SGLangServerConfig):
        _take_section(sglang_cfg, cfg.sglang)
    _override(sglang_cfg, cfg, python=python, log_dir=log_dir, first_device=first_device, ports=ports)
    return SGLangEngine.launch(
        model_dir, dp=mode.dp, tp=mode.tp, cfg=sglang_cfg, initial_version=initial_version, **engine_kwargs
    )


def _check_mode(mode: AllocationMode, urls: Sequence[str] | None) -> None:
    text = mode.format()
    if mode.backend not in SERVER_BACKENDS:
        raise ValueError(
            f"rollout.backend={text!r}: backend {mode.backend!r} is not a server backend; server backends: "
            f"{', '.join(SERVER_BACKENDS)} (the embedded engine is `native:d1`)"
        )
    extra = [f"{k}{mode.size(k)}" for k in "cpe" if mode.size(k) != 1]
    if extra:
        raise ValueError(
            f"rollout.backend={text!r}: {mode.backend} servers take only d (servers) and t (GPUs per server); "
            f"remove {''.join(extra)}"
        )
    if urls is not None and len(urls) != mode.dp:
        raise ValueError(
            f"rollout.backend={text!r} has d={mode.dp} but {len(urls)} server URLs were given; "
            f"give one URL per data-parallel rank or set d{len(urls)}"
        )


def _take_section(server: VLLMServerConfig | SGLangServerConfig, section: Any) -> None:
    """The run config's `vllm` / `sglang` settings onto the server config (the same names)."""
    for f in fields(section):
        setattr(server, f.name, getattr(section, f.name))


def _override(
    server: VLLMServerConfig | SGLangServerConfig, cfg: LadenConfig | None, *, python: Any, log_dir: Any,
    first_device: int | None, ports: Sequence[int] | None,
) -> None:  # fmt: skip
    if ports is not None:
        server.ports = tuple(ports)
    if python is not None:
        server.python = python
    if log_dir is not None:
        server.log_dir = str(log_dir)
    if first_device is not None:
        server.first_device = first_device
    if cfg is not None and server.startup_timeout_s == type(server)().startup_timeout_s:
        server.startup_timeout_s = cfg.rollout.setup_timeout
    if cfg is not None and server.seed is None:
        server.seed = cfg.seed
    if cfg is not None and server.host == "127.0.0.1":
        server.host = cfg.rollout.server_host


__all__ = [
    "SERVER_BACKENDS",
    "SGLangDialect",
    "SGLangEngine",
    "SGLangServerConfig",
    "Segment",
    "SegmentRequest",
    "ServerDialect",
    "ServerEngine",
    "ServerHandle",
    "ServerNotInstalledError",
    "ServerProcess",
    "ServerRequestError",
    "ServerStartError",
    "VLLMDialect",
    "VLLMEngine",
    "VLLMServerConfig",
    "start_server_engine",
]
