"""`laden rl` with server rollout engines: the trainer's weights reach the servers as versioned
directories, each completion's tokens carry the version that produced them, and what laden rl
cannot drive is refused with the fix. The server is the fake vLLM of `fake_servers.py` (its
tokens are a fixed function of the prompt; each reload counts as a new set of weights)."""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path

import pytest
import torch
from fake_servers import FakeVLLM
from safetensors.torch import load_file

import laden.rollout.servers as servers
from laden.config import load_config
from laden.rl import trainer as rl_trainer
from laden.rl.trainer import run_rl
from laden.weights import read_weights

ASSETS = Path(str(resources.files("laden") / "assets"))


def _cfg(tmp_path, *overrides):
    return load_config(
        str(ASSETS / "rl_tiny.yaml"),
        [f"actor.path={ASSETS / 'tiny'}", f"train_dataset.path={ASSETS / 'rl_tiny.jsonl'}",
         f"cluster.fileroot={tmp_path}", "rollout.backend=vllm:d1", "cluster.n_gpus_per_node=2",
         "actor.weight_update_mode=disk", *overrides],
        job="rl",
    )  # fmt: skip


def test_vllm_rollout_gets_every_version_from_disk(tmp_path, monkeypatch):
    with FakeVLLM() as fake:
        monkeypatch.setattr(
            servers, "start_server_engine", functools.partial(servers.start_server_engine, urls=[fake.url])
        )
        cfg = _cfg(tmp_path, "total_train_steps=3", "checkpoint.export_hf=true", "gconfig.max_new_tokens=6")
        result = run_rl(cfg, progress=False)
        reloads = [b["kwargs"]["weights_path"] for b in fake.bodies("/collective_rpc")]
        tags = [b["new_version"] for b in fake.bodies("/update_weight_version")]
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and "eval/accuracy" in rows[
        0
    ]  # held out, through the servers
    rows = rows[1:]
    assert all(r["completions"] == 32 and r["stale_dropped"] == 0 and r["max_staleness"] == 0 for r in rows)
    # the first weights (the trainer's initialisation), then one version per step, each its own directory
    root = Path(reloads[0]).parent
    assert [Path(p).name for p in reloads] == [f"v{v:08d}" for v in range(4)] and tags == ["0", "1", "2", "3"]
    final = dict(read_weights(root, 3))
    exported = load_file(str(result.run_dir / "hf" / "model.safetensors"))
    assert final.keys() <= exported.keys() and all(torch.equal(final[k], exported[k]) for k in final)


def test_a_resumed_run_serves_its_checkpoint_version(tmp_path, monkeypatch):
    with FakeVLLM() as fake:
        monkeypatch.setattr(
            servers, "start_server_engine", functools.partial(servers.start_server_engine, urls=[fake.url])
        )
        run_rl(_cfg(tmp_path, "total_train_steps=2"), progress=False)
        first = len(fake.bodies("/collective_rpc"))
        run_rl(_cfg(tmp_path, "total_train_steps=3"), progress=False)
        reloads = [Path(b["kwargs"]["weights_path"]).name for b in fake.bodies("/collective_rpc")][first:]
    assert reloads == ["v00000002", "v00000003"]  # the checkpoint's version again, then step 3's


def test_broadcast_updates_to_servers_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="set actor.weight_update_mode: disk"):
        rl_trainer._refuse_unimplemented(_cfg(tmp_path, "actor.weight_update_mode=xccl"), 1)
    # several trainer processes: rank 0 drives the servers for all of them
    rl_trainer._refuse_unimplemented(_cfg(tmp_path), 2)
