"""Two "nodes" on one machine: two torchrun launches of one process each (`--nnodes 2 --nproc-per-node 1
--node-rank {0,1}`, the rendezvous on 127.0.0.1), the way docs/multinode.md launches `laden sft` and
`laden rl` on two machines. The runs share `cluster.fileroot` as the nodes of a cluster share a
filesystem. Each must equal the same run in one process: `laden sft` at fsdp:d2, `laden rl` at fsdp:d2
with a native engine per process, and `laden rl` with a rollout server started elsewhere (a fake vLLM in
this process, attached through `rollout.server_urls`), which rank 0 drives for both nodes."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_servers import FakeVLLM

from laden.config import load_config
from laden.rl.trainer import run_rl
from laden.rollout.servers.process import free_port
from laden.sft.trainer import run_sft

pytestmark = pytest.mark.usefixtures("one_thread")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT_S = 900  # a failure guard only: the runs take seconds


def _two_nodes(tmp_path: Path, job: str, *overrides: str) -> Path:
    """`laden <job>` on two torchrun "nodes" of one process each; the run directory."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    procs, logs = [], [tmp_path / f"node{node}.log" for node in (0, 1)]
    with contextlib.ExitStack() as files:
        for node in (0, 1):
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "laden.cli", job,
                "--config", str(EXAMPLES / f"{job}_tiny.yaml"), "--no-progress", f"cluster.fileroot={tmp_path}",
                "trial_name=nodes2", *overrides,
            ]  # fmt: skip
            out = files.enter_context(open(logs[node], "w"))  # a file, not a pipe: nothing has to drain it
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True))
        try:
            codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n\n".join(t[-6000:] for t in texts)
    assert sum(t.count("done: ") for t in texts) == 1  # rank 0 speaks for both nodes
    return tmp_path / f"{job}-tiny" / "nodes2"


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _one_process(tmp_path: Path, job: str, *overrides: str) -> Path:
    cfg = load_config(
        str(EXAMPLES / f"{job}_tiny.yaml"),
        [f"cluster.fileroot={tmp_path}", "trial_name=one", *overrides],
        job=job,
    )
    return (run_rl if job == "rl" else run_sft)(cfg, progress=False).run_dir


def test_sft_on_two_nodes_equals_one_process(tmp_path):
    steps = ("total_train_steps=3", "train_dataset.batch_size=8", "checkpoint.save_freq_steps=null")
    want = _rows(_one_process(tmp_path, "sft", *steps, "actor.backend=fsdp:d1"))
    got = _rows(_two_nodes(tmp_path, "sft", *steps, "actor.backend=fsdp:d2"))
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for g, w in zip(got, want):
        assert math.isclose(g["loss"], w["loss"], rel_tol=1e-5, abs_tol=1e-6), g["step"]


RL = (
    "total_train_steps=2",
    "checkpoint.save_freq_steps=null",
    "checkpoint.export_hf=false",
    "valid_dataset=null",
)


def test_rl_on_two_nodes_with_an_engine_per_process(tmp_path):
    """native:d2: each node's process generates half of each batch; the same run as two local processes."""
    rows = _rows(_two_nodes(tmp_path, "rl", *RL, "actor.backend=fsdp:d2", "rollout.backend=native:d2"))
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["completions"] == 32 for r in rows) and rows[-1]["trained"] == 64


def test_rl_on_two_nodes_with_a_server_elsewhere_equals_one_process(tmp_path):
    """Rank 0 (node 0) drives the one server for both nodes: it loads each version once, and the run
    generates and trains what one process does."""
    attach = ("rollout.backend=vllm:d1", "actor.weight_update_mode=disk", "gconfig.max_new_tokens=6")
    with FakeVLLM() as fake:
        want = _rows(_one_process(tmp_path, "rl", *RL, *attach, f"rollout.server_urls=[{fake.url}]"))
    with FakeVLLM() as fake:
        address = fake.url.removeprefix("http://")  # AReaL's host:port
        got = _rows(
            _two_nodes(
                tmp_path, "rl", *RL, *attach, "actor.backend=fsdp:d2", f"rollout.server_urls=[{address}]"
            )
        )
        reloads = [Path(b["kwargs"]["weights_path"]).name for b in fake.bodies("/collective_rpc")]
    assert reloads == ["v00000000", "v00000001", "v00000002"]
    assert [r["step"] for r in got] == [1, 2]
    for g, w in zip(got, want):
        assert g["completions"] == 32 and g["reward_mean"] == w["reward_mean"]
        assert math.isclose(g["loss"], w["loss"], rel_tol=1e-4, abs_tol=1e-5), g["step"]
