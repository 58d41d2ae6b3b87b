"""Rollout servers started elsewhere (`rollout.server_urls`, AReaL's `$AREAL_LLM_SERVER_ADDRS`) and where
laden's own listen (`rollout.server_host`): addresses checked at load time, servers that do not answer
named at start-up before the model loads, servers laden starts placed after the trainer's GPUs, and
`laden serve`, which starts a config's servers on a node of their own."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
from fake_servers import FakeVLLM, stub_vllm_path
from repo_paths import ROOT, SUPPORT
from rl_runs import tiny_rl_config

from laden.config import AllocationMode, ConfigError
from laden.config.validate_servers import normalize_server_url
from laden.rl.trainer import run_rl
from laden.rollout.backend import resolve_rollout
from laden.rollout.servers import ServerStartError, start_server_engine
from laden.rollout.servers.launch import device_groups
from laden.rollout.servers.process import free_port

TESTS_DIR = SUPPORT


def _cfg(tmp_path, *overrides):
    return tiny_rl_config(tmp_path, "actor.weight_update_mode=disk", *overrides)


@pytest.mark.parametrize(
    ("written", "url"),
    [
        ("10.0.0.5:8000", "http://10.0.0.5:8000"),  # AReaL's host:port
        ("http://node7:30000/", "http://node7:30000"),
        ("https://[fe80::1]:443", "https://[fe80::1]:443"),
    ],
)
def test_a_server_address_is_a_url_or_host_port(written, url):
    assert normalize_server_url(written) == url


@pytest.mark.parametrize(
    "written", ["node7", "http://node7", "node7:http", "ftp://node7:21", "node7:8000/v1"]
)
def test_an_address_without_host_and_port_is_refused(written):
    with pytest.raises(ValueError, match="host and a port|without a path"):
        normalize_server_url(written)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.backend=vllm:d2", "rollout.server_urls=[node7:8000]"], r"has d=2 but rollout.server_urls lists 1 .* vllm:d1"),
        (["rollout.server_urls=[node7:8000]"], r"generates in the trainer's processes; set rollout.backend: vllm:d1"),
        (["rollout.backend=vllm:d1", "rollout.server_urls=[node7]"], r"rollout.server_urls\[0\]='node7': .*host and a port"),
        (["rollout.backend=vllm:d1", "rollout.server_host=' '", "cluster.n_gpus_per_node=2"], r"rollout.server_host=' ' names no address"),
    ],
)  # fmt: skip
def test_server_settings_that_cannot_work_are_refused_at_load(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(tmp_path, *overrides)


def test_attached_servers_take_none_of_the_clusters_gpus(tmp_path):
    """vllm:d4 beside fsdp:d1 on one GPU: refused when laden would start the servers, fine when they run elsewhere."""
    with pytest.raises(ConfigError, match="needs 4 GPUs of its own"):
        _cfg(tmp_path, "rollout.backend=vllm:d4", "cluster.n_gpus_per_node=1")
    urls = "[a:1,b:2,c:3,d:4]"
    cfg = _cfg(
        tmp_path, "rollout.backend=vllm:d4", "cluster.n_gpus_per_node=1", f"rollout.server_urls={urls}"
    )
    assert resolve_rollout(cfg).attached_urls(cfg) == ["http://a:1", "http://b:2", "http://c:3", "http://d:4"]


def test_areal_environment_variable_names_the_servers(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_LLM_SERVER_ADDRS", "10.0.0.5:8000,10.0.0.6:8000")
    with pytest.raises(ConfigError, match=r"has d=1 but \$AREAL_LLM_SERVER_ADDRS lists 2"):
        _cfg(tmp_path, "rollout.backend=vllm:d1")
    cfg = _cfg(tmp_path, "rollout.backend=vllm:d2", "cluster.n_gpus_per_node=1")
    assert resolve_rollout(cfg).attached_urls(cfg) == ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
    # the config's own list wins
    cfg = _cfg(tmp_path, "rollout.backend=vllm:d1", "rollout.server_urls=[node7:9000]")
    assert resolve_rollout(cfg).attached_urls(cfg) == ["http://node7:9000"]


def test_a_listening_address_without_servers_to_start_is_named_as_ignored(tmp_path):
    with pytest.warns(
        UserWarning, match=r"rollout.server_host='0.0.0.0' is ignored: rollout.backend='native:d1'"
    ):
        _cfg(tmp_path, "rollout.server_host=0.0.0.0")
    with warnings.catch_warnings():  # laden rl's own servers, and laden serve's of rollout.server_urls
        warnings.simplefilter("error")
        _cfg(tmp_path, "rollout.backend=vllm:d1", "rollout.server_host=0.0.0.0", "cluster.n_gpus_per_node=2")
        _cfg(
            tmp_path,
            "rollout.backend=vllm:d1",
            "rollout.server_urls=[node7:9000]",
            "rollout.server_host=0.0.0.0",
        )


def test_a_server_that_does_not_answer_is_named_before_the_model_loads(tmp_path, monkeypatch):
    import laden.rl.trainer as trainer

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the servers were checked")

    monkeypatch.setattr(trainer, "load_model", never)
    with FakeVLLM() as fake:
        dead = f"127.0.0.1:{free_port()}"  # nothing listens there
        urls = f"rollout.server_urls=[{fake.url},{dead}]"
        cfg = _cfg(tmp_path, "rollout.backend=vllm:d2", urls, "rollout.setup_timeout=0")
        with pytest.raises(ServerStartError, match=f"no server answers at http://{dead} "):
            run_rl(cfg, progress=False)


class _Loading(FakeVLLM):
    """A fake vLLM that answers its health check with 503 (loading) the first `loading` times."""

    loading = 2

    def route(self, call):
        if call.path == "/health" and self.loading:
            self.loading -= 1
            return 503, {"detail": "loading"}
        return super().route(call)


def test_servers_still_loading_are_waited_for_up_to_the_setup_timeout():
    from laden.rollout.servers.launch import attach_servers

    with _Loading() as fake:
        with pytest.raises(ServerStartError, match=f"no server answers at {fake.url} .*HTTP 503"):
            attach_servers([fake.url], health_path="/health")  # no wait: the first answer counts
        (handle,) = attach_servers([fake.url], health_path="/health", wait_s=120)  # a failure guard only
        assert handle.url == fake.url and fake.loading == 0
        assert len(fake.bodies("/health")) == 3  # loading twice, then ready


def test_servers_laden_starts_listen_on_rollout_server_host(tmp_path, monkeypatch):
    """The stand-in `vllm` package's api_server is the fake vLLM: it binds what laden passes as --host;
    laden itself reaches it on loopback."""
    import asyncio

    monkeypatch.setenv("PYTHONPATH", stub_vllm_path(tmp_path / "stub"))
    cfg = _cfg(
        tmp_path, "rollout.backend=vllm:d1", "rollout.server_host=0.0.0.0", "cluster.n_gpus_per_node=2"
    )
    engine = start_server_engine(
        AllocationMode.parse("vllm:d1"), model_dir=tmp_path, cfg=cfg, python=sys.executable,
        log_dir=tmp_path / "logs",
    )  # fmt: skip
    try:
        assert engine.urls[0].startswith("http://127.0.0.1:")
        assert "--host 0.0.0.0" in (tmp_path / "logs" / "vllm-0.log").read_text()
    finally:
        asyncio.run(engine.close())


def test_servers_laden_starts_take_the_gpus_after_the_trainers(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert device_groups(1, 1, backend="vllm", first=1) == [["1"]]  # one trainer process on GPU 0
    assert device_groups(2, 2, backend="vllm", first=4) == [
        ["4", "5"],
        ["6", "7"],
    ]  # torchrun --nproc-per-node 4
    with pytest.raises(
        ValueError, match=r"needs 6 GPUs beside the 4 of the trainer processes .* rollout.server_urls"
    ):
        device_groups(3, 2, backend="sglang", first=4)


def test_laden_serve_starts_the_servers_the_config_names_on_this_node(tmp_path):
    """`laden serve` on a generation node: of rollout.server_urls, the servers this node's names are in, on
    their ports, listening on every address; SIGTERM ends them and the command."""
    import select
    import signal
    import subprocess
    import urllib.request

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([stub_vllm_path(tmp_path / "stub"), str(ROOT)])}
    urls = f"[127.0.0.1:{port},localhost:{port + 1},gen7:{port}]"  # gen7: another node's server
    cmd = [
        sys.executable, "-m", "laden.cli", "serve", "--config", str(ROOT / "examples" / "rl_tiny.yaml"),
        f"cluster.fileroot={tmp_path}", "rollout.backend=vllm:d3", f"rollout.server_urls={urls}",
        "rollout.server_host=0.0.0.0", "actor.weight_update_mode=disk",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("serving:"):
            ready, _, _ = select.select([proc.stdout], [], [], 300)  # a failure guard only
            assert ready and proc.poll() is None, (
                proc.stderr.read()[-4000:] if proc.poll() is not None else "no answer"
            )
            line = proc.stdout.readline()
        assert line.split() == ["serving:", f"http://127.0.0.1:{port}", f"http://localhost:{port + 1}"]
        for p in (port, port + 1):
            with urllib.request.urlopen(f"http://127.0.0.1:{p}/health", timeout=30) as answer:
                assert answer.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "--host 0.0.0.0" in (tmp_path / "rl-tiny" / "run0" / "logs" / "rollout" / "vllm-1.log").read_text()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([], r"rollout.backend='native:d1' generates in the trainer's processes"),
        (["rollout.backend=vllm:d1", "cluster.n_gpus_per_node=2"], r"lists none; set it to every server's address"),
        (["rollout.backend=vllm:d1", "rollout.server_urls=[gen7:8000]"], r"names this node \(127.0.0.1, gen0\); run laden serve on the nodes"),
        (["rollout.backend=vllm:d1", "rollout.server_urls=[gen0:8000]"], r"cannot be reached at http://gen0:8000 .* rollout.server_host: 0.0.0.0"),
    ],
)  # fmt: skip
def test_laden_serve_says_what_to_fix_before_starting_anything(tmp_path, overrides, message):
    from laden.rollout.servers.serve import serve

    with pytest.raises(ValueError, match=message):
        serve(_cfg(tmp_path, *overrides), announce=print, names={"gen0", "127.0.0.1"})
