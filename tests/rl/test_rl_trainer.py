"""`laden rl` end to end on the CPU: the embedded tiny task learns, staleness holds, resume is exact."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import pytest
from rl_runs import crash_then_resume, tiny_rl_config

from laden.rl import trainer as rl_trainer
from laden.rl.trainer import run_rl

pytestmark = pytest.mark.usefixtures("one_thread")

ASSETS = resources.files("laden") / "assets"


def _cfg(tmp_path, *overrides):
    return tiny_rl_config(tmp_path, *overrides)


def _metrics(result) -> list[dict]:
    """The training steps' rows (not the held-out evaluation before training, step 0)."""
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] > 0]


def test_the_tiny_task_reward_rises(tmp_path):
    result = run_rl(_cfg(tmp_path, "total_train_steps=30"), progress=False)
    assert result.num_steps == 30 and len(result.rewards) == 30
    first, last = sum(result.rewards[:5]) / 5, sum(result.rewards[-5:]) / 5
    assert last > first + 0.2, result.rewards
    records = _metrics(result)
    assert [r["step"] for r in records] == list(range(1, 31))
    assert all(r["max_staleness"] == 0 and r["stale_dropped"] == 0 for r in records)  # synchronous
    assert all(r["completions"] == 8 * 4 for r in records)
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (result.run_dir / "curves.png").exists() == has_matplotlib
    assert not (result.run_dir / "tensorboard").exists()  # opt-in: stats_logger.tensorboard.path


def test_asynchronous_rollouts_never_train_on_staler_samples(tmp_path):
    result = run_rl(
        _cfg(tmp_path, "total_train_steps=12", "rollout.max_head_offpolicyness=2"), progress=False
    )
    records = _metrics(result)
    assert len(records) == 12
    assert max(r["max_staleness"] for r in records) <= 2
    assert records[-1]["stale_dropped"] == 0 and records[-1]["trained"] == 12 * 8 * 4


def test_stale_completions_are_dropped_and_counted(tmp_path, monkeypatch):
    """A completion whose oldest token is more than k versions old is never trained on."""
    import torch

    from laden.engine.runtime import Runtime
    from laden.rl.workflow import Trajectory

    rt = Runtime(rank=0, world_size=1, device=torch.device("cpu"))
    run = rl_trainer._Run(_cfg(tmp_path, "rollout.max_head_offpolicyness=1"), rt=rt, run=None)  # type: ignore[arg-type]
    seen: list[int] = []

    def traj(version):
        return Trajectory(prompt_ids=(5, 6), completion_ids=[7], logprobs=[-1.0], versions=[version], reward=1.0,
                          stop_reason="stop", group_id="g", sample_index=0, info={})  # fmt: skip

    class Rollout:
        async def update_weights(self, source, version):
            pass

    class Engine:
        def named_weights(self, dtype=None, *, device=None, trained_only=False):
            return iter(())

    class Rewards:
        class stats:
            errors = timeouts = 0

    run.engine, run.rollout, run.rewards = Engine(), Rollout(), Rewards()
    monkeypatch.setattr(
        run, "_train_on", lambda groups, shares: seen.extend(t.versions[0] for g in groups for t in g) or {}
    )
    run.train_pool = ThreadPoolExecutor(1)
    # step 5 trains the policy of version 4: versions 3 and 4 are within k = 1, 2 is not
    record = asyncio.run(run._step(5, [[traj(4), traj(3), traj(2)]], gen_s=0.0, wait_s=0.0))
    assert sorted(seen) == [3, 4]
    assert run.counters.stale_dropped == 1 and run.counters.max_staleness == 1
    assert record["completions"] == 2


