"""Server rollout backends (vLLM, SGLang) against fake servers in this process; process handling.

The fakes (`fake_servers.py`) speak the request and response shapes of vLLM 0.32 and SGLang and
check what laden sends; the real-server tier is `test_rollout_server_vllm.py` (`-m server`).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from fake_servers import FakeSGLang, FakeVLLM, logprob_at, stub_vllm_path, token_at

from laden.config.alloc import AllocationMode
from laden.rollout.base import GenerationRequest, GenerationResult, RolloutEngine, SamplingParams
from laden.rollout.servers import (
    SGLangEngine,
    SGLangServerConfig,
    VLLMEngine,
    VLLMServerConfig,
    start_server_engine,
)
from laden.rollout.servers.http import ServerRequestError
from laden.rollout.servers.launch import LaunchSpec, device_groups, launch_servers
from laden.rollout.servers.process import (
    ServerKind,
    ServerNotInstalledError,
    ServerProcess,
    ServerStartError,
    check_installed,
)
from laden.rollout.servers.sglang import sglang_command
from laden.rollout.servers.vllm import vllm_command

PROMPT = (5, 6, 7, 8)


def run(coro):
    return asyncio.run(coro)


async def collect(engine, requests) -> dict[tuple[str, int], GenerationResult]:
    results = {}
    async for r in engine.generate(requests):
        key = (r.rid, r.sample_index)
        assert key not in results, f"{key} came back twice"
        results[key] = r
    return results


def expected(prompt, count, index=0, weights=0, offset=0):
    """Tokens and log-probs the fake generates for `prompt` (see fake_servers.token_at)."""
    ids = [token_at(list(prompt), j, index) for j in range(count)]
    return ids, [logprob_at(weights, len(prompt) + j + offset) for j in range(count)]


@pytest.fixture
def fake_vllm():
    with FakeVLLM() as fake:
        yield fake


@pytest.fixture
def fake_sglang():
    with FakeSGLang() as fake:
        yield fake


# ---------------------------------------------------------------- generate


def test_vllm_generate_returns_ids_logprobs_versions_and_stop_reasons(fake_vllm):
    stop_tok = token_at(list(PROMPT), 2, 0)

    async def main():
        engine = VLLMEngine.attach([fake_vllm.url], initial_version=3)
        assert isinstance(engine, RolloutEngine)
        sampling = SamplingParams(
            max_new_tokens=6, temperature=0.7, stop_token_ids=(stop_tok,), min_new_tokens=1
        )
        requests = [
            GenerationRequest(rid="a", input_ids=PROMPT, sampling=sampling, n_samples=2),
            GenerationRequest(rid="b", input_ids=(9, 9), sampling=SamplingParams(max_new_tokens=4)),
        ]
        results = await collect(engine, requests)
        await engine.close()
        return results

    results = run(main())
    assert sorted(results) == [("a", 0), ("a", 1), ("b", 0)]
    a0, a1, b0 = results["a", 0], results["a", 1], results["b", 0]
    assert (a0.output_ids, a0.output_logprobs) == expected(PROMPT, 3)  # ends at (and keeps) the stop token
    assert a0.stop_reason == "stop" and a0.output_versions == [3, 3, 3]
    assert a1.output_ids == expected(PROMPT, 6, index=1)[0] and a1.stop_reason == "length"
    assert (b0.output_ids, b0.output_logprobs) == expected((9, 9), 4) and b0.stop_reason == "length"
    # the two requests run concurrently: either may reach the server first
    (body,) = [b for b in fake_vllm.bodies("/v1/completions") if b["prompt"] == list(PROMPT)]
    assert body["n"] == 2 and body["model"] == "fake-model"
    assert (body["max_tokens"], body["min_tokens"], body["temperature"]) == (6, 1, 0.7)
    assert (body["top_p"], body["top_k"], body["stop_token_ids"], body["ignore_eos"]) == (
        1.0,
        0,
        [stop_tok],
        False,
    )
    assert body["logprobs"] == 0 and body["return_token_ids"] is True


def test_vllm_greedy_asks_once_and_copies_for_n_samples(fake_vllm):
    request = GenerationRequest(
        rid="g", input_ids=PROMPT, sampling=SamplingParams(greedy=True, max_new_tokens=3), n_samples=3
    )

    async def main():
        engine = VLLMEngine.attach([fake_vllm.url])
        results = await collect(engine, [request])
        await engine.close()
        return results

    results = run(main())
    assert [results["g", i].output_ids for i in range(3)] == [expected(PROMPT, 3)[0]] * 3
    (body,) = fake_vllm.bodies("/v1/completions")
    assert body["n"] == 1 and body["temperature"] == 0.0


def test_vllm_ignore_eos_sends_no_stops(fake_vllm):
    sampling = SamplingParams(max_new_tokens=2, ignore_eos=True, stop_token_ids=(21,), stop=("x",))

    async def main():
        engine = VLLMEngine.attach([fake_vllm.url])
        await collect(engine, [GenerationRequest(rid="r", input_ids=PROMPT, sampling=sampling)])
        await engine.close()

    run(main())
    (body,) = fake_vllm.bodies("/v1/completions")
    assert (body["ignore_eos"], body["stop"], body["stop_token_ids"]) == (True, [], [])


def test_vllm_warns_that_truncated_sampling_changes_logprobs(fake_vllm):
    sampling = SamplingParams(max_new_tokens=2, top_k=5)

    async def main():
        engine = VLLMEngine.attach([fake_vllm.url])
        await collect(engine, [GenerationRequest(rid="r", input_ids=PROMPT, sampling=sampling)])
        await engine.close()

    with pytest.warns(UserWarning, match="top_k=5.*truncated distribution"):
        run(main())


def test_server_abort_without_pause_is_reported_as_abort(fake_vllm):
    fake_vllm.core.abort_everything = True

    async def main():
        engine = VLLMEngine.attach([fake_vllm.url])
        results = await collect(engine, [GenerationRequest(rid="r", input_ids=PROMPT)])
        await engine.close()
        return results

    result = run(main())["r", 0]
    assert result.stop_reason == "abort" and result.output_ids == []


def test_sglang_generate_sends_a_batch_and_parses_meta_info(fake_sglang):
    stop_tok = token_at(list(PROMPT), 1, 1)
    sampling = SamplingParams(max_new_tokens=5, temperature=0.9, top_p=0.8, stop_token_ids=(stop_tok,))

    async def main():
        engine = SGLangEngine.attach([fake_sglang.url])
        results = await collect(
            engine, [GenerationRequest(rid="s", input_ids=PROMPT, sampling=sampling, n_samples=2)]
        )
        await engine.close()
        return results

    results = run(main())
    assert (results["s", 0].output_ids, results["s", 0].output_logprobs) == expected(PROMPT, 5)
    assert results["s", 0].stop_reason == "length"
    assert (
        results["s", 1].output_ids == expected(PROMPT, 2, index=1)[0]
        and results["s", 1].stop_reason == "stop"
    )
    (body,) = fake_sglang.bodies("/generate")
    assert body["input_ids"] == [list(PROMPT)] * 2 and body["return_logprob"] is True
    params = body["sampling_params"]
    assert (params["max_new_tokens"], params["temperature"], params["top_p"], params["top_k"]) == (
        5,
        0.9,
        0.8,
        -1,
    )


# ---------------------------------------------------------------- pause / update / resume


def _paused_update_scenario(fake, engine_cls, update_source, *, n_samples=2, drain_s=5.0):
    """Generate 8 tokens; the fake blocks after 3 until pause; update to version 7; resume."""
    fake.core.block_after = 3
    request = GenerationRequest(
        rid="p",
        input_ids=PROMPT,
        sampling=SamplingParams(max_new_tokens=8, min_new_tokens=5),
        n_samples=n_samples,
    )

    async def main():
        engine = engine_cls.attach([fake.url], pause_drain_s=drain_s)
        consumer = asyncio.ensure_future(collect(engine, [request]))
        await asyncio.to_thread(fake.core.wait_blocked, 1)
        await engine.pause()
        assert engine.paused
        await engine.update_weights(update_source, 7)
        assert engine.version == 7
        await engine.resume()
        results = await asyncio.wait_for(consumer, timeout=30)
        await engine.close()
        return results

    return run(main())


def test_vllm_pause_update_resume_tags_each_token_with_its_version(fake_vllm, tmp_path):
    results = _paused_update_scenario(fake_vllm, VLLMEngine, SimpleNamespace(type="disk", path=str(tmp_path)))
    for i in range(2):
        r = results["p", i]
        head_ids, head_lps = expected(PROMPT, 3, index=i)
        tail_ids, tail_lps = expected((*PROMPT, *head_ids), 5, weights=1)
        assert r.output_ids == head_ids + tail_ids and r.output_logprobs == head_lps + tail_lps
        assert r.output_versions == [0] * 3 + [7] * 5 and r.stop_reason == "length"
    assert fake_vllm.paths() == [
        "/v1/completions",
        "/pause",
        "/collective_rpc",
        "/update_weight_version",
        "/reset_prefix_cache",
        "/resume",
        "/v1/completions",
        "/v1/completions",
    ]
    pause = next(c for c in fake_vllm.core.calls if c.path == "/pause")
    assert pause.query == {"mode": ["abort"]}
    assert fake_vllm.bodies("/collective_rpc") == [
        {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}
    ]
    assert fake_vllm.bodies("/update_weight_version") == [{"new_version": "7"}]
    continuations = fake_vllm.bodies("/v1/completions")[1:]
    assert all(len(b["prompt"]) == len(PROMPT) + 3 and b["n"] == 1 for b in continuations)
    assert all((b["max_tokens"], b["min_tokens"]) == (5, 2) for b in continuations)


def test_sglang_pause_update_resume_tags_each_token_with_its_version(fake_sglang, tmp_path):
    results = _paused_update_scenario(fake_sglang, SGLangEngine, str(tmp_path), n_samples=1)
    r = results["p", 0]
    head_ids, _ = expected(PROMPT, 3)
    assert r.output_ids == head_ids + expected((*PROMPT, *head_ids), 5)[0]
    assert r.output_versions == [0] * 3 + [7] * 5
    assert fake_sglang.paths() == [
        "/generate",
        "/pause_generation",
        "/update_weights_from_disk",
        "/continue_generation",
        "/generate",
    ]
    (update,) = fake_sglang.bodies("/update_weights_from_disk")
    assert update["model_path"] == str(tmp_path) and update["weight_version"] == "7"


def test_request_held_by_a_paused_server_gets_the_new_version(fake_vllm, tmp_path):
    fake_vllm.core.hold_on_pause = True  # the server queues it instead of aborting it
    results = _paused_update_scenario(fake_vllm, VLLMEngine, str(tmp_path), n_samples=1, drain_s=0.2)
    r = results["p", 0]
    ids, lps = expected(PROMPT, 8, weights=1)
    assert (r.output_ids, r.output_logprobs) == (ids, lps)
    assert r.output_versions == [7] * 8


def test_update_weights_while_running_pauses_and_resumes(fake_vllm, tmp_path):
    async def main():
        engine = VLLMEngine.attach([fake_vllm.url])
        await engine.update_weights(tmp_path, 2)
        assert not engine.paused and engine.version == 2
        await engine.close()

    run(main())
    assert fake_vllm.paths() == [
        "/pause",
        "/collective_rpc",
        "/update_weight_version",
        "/reset_prefix_cache",
        "/resume",
    ]


def test_in_memory_weights_are_refused_with_the_accepted_sources(fake_vllm):
    async def main():
        engine = VLLMEngine.attach([fake_vllm.url])
        try:
            await engine.update_weights([("lm_head.weight", None)], 1)
        finally:
            await engine.close()

    with pytest.raises(ValueError, match="type='disk'.*type='xccl'"):
        run(main())


def test_sglang_failed_update_raises_with_the_server_message(fake_sglang, tmp_path):
    fake_sglang.fail_update = True

    async def main():
        engine = SGLangEngine.attach([fake_sglang.url])
        try:
            await engine.update_weights(str(tmp_path), 1)
        finally:
            await engine.close()

    with pytest.raises(RuntimeError, match="update_weights_from_disk failed: fake: shapes do not match"):
        run(main())


def test_broadcast_updates_init_the_group_once(fake_vllm, fake_sglang):
    source = SimpleNamespace(
        type="xccl",
        master_address="127.0.0.1",
        master_port=29555,
        world_size=2,
        names=["lm_head.weight"],
        dtypes=["bfloat16"],
        shapes=[[104, 128]],
    )

    async def main():
        for engine in (VLLMEngine.attach([fake_vllm.url]), SGLangEngine.attach([fake_sglang.url])):
            await engine.update_weights(source, 1)
            await engine.update_weights(source, 2)
            await engine.close()

    run(main())
    vllm_updates = [p for p in fake_vllm.paths() if p not in ("/pause", "/resume")]
    assert (
        vllm_updates
        == ["/init_weight_transfer_engine"]
        + ["/start_weight_update", "/update_weights", "/finish_weight_update"] * 2
    )
    assert fake_vllm.bodies("/init_weight_transfer_engine")[0]["init_info"]["rank_offset"] == 1
    assert fake_vllm.bodies("/update_weights")[0]["update_info"]["dtype_names"] == ["bfloat16"]
    assert fake_vllm.bodies("/finish_weight_update") == [{"weight_version": "1"}, {"weight_version": "2"}]
    sglang_updates = [
        p for p in fake_sglang.paths() if p not in ("/pause_generation", "/continue_generation")
    ]
    assert sglang_updates == ["/init_weights_update_group"] + ["/update_weights_from_distributed"] * 2
    (init,) = fake_sglang.bodies("/init_weights_update_group")
    assert (init["master_port"], init["world_size"], init["backend"]) == (29555, 2, "nccl")


def test_requests_round_robin_over_data_parallel_servers_and_pause_reaches_all():
    with FakeVLLM() as s0, FakeVLLM() as s1:
        requests = [
            GenerationRequest(rid=str(i), input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=1))
            for i in range(4)
        ]

        async def main():
            engine = start_server_engine(
                AllocationMode.parse("vllm:d2"), model_dir="unused", urls=[s0.url, s1.url]
            )
            await collect(engine, requests)
            await engine.pause()
            await engine.resume()
            await engine.close()

        run(main())
        for fake in (s0, s1):
            assert fake.paths() == ["/v1/completions"] * 2 + ["/pause", "/resume"]


def test_close_aborts_only_this_engines_calls_on_an_attached_server(fake_vllm):
    fake_vllm.core.block_after = 2
    request = GenerationRequest(rid="c", input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=9))

    async def main():
        engine = VLLMEngine.attach([fake_vllm.url])
        consumer = asyncio.ensure_future(collect(engine, [request]))
        await asyncio.to_thread(fake_vllm.core.wait_blocked, 1)
        await engine.close()
        return await asyncio.wait_for(consumer, timeout=30)

    result = run(main())["c", 0]
    assert result.stop_reason == "abort" and result.output_ids == expected(PROMPT, 2)[0]
    (abort,) = fake_vllm.bodies("/abort_requests")
    (completion,) = fake_vllm.bodies("/v1/completions")
    rid = completion["request_id"]
    assert abort == {"request_ids": [f"cmpl-{rid}-0", rid]}
    assert "/pause" not in fake_vllm.paths()  # the shared server is not paused


# ---------------------------------------------------------------- sleep / wake


def test_vllm_sleep_and_wake_keep_the_engine_paused_state(fake_vllm):
    async def main():
        engine = VLLMEngine.attach([fake_vllm.url])
        await engine.sleep()
        assert engine.paused
        await engine.wake()
        assert not engine.paused
        await engine.close()

    run(main())
    assert fake_vllm.paths() == ["/pause", "/release_kv_cache_memory", "/wake_up", "/pause", "/resume"]


def test_sleep_with_weights_needs_an_update_before_resume(fake_vllm, tmp_path):
    async def main():
        engine = VLLMEngine.attach([fake_vllm.url])
        await engine.sleep(weights=True)
        await engine.wake()
        assert engine.paused
        with pytest.raises(RuntimeError, match="without update_weights"):
            await engine.resume()
        await engine.update_weights(tmp_path, 1)
        await engine.resume()
        await engine.close()

    run(main())
    sleep = next(c for c in fake_vllm.core.calls if c.path == "/sleep")
    assert sleep.query == {"level": ["2"], "mode": ["abort"]}
    assert fake_vllm.paths()[-4:] == [
        "/collective_rpc",
        "/update_weight_version",
        "/reset_prefix_cache",
        "/resume",
    ]


def test_sglang_sleep_releases_tagged_memory(fake_sglang):
    async def main():
        engine = SGLangEngine.attach([fake_sglang.url])
        await engine.sleep()
        await engine.wake()
        await engine.sleep(weights=True)
        await engine.close()

    run(main())
    assert fake_sglang.bodies("/release_memory_occupation") == [
        {"tags": ["kv_cache"]},
        {"tags": ["kv_cache", "weights"]},
    ]
    assert fake_sglang.paths()[:5] == [
        "/pause_generation",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/pause_generation",
        "/continue_generation",
    ]


def test_dev_endpoint_missing_names_dev_mode(fake_vllm):
    fake_vllm.dev_mode = False

    async def main():
        engine = VLLMEngine.attach([fake_vllm.url])
        try:
            await engine.pause()
        finally:
            await engine.close()

    with pytest.raises(ServerRequestError, match="VLLM_SERVER_DEV_MODE=1"):
        run(main())


# ---------------------------------------------------------------- config and commands


def test_server_commands_bind_loopback_and_carry_the_settings():
    argv, env = vllm_command(
        "py", "/m", port=1234, tp=2, cfg=VLLMServerConfig(dtype="float32", max_model_len=256)
    )
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    text = " ".join(argv)
    assert "--host 127.0.0.1 --port 1234 --tensor-parallel-size 2 --dtype float32" in text
    assert "--logprobs-mode processed_logprobs" in text and "--max-model-len 256" in text
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    argv, env = sglang_command("py", "/m", port=99, tp=4, cfg=SGLangServerConfig(mem_fraction_static=0.7))
    assert " ".join(argv).startswith(
        "py -m sglang.launch_server --model-path /m --host 127.0.0.1 --port 99 --tp 4"
    )
    assert "--mem-fraction-static 0.7" in " ".join(argv) and env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "false"


def test_start_server_engine_rejects_modes_it_cannot_serve():
    with pytest.raises(ValueError, match="not a server backend.*native:d1"):
        start_server_engine(AllocationMode.parse("native:d1"), model_dir="m")
    with pytest.raises(ValueError, match="remove c2"):
        start_server_engine(AllocationMode.parse("vllm:d1c2"), model_dir="m")
    with pytest.raises(ValueError, match="d=2 but 1 server URLs"):
        start_server_engine(AllocationMode.parse("sglang:d2"), model_dir="m", urls=["http://127.0.0.1:1"])


def test_device_groups_split_the_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert device_groups(2, 2, backend="vllm") == [["4", "5"], ["6", "7"]]
    assert device_groups(1, 4, backend="vllm") == []
    with pytest.raises(ValueError, match="needs 6 GPUs"):
        device_groups(3, 2, backend="sglang")


# ---------------------------------------------------------------- processes


def test_not_installed_names_native_and_the_install_command(monkeypatch):
    monkeypatch.delenv("LADEN_VLLM_PYTHON", raising=False)
    with pytest.raises(ServerNotInstalledError) as err:
        VLLMEngine.launch("model", cfg=VLLMServerConfig(python=sys.executable))
    assert "pip install vllm" in str(err.value) and "rollout.backend: native:d1" in str(err.value)
    monkeypatch.setenv("LADEN_SGLANG_PYTHON", "/no/such/python")
    with pytest.raises(ServerNotInstalledError) as err:
        start_server_engine(AllocationMode.parse("sglang:d1"), model_dir="model")
    message = str(err.value)
    assert "/no/such/python" in message and 'pip install "sglang[all]"' in message and "native:d1" in message


def test_server_dying_at_startup_shows_its_log_tail(tmp_path):
    kind = ServerKind(
        name="fake", module="json", install_hint="pip install fake", python_env_var="LADEN_FAKE_PYTHON"
    )
    script = (
        "import sys; print('loading model'); print('ValueError: --dtype bogus is not a dtype'); sys.exit(3)"
    )
    spec = LaunchSpec(
        kind=kind, log_dir=str(tmp_path), command=lambda python, port: ([python, "-c", script], {})
    )
    check_installed(sys.executable, kind)
    with pytest.raises(ServerStartError) as err:
        launch_servers(spec, dp=1, tp=1)
    message = str(err.value)
    assert "exited with code 3" in message and "--dtype bogus is not a dtype" in message
    assert str(tmp_path / "fake-0.log") in message


def _child_server_script(pid_file: Path, *, ignore_term: bool) -> str:
    """An http.server on a port given in argv that also starts a child process (its own worker)."""
    return textwrap.dedent(
        f"""
        import http.server, signal, subprocess, sys
        if {ignore_term!r}:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN) if {ignore_term!r} else None; time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()
        """
    )


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("ignore_term", [False, True], ids=["sigterm", "needs-sigkill"])
def test_close_ends_the_whole_process_group(tmp_path, ignore_term):
    from laden.rollout.servers.process import free_port

    port = free_port()
    pid_file = tmp_path / "child.pid"
    script = _child_server_script(pid_file, ignore_term=ignore_term)
    server = ServerProcess.start(
        [sys.executable, "-c", script, str(port)], name="http", log_path=tmp_path / "http.log", grace_s=0.5
    )
    server.wait_healthy(f"http://127.0.0.1:{port}/", timeout_s=30)
    child = int(pid_file.read_text())
    assert os.getpgid(child) == server.pid  # the worker is in the server's group
    started = time.monotonic()
    server.close()
    assert server.poll() is not None and _gone(server.pid)
    deadline = time.monotonic() + 5
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child), "the server's child outlived close()"
    assert (time.monotonic() - started >= 0.5) == ignore_term
    server.close()  # idempotent


def test_server_still_running_at_interpreter_exit_is_ended(tmp_path):
    pid_file = tmp_path / "server.pid"
    program = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from laden.rollout.servers.process import ServerProcess
        p = ServerProcess.start([sys.executable, "-c", "import time; time.sleep(600)"], name="s",
                                log_path=Path({str(tmp_path / "s.log")!r}), grace_s=1)
        Path({str(pid_file)!r}).write_text(str(p.pid))
        """
    )
    subprocess.run([sys.executable, "-c", program], check=True, timeout=60)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), "a server outlived the interpreter that started it"


