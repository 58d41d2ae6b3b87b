"""AReaL's CPU example (`cluster.n_gpus_per_node: 0`) loads, and `laden rl` runs it on the CPU.

`n_gpus_per_node: 0` means the CPU: every process trains and generates there (gloo), even where CUDA
is visible, and no GPU count bounds the allocation.
"""

from __future__ import annotations

import json

import pytest
import torch
from repo_paths import ROOT

from laden.config import load_config
from laden.engine import runtime
from laden.rl.trainer import run_rl

pytestmark = pytest.mark.usefixtures("one_thread")

ASSETS = ROOT / "laden" / "assets"
CPU_EXAMPLE = ROOT / "tests" / "support" / "areal_configs" / "gsm8k_grpo_cpu.yaml"
TINY = [
    f"actor.path={ASSETS / 'tiny'}",
    f"train_dataset.path={ASSETS / 'rl_tiny.jsonl'}",
    f"valid_dataset.path={ASSETS / 'rl_tiny_valid.jsonl'}",
]


def test_areal_cpu_example_loads_as_a_cpu_run():
    cfg = load_config(CPU_EXAMPLE, TINY, job="rl")
    assert cfg.cluster.n_gpus_per_node == 0 and cfg.cluster.on_cpu
    assert (cfg.actor.backend, cfg.rollout.backend) == ("fsdp:d1p1t1", "vllm:d1p1t1")
    # no GPU count bounds a CPU run: torchrun starts as many processes as the allocation names
    wide = load_config(CPU_EXAMPLE, [*TINY, "actor.backend=fsdp:d4", "rollout.backend=native:d4"], job="rl")
    assert wide.cluster.on_cpu
    with pytest.raises(ValueError, match=r"cluster.n_gpus_per_node=-1 must be at least 0"):
        load_config(CPU_EXAMPLE, [*TINY, "cluster.n_gpus_per_node=-1"], job="rl")


def test_a_cpu_run_stays_on_the_cpu_where_cuda_is_visible(monkeypatch):
    monkeypatch.setattr(runtime, "default_device", lambda: torch.device("cuda", 0))
    assert runtime.start_runtime(cpu=True).device == torch.device("cpu")
    assert runtime.start_runtime().device == torch.device("cuda", 0)


def test_areal_cpu_example_trains_on_the_cpu(tmp_path):
    """Two steps of the example with the tiny model and data; laden's embedded engine generates (the
    example's vLLM server needs vLLM's CPU build and disk weight updates), short completions for speed.
    Its warm-up (warmup_steps_proportion 0.001, rounded up to one step) gives step 1 a zero learning rate."""
    overrides = [*TINY, "actor.init_from_scratch=true", "reward_fn=laden.rl.rewards:letter_reward",
                 "rollout.backend=native:d1", "total_train_steps=2", "gconfig.max_new_tokens=16", "~valid_dataset",
                 f"cluster.fileroot={tmp_path}"]  # fmt: skip
    result = run_rl(load_config(CPU_EXAMPLE, overrides, job="rl"), progress=False)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["completions"] == 32 for r in rows)
    assert rows[1]["lr"] == pytest.approx(1.7e-5) and rows[1]["grad_norm"] > 0 and rows[1]["version"] == 2