def test_resumed_equals_uninterrupted(tmp_path, monkeypatch):
    full = run_rl(_cfg(tmp_path / "a", "total_train_steps=6", "checkpoint.save_freq_steps=3"), progress=False)
    cfg = _cfg(tmp_path / "b", "total_train_steps=6", "checkpoint.save_freq_steps=3")
    resumed = crash_then_resume(cfg, monkeypatch, at_step=4)
    assert resumed.rewards == full.rewards[3:]  # steps 4..6, bitwise
    a, b = _metrics(full), _metrics(resumed)
    assert [r["step"] for r in b] == list(range(1, 7))
    elapsed = [r["elapsed_s"] for r in b]  # the loop's clock goes on across the resume
    assert all(x < y for x, y in zip(elapsed, elapsed[1:])), elapsed
    for ra, rb in zip(a, b):
        assert ra["reward_mean"] == rb["reward_mean"] and ra["loss"] == rb["loss"]
        assert (ra["episodes"], ra["trained"], ra["version"]) == (
            rb["episodes"],
            rb["trained"],
            rb["version"],
        )


@pytest.mark.parametrize("seed", [0, 1])
def test_staleness_bound_holds_under_random_rollout_and_training_speeds(tmp_path, monkeypatch, seed):
    """Episodes and training steps take random times; the bound is never exceeded."""
    import random
    import time

    from laden.rl.workflow import RLVRWorkflow

    rng = random.Random(seed)
    episode, train_on = RLVRWorkflow.arun_episode, rl_trainer._Run._train_on

    async def slow_episode(self, engine, data):
        await asyncio.sleep(rng.uniform(0, 0.02))
        return await episode(self, engine, data)

    def slow_train(self, groups, shares):
        time.sleep(rng.uniform(0, 0.05))
        return train_on(self, groups, shares)

    monkeypatch.setattr(RLVRWorkflow, "arun_episode", slow_episode)
    monkeypatch.setattr(rl_trainer._Run, "_train_on", slow_train)
    result = run_rl(_cfg(tmp_path, "total_train_steps=8", "rollout.max_head_offpolicyness=1"), progress=False)
    records = _metrics(result)
    assert len(records) == 8 and max(r["max_staleness"] for r in records) <= 1
    # admission keeps every batch within the bound, so the drop (the second check) never fires
    assert records[-1]["stale_dropped"] == 0 and records[-1]["trained"] == 8 * 8 * 4


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """Three steps of the tiny task, weights updated in place and never slept: the reference of the tests
    that change one of those and must train the same (the run is deterministic; it is made once)."""
    return run_rl(_cfg(tmp_path_factory.mktemp("three_steps"), "total_train_steps=3"), progress=False)


def test_disk_weight_updates_train_the_same_as_in_place(tmp_path, three_steps):
    in_place = three_steps
    disk = run_rl(
        _cfg(tmp_path / "b", "total_train_steps=3", "actor.weight_update_mode=disk"), progress=False
    )
    assert disk.rewards == in_place.rewards
    versions = sorted(p.name for p in (disk.run_dir / "weight_updates").iterdir() if p.name.startswith("v"))
    assert versions == ["v00000002", "v00000003"]  # keep_last=2 of the three published


def test_kl_to_the_initial_policy(tmp_path):
    result = run_rl(
        _cfg(tmp_path, "total_train_steps=4", "actor.kl_ctl=0.5", "actor.kl_estimator=k3"), progress=False
    )
    kl = [r["kl"] for r in _metrics(result)]
    assert kl[0] == 0.0  # step 1 trains the initial policy itself
    assert all(k > 0 for k in kl[1:]) and all(k < 10 for k in kl)


def _rl_rank(rank: int, world_size: int, root: str, backend: str = "fsdp:d2") -> dict:
    """A worker of `tests/support/workers.py`: `laden rl` as one rank of `backend` with a native engine per rank."""
    captured = {}
    original = rl_trainer._Run._push_weights

    async def keep_engine(self, version):
        await original(self, version)
        captured["weights"] = {k: v.clone() for k, v in self.rollout.named_parameters().items()}

    rl_trainer._Run._push_weights = keep_engine
    cfg = _cfg(Path(root), "total_train_steps=3", f"actor.backend={backend}", "rollout.backend=native:d2",
               "cluster.n_gpus_per_node=2")  # fmt: skip
    result = run_rl(cfg, progress=False)
    digest = float(sum(v.double().sum() for v in captured["weights"].values()))
    rows = _metrics(result) if rank == 0 else []
    return {"digest": digest, "rows": rows}


