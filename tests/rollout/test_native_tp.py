"""Tensor parallel native engine (`native:d1t2`) on two CPU processes over gloo, fp32: every case
equals the one-process engine (`t=1`) or the plain reference loops of `test_native_engine`.

One spawn of two ranks runs every case (a spawn costs seconds of imports); the tests below
compare what the ranks returned. Each rank builds the same seeded models, so rank r shards the
same whole weights a one-process engine holds.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import pytest
import torch
import torch.distributed as dist
from native_cases import _model, _prompts, _requests, reference_greedy, teacher_forced_logprobs
from workers import run_workers

from laden.model.hf.export import hf_state_names
from laden.rollout import GenerationRequest, SamplingParams
from laden.rollout.native import NativeEngine
from laden.rollout.native.model import PagedModel
from laden.rollout.native.tensor_parallel import ShardLayout, TensorParallel, tensor_parallel_groups

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = dict(greedy=True, max_new_tokens=12)
SAMPLED = dict(temperature=0.8, top_p=0.9, max_new_tokens=10, ignore_eos=True)


def _engine(model, **kw) -> NativeEngine:
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_concurrent", 8)
    return NativeEngine(model, **kw)


def _state(model) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {name: state[name].clone() for name in hf_state_names(model)}


def _cases() -> dict[str, tuple[str, list[GenerationRequest], dict]]:
    """name -> (model kind, requests, engine options): uneven prompts, GQA split (qwen3, qwen2 with
    q/k/v biases) and one KV head on two ranks (llama, tied embeddings), shared-prompt samples."""
    prompts = _prompts(7)
    shared = [
        GenerationRequest(rid=f"s{i}", input_ids=p, sampling=SamplingParams(**GREEDY), n_samples=3)
        for i, p in enumerate(_prompts(2, seed=4))
    ]
    return {
        "qwen3": ("qwen3", _requests(prompts, **GREEDY, stop_token_ids=(7,)), dict(decode_steps=3)),
        "qwen2": ("qwen2", _requests(prompts[:4], **GREEDY), {}),
        "llama": ("llama", shared + _requests(prompts[:3], **GREEDY), dict(block_size=8)),
        "sampled": ("qwen3", _requests(prompts, **SAMPLED), dict(seed=3)),
    }


def _factory_cfg(tiny_dir: str, backend: str):
    from laden.config.loader import load_config

    return load_config(
        None,
        [f"actor.path={tiny_dir}", "actor.init_from_config=true", "actor.dtype=float32", "gconfig.max_new_tokens=9",
         f"rollout.backend={backend}", "cluster.n_gpus_per_node=2"],
    )  # fmt: skip


def _factory_requests(tokenizer) -> list[GenerationRequest]:
    params = SamplingParams(greedy=True, max_new_tokens=9, ignore_eos=True)
    return [
        GenerationRequest(rid=t, input_ids=tuple(tokenizer.encode(t)), sampling=params)
        for t in ("hi", "abc de")
    ]


def _tp_worker(rank: int, world_size: int, root: str, tiny_dir: str) -> dict:
    from laden.rollout.factory import build_rollout_engine

    tp = tensor_parallel_groups(world_size)
    out: dict = {}
    engine = build_rollout_engine(_factory_cfg(tiny_dir, "native:d1t2"), device="cpu")
    out["factory"] = engine.generate_sync(_factory_requests(engine.tokenizer))
    out["factory_tp"] = (engine.tp.rank, engine.tp.size, engine.paged.num_heads)
    engine.shutdown()
    for name, (kind, reqs, options) in _cases().items():
        engine = _engine(_model(kind), tensor_parallel=tp, **options)
        out[name] = engine.generate_sync(reqs)
        out[f"{name}_kv"] = (engine.core.cache.kv_heads, engine.core.cache.nbytes)
        engine.shutdown()
    out.update(_update_cases(rank, tp, root))
    out["pause"] = asyncio.run(
        _pause_update_resume(_engine(_model("qwen3"), tensor_parallel=tp, decode_steps=2))
    )
    return out


def _update_cases(rank: int, tp: TensorParallel, root: str) -> dict:
    """In place, from disk, over xccl: each a new model's whole tensors into the sharded engine."""
    from laden.weights import WeightUpdateMeta, free_port, init_weight_group, send_weights, write_weights

    engine = _engine(_model("qwen3", seed=0), tensor_parallel=tp)
    prompts = _requests(_prompts(4), greedy=True, max_new_tokens=8, ignore_eos=True)
    layout = ShardLayout(engine.model.config, rank=tp.rank, size=tp.size)
    out = {}

    def check(seed: int) -> None:
        new = _state(_model("qwen3", seed=seed))
        params = engine.named_parameters()
        out[f"shards_v{seed}"] = all(torch.equal(params[n], layout.shard(n, t)) for n, t in new.items())
        out[f"greedy_v{seed}"] = engine.generate_sync(prompts)

    engine.load_weights(_state(_model("qwen3", seed=1)).items(), version=1)
    check(1)
    if rank == 0:
        write_weights(_state(_model("qwen3", seed=2)), root, 2)
    dist.barrier()
    asyncio.run(engine.update_weights(root, 2))
    check(2)
    box = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    meta = WeightUpdateMeta.from_fsdp_xccl("native:d1t2", backend="gloo", master_port=box[0], timeout_s=120)
    sender = None
    if rank == 0:  # the trainer: rank 0 of the weight group, on a thread of this process

        def send() -> None:
            group = init_weight_group(meta, 0)
            send_weights(group, _state(_model("qwen3", seed=3)), version=3, bucket_bytes=4096)

        sender = threading.Thread(target=send)
        sender.start()
    asyncio.run(engine.update_weights(meta, 3))
    if sender is not None:
        sender.join()
    check(3)

    async def sleep_wake():
        await engine.sleep(weights=True)
        await engine.wake()
        await engine.update_weights(_state(_model("qwen3", seed=1)).items(), version=4)
        return await engine.generate_all(prompts)

    out["after_sleep"] = asyncio.run(sleep_wake())
    return out