def test_launch_starts_a_server_process_and_close_ends_it(tmp_path, monkeypatch):
    """Full launch path with a stand-in `vllm` package whose api_server is the fake vLLM."""
    monkeypatch.setenv("PYTHONPATH", stub_vllm_path(tmp_path / "stub"))
    mode = AllocationMode.parse("vllm:d1t1")
    engine = start_server_engine(mode, model_dir=tmp_path, python=sys.executable, log_dir=tmp_path / "logs")
    try:
        assert engine.urls[0].startswith("http://127.0.0.1:")
        (server,) = engine.servers
        assert server.process is not None and server.process.poll() is None
        results = run(
            collect(
                engine,
                [GenerationRequest(rid="x", input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=2))],
            )
        )
        assert results["x", 0].output_ids == expected(PROMPT, 2)[0]
        log = (tmp_path / "logs" / "vllm-0.log").read_text()
        assert "--host 127.0.0.1" in log and "--logprobs-mode processed_logprobs" in log
    finally:
        run(engine.close())
    assert server.process.poll() is not None
    with pytest.raises(RuntimeError, match="after close"):
        run(engine.pause())


def test_engine_can_be_driven_from_successive_event_loops(fake_vllm):
    engine = VLLMEngine.attach([fake_vllm.url])
    run(engine.pause())
    run(engine.resume())
    request = GenerationRequest(rid="l", input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=2))
    assert run(collect(engine, [request]))["l", 0].output_ids == expected(PROMPT, 2)[0]
    run(engine.close())


