"""`laden rl` on a real vLLM server (vllm-cpu 0.32.0): opt-in tier, `python -m pytest -m server`.

The server starts on a tiny random-init Qwen3 (`vllm_cpu.py`); laden rl trains three steps, handing
the server each step's weights as a versioned directory: in one process that starts the server, and
in two trainer processes (gloo) attached to a server started elsewhere (`rollout.server_urls`), which
rank 0 drives for both. The decisive check is the PPO importance weight of every step: the trainer's
log-probs of the completions over the log-probs vLLM returned for them. It is 1 only when the server
sampled with exactly the weights the trainer had, so after the first step it shows that every disk
update reached the server.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path

import pytest
from vllm_cpu import cpu_server_config, flat_model_dir

import laden.rollout.servers as servers
from laden.config import load_config
from laden.config.alloc import AllocationMode
from laden.rl.trainer import run_rl

pytestmark = [pytest.mark.server]

ASSETS = Path(str(resources.files("laden") / "assets"))


def _cfg(model_dir: Path, root: Path, *overrides: str):
    return load_config(
        str(ASSETS / "rl_tiny.yaml"),
        [f"actor.path={model_dir}", f"train_dataset.path={ASSETS / 'rl_tiny.jsonl'}", f"cluster.fileroot={root}",
         "actor.init_from_config=false", "rollout.backend=vllm:d1", "cluster.n_gpus_per_node=2",
         "actor.weight_update_mode=disk", "total_train_steps=3", "actor.optimizer.lr=1e-2", *overrides],
        job="rl",
    )  # fmt: skip


def _rank_on_server(rank: int, world_size: int, root: str, model_dir: str, url: str) -> list[dict]:
    """A worker of `tests/support/workers.py`: one rank of `laden rl` at fsdp:d2 attached to the server at `url`."""
    cfg = _cfg(Path(model_dir), Path(root), "actor.backend=fsdp:d2", f"rollout.server_urls=[{url}]")
    result = run_rl(cfg, progress=False)
    return (
        [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        if rank == 0
        else []
    )


def test_two_trainer_processes_train_on_a_vllm_server_started_elsewhere(vllm_python, tmp_path):
    import asyncio

    from workers import run_workers

    model_dir = flat_model_dir(tmp_path / "model")
    engine = servers.start_server_engine(
        AllocationMode.parse("vllm:d1"),
        model_dir=model_dir,
        server=cpu_server_config(vllm_python, tmp_path / "logs"),
    )
    try:
        rows = run_workers(_rank_on_server, 2, str(tmp_path / "runs"), str(model_dir), engine.urls[0])[0]
    finally:
        asyncio.run(engine.close())
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and "eval/accuracy" in rows[
        0
    ]  # held out, before training
    rows = rows[1:]
    assert all(r["completions"] == 32 and r["max_staleness"] == 0 for r in rows)
    assert all(abs(r["importance_weight"] - 1) < 1e-3 for r in rows), [r["importance_weight"] for r in rows]
    assert all(r["grad_norm"] > 0 for r in rows)


def test_laden_rl_trains_on_a_vllm_server(vllm_python, tmp_path, monkeypatch):
    model_dir = flat_model_dir(tmp_path / "model")
    server = cpu_server_config(vllm_python, tmp_path / "logs")
    monkeypatch.setattr(
        servers, "start_server_engine", functools.partial(servers.start_server_engine, server=server)
    )
    cfg = _cfg(model_dir, tmp_path)
    result = run_rl(cfg, progress=False)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and "eval/accuracy" in rows[
        0
    ]  # held out, before training
    rows = rows[1:]
    assert all(r["completions"] == 32 and r["max_staleness"] == 0 for r in rows)
    assert all(abs(r["importance_weight"] - 1) < 1e-3 for r in rows), [r["importance_weight"] for r in rows]
    assert all(r["grad_norm"] > 0 for r in rows)  # the policy moved: steps 2 and 3 sampled new weights