async def _pause_update_resume(engine: NativeEngine):
    """Pause after the third window (the leader's third decode phase waits for the pause), swap the
    weights, resume: every rank returns the same completions."""
    reqs = _requests(_prompts(4), greedy=True, max_new_tokens=10, ignore_eos=True)
    decodes = []

    def hold_third_window(phase, batch):
        if phase == "decode":
            decodes.append(batch)
            deadline = time.monotonic() + 60
            while len(decodes) == 3 and not engine._paused and time.monotonic() < deadline:
                time.sleep(0.0005)

    engine.core.oom_hook = hold_third_window  # called on the leader only: followers do not schedule
    gen = engine.generate(reqs)
    first = asyncio.ensure_future(gen.__anext__())
    # the leader holds in its third window's decode (after two windows); pausing then is a boundary
    # after that window, whatever the timing (a pause after the second window's count went up but
    # before the third began would take the boundary before it)
    while engine.tp.is_leader and len(decodes) < 3:
        await asyncio.sleep(0.001)
    await engine.pause()
    before = {s.request.rid: len(s.output) for s in engine.core.scheduler.running}
    await engine.update_weights(_state(_model("qwen3", seed=1)).items(), version=1)
    await engine.resume()
    results = [await first] + [r async for r in gen]
    await engine.close()
    return before, sorted(results, key=lambda r: r.rid)


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory, tiny_dir):
    """Both ranks' results, and the one-process engine's for every case."""
    from laden.rollout.factory import build_rollout_engine

    ranks = run_workers(_tp_worker, 2, str(tmp_path_factory.mktemp("tp_weights")), str(tiny_dir))
    engine = build_rollout_engine(_factory_cfg(str(tiny_dir), "native:d1"), device="cpu")
    single = {"factory": engine.generate_sync(_factory_requests(engine.tokenizer))}
    for name, (kind, reqs, options) in _cases().items():
        engine = _engine(_model(kind), **options)
        single[name] = engine.generate_sync(reqs)
        single[f"{name}_kv"] = (engine.core.cache.kv_heads, engine.core.cache.nbytes)
    return ranks, single


def _fields(results) -> list[tuple]:
    return [
        (r.rid, r.sample_index, r.output_ids, r.output_logprobs, r.output_versions, r.stop_reason)
        for r in results
    ]