@pytest.fixture(scope="module")
def fsdp_d2_run(tmp_path_factory):
    """Three steps of `laden rl` at fsdp:d2 on two processes: checked itself, and the reference of the
    other layouts (the run is deterministic; it is made once)."""
    from workers import run_workers

    return run_workers(_rl_rank, 2, str(tmp_path_factory.mktemp("fsdp_d2")))


def test_two_processes_train_one_policy_and_both_engines_get_it(fsdp_d2_run):
    out = fsdp_d2_run
    assert out[0]["digest"] == out[1]["digest"]  # both ranks' rollout engines hold the same new weights
    rows = out[0]["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["completions"] == 8 * 4 for r in rows)  # the global batch, generated half on each rank
    assert [r["trained"] for r in rows] == [32, 64, 96]  # counted over both ranks


def _rl_rank_resumed(rank: int, world_size: int, root: str) -> dict:
    """A worker: `_rl_rank`'s run (fsdp:d2, an engine per rank), stopped at step 3 on both ranks and
    run again, resuming from the checkpoint of step 2; rank 0 returns the metrics rows, every rank the
    sampling state its resumed engine starts from."""
    cfg = _cfg(Path(root), "total_train_steps=3", "actor.backend=fsdp:d2", "rollout.backend=native:d2",
               "cluster.n_gpus_per_node=2", "checkpoint.save_freq_steps=1")  # fmt: skip
    build, built = rl_trainer._Run._rollout_engine, []

    def keep_state(self, **kwargs):
        engine = build(self, **kwargs)
        built.append(engine.sampling_state())
        return engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rl_trainer._Run, "_rollout_engine", keep_state)
        result = crash_then_resume(cfg, mp, at_step=3)
    return {"rows": _metrics(result) if rank == 0 else [], "restored": built[-1]}