def test_start_server_engine_takes_sglang_settings_from_the_run_config(monkeypatch, tmp_path):
    from laden.config.schema import LadenConfig

    seen = {}

    def fake_launch(model_dir, *, dp, tp, cfg, initial_version, **kwargs):
        seen.update(model_dir=model_dir, dp=dp, tp=tp, cfg=cfg)
        return "engine"

    monkeypatch.setattr(SGLangEngine, "launch", staticmethod(fake_launch))
    cfg = LadenConfig(seed=11)
    cfg.sglang.mem_fraction_static = 0.55
    cfg.cluster.fileroot = str(tmp_path)
    assert start_server_engine(AllocationMode.parse("sglang:d2t4"), model_dir="m", cfg=cfg) == "engine"
    assert (seen["dp"], seen["tp"], seen["cfg"].mem_fraction_static, seen["cfg"].seed) == (2, 4, 0.55, 11)
    assert seen["cfg"].log_dir == str(tmp_path / "laden" / "run0" / "logs" / "rollout")


class _CharTokenizer:
    """One character per token id: the text of a token sequence is exact and easy to cut."""

    def decode(self, ids, **_):
        return "".join(chr(0x100 + int(i)) for i in ids)


def _straddle_scenario(fake, engine_cls, weights_dir, *, stop_len, min_new_tokens=0):
    """8 tokens, paused after 3, resumed; the stop string is the 2 tokens before the pause and the
    first `stop_len - 2` after it, so only the joined text holds it."""
    head_ids, _ = expected(PROMPT, 3)
    tail_ids, _ = expected((*PROMPT, *head_ids), 5)
    tok = _CharTokenizer()
    stop = tok.decode(head_ids[-2:] + tail_ids[: stop_len - 2])
    fake.core.block_after = 3
    request = GenerationRequest(
        rid="s", input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=8, min_new_tokens=min_new_tokens,
                                                           stop=(stop,)),
    )  # fmt: skip

    async def main():
        engine = engine_cls.attach([fake.url], tokenizer=tok)
        consumer = asyncio.ensure_future(collect(engine, [request]))
        await asyncio.to_thread(fake.core.wait_blocked, 1)
        await engine.pause()
        await engine.update_weights(SimpleNamespace(type="disk", path=str(weights_dir)), 7)
        await engine.resume()
        results = await asyncio.wait_for(consumer, timeout=30)
        await engine.close()
        return results["s", 0]

    return run(main()), head_ids, tail_ids


@pytest.mark.parametrize("server", ["vllm", "sglang"])
@pytest.mark.parametrize("stop_len", [3, 4])
def test_a_stop_string_split_by_a_pause_ends_the_completion_where_it_ends(
    request, tmp_path, server, stop_len
):
    fake = request.getfixturevalue(f"fake_{server}")
    engine_cls = VLLMEngine if server == "vllm" else SGLangEngine
    r, head_ids, tail_ids = _straddle_scenario(fake, engine_cls, tmp_path, stop_len=stop_len)
    cut = stop_len - 2  # tokens of the continuation up to the stop string's last character
    assert r.output_ids == head_ids + tail_ids[:cut] and r.stop_reason == "stop"
    assert r.output_versions == [0] * 3 + [7] * cut and len(r.output_logprobs) == 3 + cut


def test_a_split_stop_string_before_min_new_tokens_does_not_count(fake_vllm, tmp_path):
    r, head_ids, tail_ids = _straddle_scenario(fake_vllm, VLLMEngine, tmp_path, stop_len=3, min_new_tokens=6)
    assert r.output_ids == head_ids + tail_ids and r.stop_reason == "length"