def _same_everywhere(leader, follower):
    """Every rank's `generate` returned the same completions (the leader's)."""
    assert _fields(follower) == _fields(leader)
    return leader


def test_the_factory_builds_native_d1t2_from_the_config(tp_runs):
    ranks, single = tp_runs
    assert [r["factory_tp"] for r in ranks] == [(0, 2, 2), (1, 2, 2)]  # 4 query heads: 2 per rank
    got = _same_everywhere(ranks[0]["factory"], ranks[1]["factory"])
    assert [r.output_ids for r in got] == [r.output_ids for r in single["factory"]]


@pytest.mark.parametrize("case", ["qwen3", "qwen2", "llama"])
def test_t2_greedy_equals_t1_token_for_token(tp_runs, case):
    ranks, single = tp_runs
    got = _same_everywhere(ranks[0][case], ranks[1][case])
    assert [r.output_ids for r in got] == [r.output_ids for r in single[case]]
    assert [r.stop_reason for r in got] == [r.stop_reason for r in single[case]]
    for r, s in zip(got, single[case]):
        torch.testing.assert_close(
            torch.tensor(r.output_logprobs), torch.tensor(s.output_logprobs), atol=1e-5, rtol=1e-5
        )
    if case == "qwen3":  # and both equal the plain loop, stop token included
        model = _model("qwen3")
        for r in got:
            assert r.output_ids == reference_greedy(model, r.input_ids, 12, {7, 3})


def test_seeded_sampling_is_the_same_on_every_rank_and_equals_t1(tp_runs):
    ranks, single = tp_runs
    got = _same_everywhere(ranks[0]["sampled"], ranks[1]["sampled"])
    assert [r.output_ids for r in got] == [r.output_ids for r in single["sampled"]]
    model = _model("qwen3")
    for r in got:
        ref = teacher_forced_logprobs(model, r.input_ids, r.output_ids, 0.8)
        torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["qwen3", "llama"])
