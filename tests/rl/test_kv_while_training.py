"""`native.free_kv_while_training`: when a synchronous run frees the engine's KV cache while it trains."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from rl_runs import tiny_rl_config

import laden.memory.auto as auto
from laden.engine.backend import resolve_backend
from laden.rl import trainer as rl_trainer

GIB = 2**30


def _run(mode: str, *, k: int = 0, actor: str = "fsdp:d1", cache_gib: float = 20.0):
    cfg = tiny_rl_config(
        "unused",
        f"actor.backend={actor}",
        f"native.free_kv_while_training={mode}",
        f"rollout.max_head_offpolicyness={k}",
    )
    cuda = torch.device("cuda", 0)
    run = SimpleNamespace(
        cfg=cfg, rollout_device=cuda, _kv_stays=None,
        rt=SimpleNamespace(device=cuda, any_rank=lambda flag: flag, backend=resolve_backend(cfg)),
        rollout=SimpleNamespace(sleep_frees_bytes=lambda: int(cache_gib * GIB)),
    )  # fmt: skip
    run._serves = lambda: False
    run._sleep_releases_weights = lambda: rl_trainer._Run._sleep_releases_weights(run)
    run.sleeps = lambda: rl_trainer._Run._sleeps_while_training(run)
    run.decide = lambda: rl_trainer._Run._decide_kv_stays(run)
    return run


@pytest.fixture
def gpu_of(monkeypatch):
    """A GPU of `total` GiB whose training step peaked at `peak` GiB."""

    def set_gpu(total: float, peak: float) -> None:
        monkeypatch.setattr(auto, "process_gpu_bytes", lambda device: int(total * GIB))
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: int(peak * GIB))

    return set_gpu


def test_auto_keeps_the_cache_when_the_first_steps_peak_leaves_room(gpu_of):
    run = _run("auto")
    assert run.sleeps()  # the first step frees it: its peak is measured without the cache
    gpu_of(total=80, peak=40)
    run.decide()  # 40 + 20 GiB <= 72 GiB
    assert run._kv_stays is True and not run.sleeps()


def test_auto_goes_on_freeing_the_cache_when_it_would_not_fit(gpu_of):
    run = _run("auto")
    gpu_of(total=80, peak=55)
    run.decide()  # 55 + 20 GiB > 72 GiB
    assert run._kv_stays is False and run.sleeps()


def test_auto_needs_every_rank_to_fit(gpu_of):
    run = _run("auto")
    run.rt.any_rank = lambda flag: True  # another rank's step did not fit
    gpu_of(total=80, peak=10)
    run.decide()
    assert run._kv_stays is False and run.sleeps()


def test_always_never_and_where_nothing_is_freed(gpu_of):
    run = _run("always")
    run._kv_stays = True
    assert run.sleeps()
    assert not _run("never").sleeps()
    assert not _run("auto", k=1).sleeps()  # asynchronous: the engine generates while the trainer trains
    roundpipe = _run("auto", actor="roundpipe:d1")
    roundpipe._kv_stays = True
    assert roundpipe.sleeps()  # its engine frees its weights too: auto always frees
    cpu = _run("always")
    cpu.rt.device = cpu.rollout_device = torch.device("cpu")
    assert not cpu.sleeps()
