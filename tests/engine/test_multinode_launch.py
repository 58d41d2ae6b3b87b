"""Multi-node launches on one machine, as docs/multinode.md runs them: `examples/slurm_multinode.sbatch` under
stand-ins for `srun` and `scontrol` (`fake_slurm.py`), whose "nodes" are this machine. Each training node is
one torchrun launch of one process (`--nnodes 2 --nproc-per-node 1 --node-rank {0,1}`, the rendezvous on
127.0.0.1); the runs share `cluster.fileroot` as the nodes of a cluster share a filesystem.

Each must equal the same run in one process: `laden sft` at fsdp:d2; `laden rl` at fsdp:d2 with a native
engine per process; `laden rl` with a rollout server started elsewhere (a fake vLLM in this process,
attached through `rollout.server_urls`), which rank 0 drives for both nodes. And the recipe with a node of
its own for the servers: `laden serve` there (the fake vLLM as a stand-in `vllm` package), the trainers
waiting for it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_servers import FakeVLLM, stub_vllm_path
from fake_slurm import fake_slurm_bin, slurm_env
from repo_paths import ROOT

from laden.config import load_config
from laden.rl.trainer import run_rl
from laden.rollout.servers.process import free_port
from laden.sft.trainer import run_sft

pytestmark = pytest.mark.usefixtures("one_thread")

EXAMPLES = ROOT / "examples"
TIMEOUT_S = 900  # a failure guard only: the runs take seconds


def _sbatch(
    tmp_path: Path, job: str, *overrides: str, nodes: int = 2, server_nodes: int = 0, path: str = ""
) -> str:
    """`examples/slurm_multinode.sbatch` on `nodes` "nodes" of this machine (one GPU's worth of processes
    each) running `laden <job>` on its tiny example; the job's output."""
    env = slurm_env(
        fake_slurm_bin(tmp_path / "bin"), ["localhost"] * server_nodes + ["127.0.0.1"] * (nodes - server_nodes),
        CONFIG=str(EXAMPLES / f"{job}_tiny.yaml"), JOB=job, GPUS_PER_NODE="1", SERVER_NODES=str(server_nodes),
        MASTER_PORT=str(free_port()), PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1",
        PYTHONPATH=os.pathsep.join(p for p in (path, str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )  # fmt: skip
    cmd = [
        "bash",
        str(EXAMPLES / "slurm_multinode.sbatch"),
        f"cluster.fileroot={tmp_path}",
        "trial_name=nodes",
        *overrides,
    ]
    done = subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout[-12000:]
    assert done.stdout.count("done: ") == 1  # rank 0 speaks for every node
    return done.stdout


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _one_process(tmp_path: Path, job: str, *overrides: str) -> list[dict]:
    cfg = load_config(
        str(EXAMPLES / f"{job}_tiny.yaml"),
        [f"cluster.fileroot={tmp_path}", "trial_name=one", *overrides],
        job=job,
    )
    return _rows((run_rl if job == "rl" else run_sft)(cfg, progress=False).run_dir)


def test_sft_on_two_nodes_equals_one_process(tmp_path):
    steps = ("total_train_steps=3", "train_dataset.batch_size=8", "checkpoint.save_freq_steps=null")
    want = _one_process(tmp_path, "sft", *steps, "actor.backend=fsdp:d1")
    _sbatch(tmp_path, "sft", *steps, "actor.backend=fsdp:d2")
    got = _rows(tmp_path / "sft-tiny" / "nodes")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for g, w in zip(got, want):
        assert math.isclose(g["loss"], w["loss"], rel_tol=1e-5, abs_tol=1e-6), g["step"]


RL = (
    "total_train_steps=2",
    "checkpoint.save_freq_steps=null",
    "checkpoint.export_hf=false",
    "valid_dataset=null",
)
SERVED = ("rollout.backend=vllm:d1", "actor.weight_update_mode=disk", "gconfig.max_new_tokens=6")


def test_rl_on_two_nodes_with_an_engine_per_process(tmp_path):
    """native:d2: each node's process generates half of each batch."""
    _sbatch(tmp_path, "rl", *RL, "actor.backend=fsdp:d2", "rollout.backend=native:d2")
    rows = _rows(tmp_path / "rl-tiny" / "nodes")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["completions"] == 32 for r in rows) and rows[-1]["trained"] == 64


@pytest.mark.slow
def test_rl_on_two_nodes_with_a_server_elsewhere_equals_one_process(tmp_path):
    """Rank 0 (node 0) drives the one server for both nodes: it loads each version once, and the run
    generates and trains what one process does. Slow: the default tier's two-node launch of `laden rl` is
    test_rl_on_two_nodes_with_an_engine_per_process; rank 0 driving a server started elsewhere for two
    trainer processes, equal to one process, is tests/rl/test_rl_servers_ranks.py's
    test_two_trainer_processes_generate_on_rank_zero_what_one_process_does."""
    with FakeVLLM() as fake:
        want = _one_process(tmp_path, "rl", *RL, *SERVED, f"rollout.server_urls=[{fake.url}]")
    with FakeVLLM() as fake:
        address = fake.url.removeprefix("http://")  # AReaL's host:port
        _sbatch(tmp_path, "rl", *RL, *SERVED, "actor.backend=fsdp:d2", f"rollout.server_urls=[{address}]")
        reloads = [Path(b["kwargs"]["weights_path"]).name for b in fake.bodies("/collective_rpc")]
    got = _rows(tmp_path / "rl-tiny" / "nodes")
    assert reloads == ["v00000000", "v00000001", "v00000002"]
    assert [r["step"] for r in got] == [1, 2]
    for g, w in zip(got, want):
        assert g["completions"] == 32 and g["reward_mean"] == w["reward_mean"]
        assert math.isclose(g["loss"], w["loss"], rel_tol=1e-5, abs_tol=1e-6), g["step"]


@pytest.mark.slow
def test_rl_with_a_server_node_of_its_own(tmp_path):
    """Three nodes: `laden serve` on the first starts the server rollout.server_urls names there (the trainers
    wait for it to answer), the other two train; the servers end with the job. Slow: in the default tier,
    `laden serve` starting the servers named on its node is tests/rollout/test_rollout_server_urls.py's
    test_laden_serve_starts_the_servers_the_config_names_on_this_node, trainers on servers started elsewhere
    tests/rl/test_rl_servers_ranks.py's, and the two-node launches the other tests here."""
    port = free_port()
    out = _sbatch(
        tmp_path, "rl", *RL, *SERVED, "actor.backend=fsdp:d2", f"rollout.server_urls=[localhost:{port}]",
        "cluster.n_nodes=2", "cluster.n_gpus_per_node=1", nodes=3, server_nodes=1, path=stub_vllm_path(tmp_path / "stub"),
    )  # fmt: skip
    assert f"serving: http://localhost:{port}" in out and "laden: servers ended" in out
    rows = _rows(tmp_path / "rl-tiny" / "nodes")
    assert [r["step"] for r in rows] == [1, 2] and all(r["completions"] == 32 for r in rows)
    log = (tmp_path / "rl-tiny" / "nodes" / "logs" / "rollout" / "vllm-0.log").read_text()
    assert f"--port {port}" in log