def test_each_rank_caches_only_its_kv_heads(tp_runs, case):
    ranks, single = tp_runs
    heads, nbytes = single[f"{case}_kv"]
    for r in ranks:
        if heads >= 2:  # split: half the heads, half the bytes per rank
            assert r[f"{case}_kv"] == (heads // 2, nbytes // 2)
        else:  # one KV head: both ranks hold it
            assert r[f"{case}_kv"] == (heads, nbytes)


@pytest.mark.parametrize("seed", [1, 2, 3], ids=["inplace", "disk", "xccl"])
def test_an_update_equals_loading_the_whole_state_dict(tp_runs, seed):
    ranks, _ = tp_runs
    assert all(r[f"shards_v{seed}"] for r in ranks)  # each rank holds exactly its slice of the new weights
    got = _same_everywhere(ranks[0][f"greedy_v{seed}"], ranks[1][f"greedy_v{seed}"])
    model = _model("qwen3", seed=seed)
    for r in got:
        assert r.output_ids == reference_greedy(model, r.input_ids, 8, set())
        assert r.output_versions == [seed] * 8


def test_sleep_wake_update_on_every_rank(tp_runs):
    ranks, _ = tp_runs
    got = _same_everywhere(ranks[0]["after_sleep"], ranks[1]["after_sleep"])
    model = _model("qwen3", seed=1)
    for r in got:
        assert r.output_ids == reference_greedy(model, r.input_ids, 8, set())
        assert r.output_versions == [4] * 8


def test_pause_update_resume_switches_every_rank_at_the_leaders_boundary(tp_runs):
    ranks, _ = tp_runs
    before, _ = ranks[0]["pause"]
    assert before and all(n == 7 for n in before.values())  # prefill's token + 3 windows of 2
    results = _same_everywhere(ranks[0]["pause"][1], ranks[1]["pause"][1])
    old, new = _model("qwen3", seed=0), _model("qwen3", seed=1)
    for r in results:
        n_old = before[r.rid]
        assert r.output_versions == [0] * n_old + [1] * (10 - n_old)
        assert r.output_ids[:n_old] == reference_greedy(old, r.input_ids, n_old, set())
        rest = reference_greedy(new, (*r.input_ids, *r.output_ids[:n_old]), 10 - n_old, set())
        assert r.output_ids[n_old:] == rest


def test_layouts_the_engine_cannot_split_are_refused_with_the_fix():
    cfg = _model("qwen3").config  # 4 query heads, 2 KV heads, intermediate 128
    with pytest.raises(
        ValueError, match="t=3 must divide num_attention_heads=4.*valid t for this model: 1, 2, 4"
    ):
        ShardLayout(cfg, rank=0, size=3)
    odd = copy.deepcopy(cfg)
    odd.intermediate_size = 126
    with pytest.raises(
        ValueError, match="t=4 must divide the MLP's intermediate_size=126.*native:d<N>t<valid t>"
    ):
        ShardLayout(odd, rank=0, size=4)
    gelu = _model("qwen3")
    gelu.config.hidden_act = "gelu"
    fake = TensorParallel(group=None, control=None, rank=0, size=2, leader=0)  # no collective is reached
    with pytest.raises(ValueError, match="tensor parallel generation runs the standard"):
        PagedModel(gelu, max_model_len=64, tensor_parallel=fake)


def test_the_shard_layout_slices_heads_and_features():
    cfg = _model("llama").config  # 4 query heads of 16, one KV head, intermediate 96
    halves = [ShardLayout(cfg, rank=r, size=2) for r in range(2)]
    q = torch.arange(64 * 64.0).view(64, 64)
    assert torch.equal(torch.cat([h.shard("model.layers.0.self_attn.q_proj.weight", q) for h in halves]), q)
    o = q.T
    assert torch.equal(
        torch.cat([h.shard("model.layers.1.self_attn.o_proj.weight", o) for h in halves], 1), o
    )
    kv = torch.arange(16 * 64.0).view(16, 64)  # the one KV head: both ranks hold all of it
    assert all(torch.equal(h.shard("model.layers.0.self_attn.k_proj.weight", kv), kv) for h in halves)
    norm = torch.ones(64)
    assert halves[1].shard("model.norm.weight", norm) is norm
    with pytest.raises(ValueError, match="expects dim 0 of size 96"):
        halves[0].shard("model.layers.0.mlp.up_proj.weight", torch.zeros(90, 64))
    params = {"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 48)}
    assert halves[0].full_specs(params)["model.layers.0.mlp.down_proj.weight"].shape == (64, 96)


def _gpu_worker(rank: int, world_size: int, decode_backend: str) -> list:
    torch.backends.cuda.matmul.allow_tf32 = False
    tp = tensor_parallel_groups(world_size)
    engine = NativeEngine(
        _model("qwen3").cuda(), max_concurrent=8, max_model_len=128, kv_cache_tokens=4096,
        decode_backend=decode_backend, cuda_graphs=True, tensor_parallel=tp,
    )  # fmt: skip
    results = engine.generate_sync(_requests(_prompts(7), greedy=True, max_new_tokens=16, ignore_eos=True))
    engine.shutdown()
    return results


@pytest.mark.multigpu
@pytest.mark.parametrize("decode_backend", ["torch", "triton"])
def test_d1t2_greedy_equals_d1t1_on_two_gpus(decode_backend):
    """NCCL all-reduces and token broadcasts inside CUDA graphs, compiled layers, fp32 (TF32 off)."""
    from laden.rollout.native.attention import triton_available

    if decode_backend == "triton" and not triton_available():
        pytest.skip("Triton is not installed")
    ranks = run_workers(_gpu_worker, 2, decode_backend, backend="cpu:gloo,cuda:nccl")
    torch.backends.cuda.matmul.allow_tf32 = False
    single = NativeEngine(
        _model("qwen3").cuda(), max_concurrent=8, max_model_len=128, kv_cache_tokens=4096,
        decode_backend=decode_backend, cuda_graphs=True,
    ).generate_sync(_requests(_prompts(7), greedy=True, max_new_tokens=16, ignore_eos=True))  # fmt: skip
    got = _same_everywhere(ranks[0], ranks[1])
    assert [r.output_ids for r in got] == [r.output_ids for r in single]
    for r, s in zip(got, single):
        torch.testing.assert_close(
            torch.tensor(r.output_logprobs), torch.tensor(s.output_logprobs), atol=1e-4, rtol=1e-4
        )
