"""`laden rl` with rollout servers under a two-process trainer (gloo, CPU): rank 0 drives every server
and generates each whole batch, the data-parallel ranks train on equal parts of it, and every server
gets each weight version exactly once. The servers are two fake vLLMs (`fake_servers.py`) in the test
process, attached through `rollout.server_urls` as servers started elsewhere would be; their tokens are
a fixed function of the prompt and their log-probs of the number of weight loads, so two processes must
generate exactly what one does."""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path

import pytest
from fake_servers import FakeVLLM, stub_vllm_path
from rl_runs import tiny_rl_config

from laden.rl.trainer import run_rl

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(root: Path, actor: str, urls: list[str]):
    host_port = ",".join(u.removeprefix("http://") for u in urls)  # AReaL's form of an address
    return tiny_rl_config(
        root, "total_train_steps=2", f"actor.backend={actor}", f"rollout.backend=vllm:d{len(urls)}",
        f"rollout.server_urls=[{host_port}]", "actor.weight_update_mode=disk", "gconfig.max_new_tokens=6",
        "checkpoint.export_hf=false",
    )  # fmt: skip


def _rl_rank(rank: int, world_size: int, root: str, urls: list[str]) -> dict:
    """A worker of `tests/support/workers.py`: one rank of `laden rl` at fsdp:d2 on the servers at `urls`."""
    result = run_rl(_cfg(Path(root), "fsdp:d2", urls), progress=False)
    rows = (
        [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        if rank == 0
        else []
    )
    return {"rows": rows, "rewards": result.rewards}


def _served(fakes: list[FakeVLLM]) -> dict:
    return {
        "reloads": [
            [Path(b["kwargs"]["weights_path"]).name for b in f.bodies("/collective_rpc")] for f in fakes
        ],
        "versions": [[b["new_version"] for b in f.bodies("/update_weight_version")] for f in fakes],
        "completions": [len(f.bodies("/v1/completions")) for f in fakes],
        "pauses": [len(f.bodies("/pause")) for f in fakes],
    }


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: the same run in one process (fsdp:d1) on two fresh fake servers."""
    with FakeVLLM() as a, FakeVLLM() as b:
        result = run_rl(_cfg(tmp_path_factory.mktemp("d1"), "fsdp:d1", [a.url, b.url]), progress=False)
        served = _served([a, b])
    return [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()], served


def test_two_trainer_processes_generate_on_rank_zero_what_one_process_does(tmp_path, one_process):
    from workers import run_workers

    with FakeVLLM() as a, FakeVLLM() as b:
        out = run_workers(_rl_rank, 2, str(tmp_path), [a.url, b.url])
        served = _served([a, b])
    rows, (want_rows, want_served) = out[0]["rows"], one_process
    # every server: the trainer's first weights, then one version per step, each loaded once (one client)
    assert served["reloads"] == [["v00000000", "v00000001", "v00000002"]] * 2
    assert served["versions"] == [["0", "1", "2"]] * 2
    assert served == want_served  # the same requests, spread over the same servers
    assert all(n > 0 for n in served["completions"])
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/accuracy" in rows[0]  # held out, through rank 0
    for got, want in zip(rows, want_rows):
        assert got.get("eval/accuracy") == want.get("eval/accuracy")
        if got["step"] == 0:
            continue
        assert got["completions"] == 32 and got["stale_dropped"] == 0  # the whole batch, dealt to both ranks
        assert got["reward_mean"] == want["reward_mean"] and got["trained"] == want["trained"]
        assert math.isclose(got["loss"], want["loss"], rel_tol=1e-4, abs_tol=1e-5), got["step"]
    assert out[0]["rewards"] == out[1]["rewards"]  # every rank reports the one run


def _launching_rank(rank: int, world_size: int, root: str) -> dict:
    """A worker: one rank of `laden rl` at fsdp:d2 with `vllm:d1` and no server_urls: laden starts the server."""
    cfg = tiny_rl_config(
        Path(root), "total_train_steps=1", "actor.backend=fsdp:d2", "rollout.backend=vllm:d1",
        "cluster.n_gpus_per_node=3", "actor.weight_update_mode=disk", "gconfig.max_new_tokens=4",
        "checkpoint.export_hf=false", "valid_dataset=null",
    )  # fmt: skip
    result = run_rl(cfg, progress=False)
    rows = (
        [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        if rank == 0
        else []
    )
    return {"rows": rows, "run_dir": str(result.run_dir)}


def test_laden_starts_the_servers_once_from_rank_zero_and_ends_them(tmp_path, monkeypatch):
    """The stand-in `vllm` package's api_server is the fake vLLM: one server process for both ranks."""
    from workers import run_workers

    monkeypatch.setenv("PYTHONPATH", stub_vllm_path(tmp_path / "stub"))
    monkeypatch.delenv("LADEN_VLLM_PYTHON", raising=False)
    out = run_workers(_launching_rank, 2, str(tmp_path / "runs"))
    assert [r["step"] for r in out[0]["rows"]] == [1] and out[0]["rows"][0]["completions"] == 32
    logs = sorted(p.name for p in (Path(out[0]["run_dir"]) / "logs" / "rollout").iterdir())
    assert logs == ["vllm-0.log"]  # one server, started once
    command = (Path(out[0]["run_dir"]) / "logs" / "rollout" / "vllm-0.log").read_text().splitlines()[0]
    port = int(command.split("--port ")[1].split()[0])
    with pytest.raises(OSError):  # ended with the run
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
