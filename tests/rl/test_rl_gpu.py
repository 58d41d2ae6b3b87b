"""`laden rl` with the roundpipe actor on CUDA: host micro-batches, and the random init on the GPU.

Opt-in by hardware (`gpu` marker): the CPU suite covers the same code paths with CPU devices,
where a micro-batch packed on the wrong device and a host-side init cannot be told apart.
"""

from __future__ import annotations

import json
import math
from importlib import resources

import pytest
import torch

from laden.config import load_config
from laden.rl.trainer import run_rl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ASSETS = resources.files("laden") / "assets"


def _cfg(tmp_path, *overrides):
    return load_config(
        str(ASSETS / "rl_tiny.yaml"),
        [f"actor.path={ASSETS / 'tiny'}", f"train_dataset.path={ASSETS / 'rl_tiny.jsonl'}",
         f"cluster.fileroot={tmp_path}", "actor.backend=roundpipe:d1", *overrides],
        job="rl",
    )  # fmt: skip


def test_a_roundpipe_actor_trains_on_cuda(tmp_path):
    result = run_rl(_cfg(tmp_path, "total_train_steps=3"), progress=False)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # step 0: the held-out evaluation before training
    records = rows[1:]
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in records)


def test_a_random_init_runs_on_the_gpu_from_a_meta_skeleton(tmp_path):
    """`load_model` hands the roundpipe engine a meta skeleton; the engine's init on the GPU has the
    host init's statistics (per tensor) and is the same for the same seed."""
    from laden.engine.backend import resolve_backend
    from laden.engine.runtime import Runtime, load_model
    from laden.model.hf.loading import load_causal_lm

    cfg = _cfg(tmp_path)
    backend = resolve_backend(cfg)
    rt = Runtime(rank=0, world_size=1, device=torch.device("cuda", 0), backend=backend)
    model = load_model(cfg, rt, backend)
    assert all(p.is_meta for p in model.parameters())

    def weights():
        engine = backend.build(cfg, load_model(cfg, rt, backend), total_steps=1, device=rt.device)
        return {name: t.float().clone() for name, t in engine.named_weights(torch.float32)}

    first, second = weights(), weights()
    host = dict(load_causal_lm(str(ASSETS / "tiny"), dtype=torch.float32, init_from_config=True,
                               seed=cfg.seed).named_parameters())  # fmt: skip
    assert set(first) >= set(host) - {"lm_head.weight"}
    for name, ref in host.items():
        if name not in first:
            continue
        got = first[name]
        assert torch.equal(got, second[name]), name
        assert got.shape == ref.shape and bool(torch.isfinite(got).all()), name
        if ref.numel() >= 4096:
            assert abs(got.std().item() - ref.std().item()) <= 0.1 * ref.std().item(), name
        else:
            assert torch.allclose(got.mean(), ref.mean(), atol=0.05), name


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_generation_and_training_on_separate_gpus(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="laden.rl"):
        result = run_rl(
            _cfg(tmp_path, "total_train_steps=3", "actor.backend=fsdp:d1", "cluster.n_gpus_per_node=2"),
            progress=False,
        )
    assert "on cuda:1, the trainer on cuda:0" in caplog.text
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # step 0: the held-out evaluation before training
    records = rows[1:]
    assert all(math.isfinite(r["grad_norm"]) for r in records)