def test_two_processes_resumed_equal_uninterrupted(tmp_path, fsdp_d2_run):
    """Each rank samples its share of the batch with its own generator; the checkpoint keeps every
    rank's, so the resumed step 3 generates and trains exactly as the uninterrupted run's."""
    from workers import run_workers

    out = run_workers(_rl_rank_resumed, 2, str(tmp_path / "resumed"))
    (saved,) = [json.loads(f.read_text())["rl"] for f in tmp_path.rglob("step_2/trainer.json")]
    assert [o["restored"] for o in out] == saved["rollout_rng_ranks"]  # each rank its own
    assert out[0]["restored"] != out[1]["restored"]  # the engines sample with seed + rank
    rows, reference = out[0]["rows"], fsdp_d2_run[0]["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for got, want in zip(rows, reference):
        keys = ("reward_mean", "loss", "trained")
        assert [got[k] for k in keys] == [want[k] for k in keys], got["step"]


@pytest.mark.parametrize("backend", ["archon:d1p2", "fsdp:d1t2"])
def test_pipeline_and_tensor_ranks_train_on_the_same_rollouts(tmp_path, backend, fsdp_d2_run):
    """Both processes generate half the batch, as under fsdp:d2; the two pipeline stages (tensor ranks) of
    the one data-parallel rank then train on all of it: the steps equal fsdp:d2's on the same rollouts."""
    from workers import run_workers

    reference = fsdp_d2_run[0]["rows"]
    out = run_workers(_rl_rank, 2, str(tmp_path / "other"), backend)
    assert out[0]["digest"] == out[1]["digest"]  # both engines hold the one policy
    rows = out[0]["rows"]
    assert [r["completions"] for r in rows] == [32] * 3 and rows[-1]["trained"] == 96
    assert rows[0]["reward_mean"] == reference[0]["reward_mean"]  # step 1: the same rollouts
    for step, ref in zip(rows, reference):
        for name in ("loss", "grad_norm", "entropy"):
            assert math.isclose(step[name], ref[name], rel_tol=1e-4, abs_tol=1e-4), (step["step"], name)


def test_sleeping_while_training_changes_nothing(tmp_path, monkeypatch, three_steps):
    """Colocated on a GPU the engine frees its KV cache while the trainer trains: slept == never slept."""
    awake = three_steps
    calls = []
    monkeypatch.setattr(rl_trainer._Run, "_sleeps_while_training", lambda self: calls.append(1) or True)
    slept = run_rl(_cfg(tmp_path / "b", "total_train_steps=3"), progress=False)
    assert len(calls) == 3 and slept.rewards == awake.rewards


def test_prompts_longer_than_max_length_are_skipped_and_counted(tmp_path):
    result = run_rl(_cfg(tmp_path, "total_train_steps=1", "train_dataset.max_length=33"), progress=False)
    stats = json.loads((result.run_dir / "train_data_stats.json").read_text())
    assert stats["records"] == 64 and 0 < stats["dropped_longer_than_max_length"] < 64
    assert stats["kept"] + stats["dropped_longer_than_max_length"] == 64


def test_refills_after_rejections_skip_no_prompt(tmp_path, monkeypatch):
    """Rejected groups are refilled from the next prompts in data order; the rest are kept for later."""
    from laden.data import GlobalBatchIterator
    from laden.rl.workflow import RLVRWorkflow

    seen: list[str] = []
    episode = RLVRWorkflow.arun_episode

    async def reject_every_third(self, engine, data):
        seen.append(data["prompt"])
        return None if len(seen) % 3 == 0 else await episode(self, engine, data)

    monkeypatch.setattr(RLVRWorkflow, "arun_episode", reject_every_third)
    cfg = _cfg(tmp_path, "total_train_steps=4", "~valid_dataset")  # training episodes alone
    result = run_rl(cfg, progress=False)
    records = [json.loads(line) for line in (ASSETS / "rl_tiny.jsonl").read_text().splitlines()]
    order = GlobalBatchIterator(len(records), batch_size=8, shuffle=cfg.train_dataset.shuffle, seed=cfg.seed)
    expected = [records[i]["prompt"] for _ in range(len(seen) // 8 + 1) for i in next(order)]
    assert seen == expected[: len(seen)]  # data order, nothing skipped or repeated
    assert _metrics(result)[-1]["rejected"] == len(seen) // 3


def test_a_tensor_parallel_native_engine_is_refused(tmp_path):
    cfg = _cfg(tmp_path, "rollout.backend=native:d1t2", "cluster.n_gpus_per_node=4")
    with pytest.raises(ValueError, match="tensor-parallel native engine"):
        rl_trainer._refuse_unimplemented(cfg, 1)


def test_roundpipe_and_archon_actors_train_like_an_fsdp_one(tmp_path):
    """The same first step on every engine kind (same init, same rollouts); the roundpipe actor's
    micro-batches are packed on the host, where that engine takes them."""
    import torch

    from laden.engine.backend import resolve_backend
    from laden.engine.runtime import Runtime, batch_device

    steps = {}
    for backend in ("fsdp:d1", "roundpipe:d1", "archon:d1"):
        result = run_rl(_cfg(tmp_path / backend.split(":")[0], "total_train_steps=2", f"actor.backend={backend}"),
                        progress=False)  # fmt: skip
        steps[backend] = _metrics(result)
    for other in ("roundpipe:d1", "archon:d1"):
        for fsdp, step in zip(steps["fsdp:d1"], steps[other]):  # step 2 samples from the update
            assert step["reward_mean"] == fsdp["reward_mean"]
            for name in ("loss", "grad_norm", "entropy"):
                assert math.isclose(step[name], fsdp[name], rel_tol=1e-4, abs_tol=1e-4), (other, name)
    on_gpu = Runtime(rank=0, world_size=1, device=torch.device("cuda", 0))
    roundpipe = resolve_backend(_cfg(tmp_path, "actor.backend=roundpipe:d1"))
    assert batch_device(roundpipe, on_gpu) == torch.device("cpu")
    assert batch_device(resolve_backend(_cfg(tmp_path)), on_gpu) == torch.device("cuda", 0)


def test_roundpipe_num_microbatch_splits_the_rl_step_and_changes_nothing_else(tmp_path, monkeypatch):
    """`actor.roundpipe.num_microbatch` packs each policy step into at least that many micro-batches
    (as in `laden sft`); the step's loss is normalised by the step's token count, so it trains the same."""
    from laden.engine.roundpipe import RoundPipeEngine

    seen: list[int] = []
    original = RoundPipeEngine.forward_backward

    def counting(self, mbs, *args, **kwargs):
        seen.append(len(mbs))
        return original(self, mbs, *args, **kwargs)

    monkeypatch.setattr(RoundPipeEngine, "forward_backward", counting)
    runs = {}
    for n in (1, 3):
        cfg = _cfg(tmp_path / f"n{n}", "total_train_steps=2", "actor.backend=roundpipe:d1",
                   f"actor.roundpipe.num_microbatch={n}", "actor.mb_spec.max_tokens_per_mb=65536")  # fmt: skip
        seen.clear()
        runs[n] = _metrics(run_rl(cfg, progress=False))
        assert len(seen) == 2 and min(seen) >= n and (n > 1 or seen == [1, 1]), seen  # one fits the budget
    for one, three in zip(runs[1], runs[3]):
        assert three["reward_mean"] == one["reward_mean"]
        for name in ("loss", "grad_norm"):
            assert math.isclose(three[name], one[name], rel_tol=1e-4, abs_tol=1e-5), name


@pytest.mark.parametrize(
    ("actor", "rollout", "world_size", "gpus", "expected"),
    [
        ("fsdp:d1", "native:d1", 1, 2, "cuda:1"),  # a GPU of its own
        ("fsdp:d1", "native:d1", 1, 1, "cuda:0"),  # one GPU declared: colocated
        ("roundpipe:d1", "native:d1", 1, 2, "cuda:0"),  # the roundpipe pool takes every GPU
        ("fsdp:d2", "native:d1", 2, 2, "cuda:0"),  # torchrun: each rank's own GPU
        ("fsdp:d1", "vllm:d1", 1, 2, "cuda:0"),  # servers are placed by their launcher
    ],
)
def test_where_the_native_engine_generates(tmp_path, actor, rollout, world_size, gpus, expected):
    import torch

    from laden.engine.backend import resolve_backend
    from laden.engine.runtime import Runtime

    cfg = _cfg(
        tmp_path, f"actor.backend={actor}", f"rollout.backend={rollout}", f"cluster.n_gpus_per_node={gpus}"
    )
    backend = resolve_backend(cfg)
    rt = Runtime(rank=0, world_size=world_size, device=torch.device("cuda", 0), backend=backend)
    assert rl_trainer.rollout_device(cfg, rt, device_count=2) == torch.device(expected)
    on_cpu = Runtime(rank=0, world_size=1, device=torch.device("cpu"), backend=backend)
    assert rl_trainer.rollout_device(cfg, on_cpu, device_count=2) == torch.device("cpu")
    if expected == "cuda:1":
        with pytest.raises(ValueError, match=r"cluster.n_gpus_per_node=2 .* sees 1 GPU\(s\)"):
            rl_trainer.rollout_device(cfg, rt, device_count=1)


def test_each_rank_resumes_its_own_sampling_state(caplog):
    import logging

    from laden.rl.checkpoints import _own_rng as own

    assert own({"rollout_rng": [1], "rollout_rng_ranks": [[1], [2]]}, 1, 2) == [2]
    assert own({"rollout_rng": [1]}, 0, 1) == [1]  # a checkpoint written before the states of every rank
    state = {"rollout_rng": [1], "rollout_rng_ranks": [[1], [2]], "episodes": 3}
    with caplog.at_level(logging.WARNING, logger="laden.rl"):
        assert own(state, 0, 4) == [1]  # another world size: rank 0's, said once
    assert "this run has 4" in caplog.text and state == {"episodes": 3}  # the counters are left
