"""`laden rl` handing SGLang servers each new policy by broadcast (`actor.weight_update_mode: xccl`): the
trainer joins a gloo group with the servers' workers and broadcasts the weights bucket by bucket; the fake
SGLang of `fake_servers.py` joins that group as SGLang does and receives real tensors, which must equal
the trainer's weights after the last step. Also: a refused bucket fails the run with the reason, and
vLLM's servers, which laden cannot broadcast to, are refused with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fake_servers import FakeSGLang
from rl_runs import tiny_rl_config
from safetensors.torch import load_file

from laden.rl import trainer as rl_trainer
from laden.rl.trainer import run_rl
from laden.rollout.servers.broadcast import WeightBroadcastError
from laden.weights import WeightUpdateMeta

BUCKET = 64 * 1024

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(root: Path, urls: list[str], *overrides: str):
    return tiny_rl_config(
        root, f"rollout.backend=sglang:d{len(urls)}", f"rollout.server_urls=[{','.join(urls)}]",
        "actor.weight_update_mode=xccl", "actor.weight_chunked_mem_mb=1", "gconfig.max_new_tokens=4",
        "valid_dataset=null", *overrides,
    )  # fmt: skip


def _buckets(fake: FakeSGLang) -> list[dict]:
    return fake.bodies("/update_weights_from_distributed")


def test_servers_receive_every_version_by_broadcast(tmp_path, monkeypatch):
    # the tiny model is under the smallest bucket (1 MiB): buckets of 64 KiB make several per version
    monkeypatch.setattr(WeightUpdateMeta, "bucket_bytes", property(lambda self: BUCKET))
    with FakeSGLang() as fake:
        result = run_rl(
            _cfg(tmp_path, [fake.url], "total_train_steps=2", "checkpoint.export_hf=true"), progress=False
        )
        (init,) = fake.bodies("/init_weights_update_group")
        buckets, received, versions = _buckets(fake), dict(fake.received), fake.received_versions
        generated = len(fake.bodies("/generate"))
    assert (init["backend"], init["rank_offset"], init["world_size"]) == ("gloo", 1, 2)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["completions"] == 32 for r in rows) and generated > 0
    # the first weights (the trainer's initialisation), then one version per step, in several buckets each
    per_version = {v: [b for b in buckets if b["weight_version"] == v] for v in ("0", "1", "2")}
    assert sorted({b["weight_version"] for b in buckets}) == ["0", "1", "2"] == sorted(set(versions))
    assert all(len(bs) > 2 for bs in per_version.values())
    exported = load_file(str(result.run_dir / "hf" / "model.safetensors"))
    names = [n for b in per_version["2"] for n in b["names"]]
    assert len(names) == len(set(names)) and set(names) == set(exported)  # every tensor, once per version
    sizes = [
        (
            sum(torch.Size(s).numel() * getattr(torch, d).itemsize for s, d in zip(b["shapes"], b["dtypes"])),
            len(b["names"]),
        )
        for b in per_version["2"]
    ]
    assert all(size <= BUCKET or n == 1 for size, n in sizes) and max(n for _, n in sizes) > 1
    assert all(
        torch.equal(received[k], exported[k]) for k in exported
    )  # what the servers hold: step 2's weights


def test_a_refused_bucket_fails_the_run_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(WeightUpdateMeta, "bucket_bytes", property(lambda self: BUCKET))
    with FakeSGLang() as fake:
        fake.fail_broadcast_after = 1  # the first bucket of the first version arrives, the second is refused
        with pytest.raises(
            WeightBroadcastError, match="failed at bucket 2.*fake: refused the broadcast.*Resume"
        ):
            run_rl(_cfg(tmp_path, [fake.url], "total_train_steps=1"), progress=False)
        assert fake.received_versions == ["0"]  # no step ran on the mixed weights
        rows = [line for path in tmp_path.rglob("metrics.jsonl") for line in path.read_text().splitlines()]
        assert not any(json.loads(line).get("step", 0) >= 1 for line in rows)  # no step reported


def test_a_run_stopped_by_a_failed_broadcast_resumes_from_its_checkpoint(tmp_path):
    with FakeSGLang() as fake:
        cfg = _cfg(
            tmp_path,
            [fake.url],
            "total_train_steps=2",
            "checkpoint.save_freq_steps=1",
            "checkpoint.export_hf=true",
        )
        fake.fail_version = "2"  # step 2's weights are refused: the step is not reported
        with pytest.raises(WeightBroadcastError, match="version 2 failed at bucket 1"):
            run_rl(cfg, progress=False)
        run_dir = next(tmp_path.rglob("metrics.jsonl")).parent
        assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
        result = run_rl(cfg, progress=False)  # the same command again
        groups = [b["group_name"] for b in fake.bodies("/init_weights_update_group")]
        updates = list(dict.fromkeys(zip(fake.received_from, fake.received_versions)))  # (group, version)
        received = dict(fake.received)
    assert len(set(groups)) == 2  # the second run: step 1's checkpoint whole over a new group, then step 2
    assert [(groups.index(g), v) for g, v in updates] == [(0, "0"), (0, "1"), (1, "1"), (1, "2")]
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    exported = load_file(str(result.run_dir / "hf" / "model.safetensors"))
    assert all(torch.equal(received[k], exported[k]) for k in exported)


def test_vllm_broadcasts_are_refused_with_the_fix(tmp_path):
    cfg = tiny_rl_config(
        tmp_path, "rollout.backend=vllm:d1", "cluster.n_gpus_per_node=2", "actor.weight_update_mode=xccl"
    )
    with pytest.raises(ValueError, match="vLLM 0.32.*set actor.weight_update_mode: disk"):
        rl_trainer._refuse_unimplemented(cfg, 1)
    rl_trainer._refuse_unimplemented(_cfg(tmp_path, ["127.0.0.1:1"]), 1)  # SGLang's are accepted


def _rl_rank(rank: int, world_size: int, root: str, url: str) -> dict:
    """A worker of `tests/support/workers.py`: one rank of `laden rl` at fsdp:d2, rank 0 driving the server."""
    result = run_rl(_cfg(Path(root), [url], "total_train_steps=1", "actor.backend=fsdp:d2", "checkpoint.export_hf=true"),
                    progress=False)  # fmt: skip
    return {"run_dir": str(result.run_dir)}


def test_two_trainer_processes_broadcast_from_rank_zero(tmp_path):
    from workers import run_workers

    with FakeSGLang() as fake:
        out = run_workers(_rl_rank, 2, str(tmp_path), fake.url)
        (init,) = fake.bodies("/init_weights_update_group")  # one group: rank 0's
        received, versions = dict(fake.received), sorted(set(fake.received_versions))
    assert (init["rank_offset"], init["world_size"]) == (1, 2) and versions == ["0", "1"]
    exported = load_file(str(Path(out[0]["run_dir"]) / "hf" / "model.safetensors"))
    assert set(received) == set(exported) and all(torch.equal(received[k], exported[k]) for k in exported)


@pytest.fixture
def two_server_processes():
    """Two fake SGLang servers, each a process of its own (as real servers are: each joins the group once)."""
    import subprocess
    import sys

    from repo_paths import SUPPORT

    from laden.weights import free_port

    ports = [free_port(), free_port()]
    procs = [
        subprocess.Popen(
            [sys.executable, str(SUPPORT / "fake_servers.py"), "--fake-kind", "sglang", "--port", str(p)]
        )
        for p in ports
    ]
    try:
        yield [f"http://127.0.0.1:{p}" for p in ports]
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


def test_two_servers_each_receive_the_weights_at_their_ranks(tmp_path, two_server_processes):
    from laden.rollout.servers.http import request_json

    urls = two_server_processes
    result = run_rl(_cfg(tmp_path, urls, "total_train_steps=1", "checkpoint.export_hf=true"), progress=False)
    exported = load_file(str(result.run_dir / "hf" / "model.safetensors"))
    # a group of three ranks forms only if the servers took ranks 1 and 2: each holds step 1's weights
    for url in urls:
        received = request_json("POST", url + "/fake_received", timeout_s=60)
        assert set(received) == set(exported)
        for name, t in exported.items():
            got = torch.tensor(received[name]["values"], dtype=torch.float64).to(t.dtype)
            assert received[name]["dtype"] == str(t.dtype).removeprefix("torch.") and torch.equal(got, t), (
                name
            )
