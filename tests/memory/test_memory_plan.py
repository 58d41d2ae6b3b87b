"""`laden plan`'s estimators: exact components equal what the CPU engines allocate; the CLI plans
without a GPU and names the fix when a budget is too small; a plan for the CPU holds everything in
host memory, as the profile measures it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rl_runs import ASSETS, tiny_rl_config

from laden.cli import main
from laden.engine.fsdp.estimate import FsdpTraining
from laden.engine.roundpipe.estimate import RoundPipeTraining
from laden.memory.estimate import ModelShapes, NativeGeneration, WeightUpdate, patched_meta_model
from laden.memory.plan import parse_size

pytestmark = pytest.mark.usefixtures("one_thread")


def _shapes():
    return ModelShapes.from_path(str(ASSETS / "tiny"))


def _by_name(phase):
    return {c.name: c for c in phase.components}


def _one_step(cfg):
    """The engine `cfg` builds on the CPU, after one optimizer step on one micro-batch."""
    from laden.data import pack_samples
    from laden.engine.backend import resolve_backend
    from laden.engine.runtime import Runtime, load_model

    backend = resolve_backend(cfg)
    rt = Runtime(rank=0, world_size=1, device=torch.device("cpu"), backend=backend)
    engine = backend.build(cfg, load_model(cfg, rt, backend), total_steps=1, device=rt.device)
    ids = list(range(3, 40))
    mb = pack_samples([(ids, [0] * 5 + [1] * (len(ids) - 5))])
    engine.train_batch([mb], global_num_loss_tokens=mb.num_loss_tokens)
    return engine


@pytest.mark.parametrize("optimizer", ["adam", "adam_bf16", "sgd"])
def test_fsdp_model_states_equal_what_the_engine_allocates(tmp_path, optimizer):
    cfg = tiny_rl_config(tmp_path, f"actor.optimizer.type={optimizer}")
    phase = FsdpTraining().estimate(cfg, _shapes())
    engine = _one_step(cfg)
    params = list(engine.model.parameters())
    parts = _by_name(phase)
    assert parts["parameters (master)"].gpu == sum(p.numel() * p.element_size() for p in params)
    assert parts["gradients"].gpu == sum(p.grad.numel() * p.grad.element_size() for p in params)
    states = sum(
        v.numel() * v.element_size()
        for state in engine.optimizer.state.values()
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and k != "step" and v.numel() > 1
    )
    assert parts[f"optimizer states ({optimizer})"].gpu == states
    estimated = ("activations", "loss logits", "gathered layers")
    assert all(c.exact == (not c.name.startswith(estimated)) for c in phase.components)


def test_offloaded_fsdp_states_are_host_bytes(tmp_path):
    on_gpu = FsdpTraining().estimate(tiny_rl_config(tmp_path), _shapes())
    offloaded = FsdpTraining().estimate(tiny_rl_config(tmp_path, "actor.fsdp.offload_params=true"), _shapes())
    moved = ("parameters (master)", "gradients", "optimizer states (adam)")
    assert [(_by_name(offloaded)[n].host, _by_name(offloaded)[n].gpu) for n in moved] == [
        (_by_name(on_gpu)[n].gpu, 0) for n in moved
    ]


def test_roundpipe_host_store_equals_what_the_engine_allocates(tmp_path):
    from laden.engine.roundpipe.host.memory import measured_host_bytes

    cfg = tiny_rl_config(tmp_path, "actor.backend=roundpipe:d1")
    phase = RoundPipeTraining().estimate(cfg, _shapes())
    engine = _one_step(cfg)
    engine.pipe.jobs.drain()  # the asynchronous optimizer step has created its states
    measured = measured_host_bytes(engine.pipe.store, engine.optimizer)
    predicted = {c.name.removeprefix("host: "): c.host for c in phase.components if c.host and c.exact}
    assert predicted == {k: v for k, v in measured.items() if v and k in predicted}
    assert sum(predicted.values()) == sum(v for k, v in measured.items() if k != "activations")


def test_the_native_kv_cache_equals_the_engines(tmp_path):
    from laden.model.hf.loading import load_causal_lm
    from laden.rollout.factory import build_rollout_engine

    cfg = tiny_rl_config(tmp_path, "rollout.max_concurrent_rollouts=8")
    phase = NativeGeneration().estimate(cfg, _shapes())
    model = load_causal_lm(cfg.actor.path, dtype=torch.float32, init_from_config=True)
    engine = build_rollout_engine(cfg, model=model, device=torch.device("cpu"))
    parts = _by_name(phase)
    assert parts["KV cache (8 sequences x 56 tokens)"].gpu == engine.core.cache.nbytes
    assert parts["weights (float32)"].gpu == sum(p.numel() * p.element_size() for p in model.parameters())
    assert (
        parts[f"prefill activations ({engine.max_prefill_tokens} tokens)"].gpu > 0
    )  # the engine's CPU budget
    sized = NativeGeneration(gpu_capacity=2**30).estimate(cfg, _shapes())
    (cache,) = [c for c in sized.components if c.name.startswith("KV cache")]
    assert cache.gpu <= int(cfg.native.mem_fraction_static * 2**30) - parts["weights (float32)"].gpu


def test_weight_update_buckets(tmp_path):
    xccl = WeightUpdate().estimate(tiny_rl_config(tmp_path, "actor.weight_chunked_mem_mb=256"), _shapes())
    assert xccl.engine == "in place"  # the native engine in the trainer's process: copied, not broadcast
    disk = WeightUpdate().estimate(
        tiny_rl_config(tmp_path, "actor.weight_update_mode=disk", "actor.weight_chunked_mem_mb=256"),
        _shapes(),
    )
    assert disk.host == 256 * 2**20 and disk.gpu == 0
    served = WeightUpdate().estimate(
        tiny_rl_config(
            tmp_path,
            "rollout.backend=sglang:d1",
            "cluster.n_gpus_per_node=2",
            "actor.weight_chunked_mem_mb=256",
        ),
        _shapes(),
    )  # to servers: the trainer's bucket alone (the servers receive on GPUs of their own)
    assert served.engine == "broadcast to servers" and served.gpu == 256 * 2**20 and served.host == 0


def test_laden_plan_without_a_gpu(capsys):
    assert main(["plan", "--job", "rl", "--gpu-mem", "1GiB", "--host-mem", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert (
        "training on fsdp (fsdp:d1)" in out
        and "generation on native" in out
        and out.rstrip().endswith("fits (GPU 1.00 GiB, host 8.00 GiB)")
    )
    assert main(["plan", "--job", "rl", "--gpu-mem", "1MiB"]) == 1
    out = capsys.readouterr().out
    assert "over the GPU budget of 0.00 GiB" in out and "fix: actor.mb_spec.max_tokens_per_mb=" in out
    assert "does not fit" in out
    assert main(["plan", "--gpu-mem", "lots"]) == 2
    assert "--gpu-mem='lots' is not a size" in capsys.readouterr().err


def test_sizes():
    assert parse_size("24GiB", option="x") == 24 * 2**30
    assert parse_size("80 GB", option="x") == 80 * 10**9
    assert parse_size("1.5", option="x") == int(1.5 * 2**30)


def test_laden_plan_draws_the_breakdown(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    assert main(["plan", "--job", "rl", "--gpu-mem", "1GiB", "--plot", str(out)]) == 0
    assert (
        out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        and f"breakdown drawn in {out}" in capsys.readouterr().out
    )


def test_gradient_checkpointing_auto_follows_the_prediction(tmp_path):
    from laden.config import ConfigError, load_config
    from laden.memory.auto import HEADROOM, resolve_auto

    def resolved(budget, *extra):
        cfg = tiny_rl_config(tmp_path, "actor.gradient_checkpointing=auto", *extra)
        (line,) = resolve_auto(cfg, budget)
        return cfg.actor.gradient_checkpointing, line

    base = tiny_rl_config(tmp_path)
    without = FsdpTraining(patched_meta_model(base)).estimate(base, _shapes()).gpu
    assert resolved(int(without / HEADROOM) + 16)[0] is False  # fits without recompute: the faster choice
    on, line = resolved(int(without / HEADROOM) - 16)
    assert on is True and "auto -> true: predicted training peak" in line
    assert resolved(1, "actor.backend=roundpipe:d1") == (False, "actor.gradient_checkpointing=auto -> false: "
                                                         "roundpipe:d1 recomputes by design")  # fmt: skip
    cfg = tiny_rl_config(tmp_path)
    assert resolve_auto(cfg, 1) == [] and cfg.actor.gradient_checkpointing is False  # not auto: untouched
    with pytest.raises(ConfigError, match="expected true or false or one of 'auto'"):
        load_config(str(ASSETS / "rl_tiny.yaml"), ["actor.gradient_checkpointing=maybe"], job="rl")


def test_a_run_records_the_value_auto_chose(tmp_path):
    import yaml

    from laden.rl.trainer import run_rl

    result = run_rl(
        tiny_rl_config(tmp_path, "actor.gradient_checkpointing=auto", "total_train_steps=1"), progress=False
    )
    saved = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert saved["actor"]["gradient_checkpointing"] is False  # the tiny model fits this machine's memory


def test_auto_values_are_listed_and_unknown_knobs_refused(tmp_path):
    from laden.config import ConfigError

    cfg = tiny_rl_config(
        tmp_path,
        "actor.mb_spec.max_tokens_per_mb=auto",
        "max_concurrent_rollouts=auto",
        "~rollout.max_concurrent_rollouts",
    )
    assert cfg.auto == ["rollout.max_concurrent_rollouts", "actor.mb_spec.max_tokens_per_mb"]
    assert cfg.actor.mb_spec.max_tokens_per_mb is None and cfg.rollout.max_concurrent_rollouts is None
    with pytest.raises(ConfigError, match="they are one knob"):  # the tiny job sets rollout's to 64
        tiny_rl_config(tmp_path, "max_concurrent_rollouts=auto")
    with pytest.raises(ConfigError, match="auto: 'seed' cannot be chosen automatically"):
        tiny_rl_config(tmp_path, "auto=[seed]")


def _training_peak(cfg):
    return FsdpTraining(patched_meta_model(cfg)).estimate(cfg, _shapes()).gpu


@pytest.mark.parametrize("gc", ["false", "auto"])
def test_the_auto_token_budget_is_the_largest_that_fits(tmp_path, gc):
    from laden.memory.auto import HEADROOM, resolve_auto

    longest = 48 + 8  # the tiny RL job: prompt budget plus max_new_tokens
    fixed = tiny_rl_config(tmp_path, "actor.gradient_checkpointing=false")
    peaks = {}
    for k in (1, 5, 6, 32):
        fixed.actor.mb_spec.max_tokens_per_mb = k * longest
        peaks[k] = _training_peak(fixed)
    budget = int((peaks[5] + peaks[6]) / 2 / HEADROOM)  # five longest sequences fit, six do not
    cfg = tiny_rl_config(
        tmp_path, "actor.mb_spec.max_tokens_per_mb=auto", f"actor.gradient_checkpointing={gc}"
    )
    lines = resolve_auto(cfg, budget)
    assert cfg.actor.mb_spec.max_tokens_per_mb == 5 * longest and cfg.auto == []
    assert cfg.actor.gradient_checkpointing is False  # one longest sequence fits without recompute
    assert _training_peak(cfg) <= HEADROOM * budget < peaks[6]
    assert any("actor.mb_spec.max_tokens_per_mb=auto -> 280 (5 longest sequences" in line for line in lines)
    roomy = tiny_rl_config(tmp_path, "actor.mb_spec.max_tokens_per_mb=auto")
    resolve_auto(roomy, int(peaks[32] / HEADROOM) + 1)
    assert roomy.actor.mb_spec.max_tokens_per_mb == 32 * longest  # the whole step (8 prompts x 4 samples)
    tight = tiny_rl_config(tmp_path, "actor.mb_spec.max_tokens_per_mb=auto")
    (line,) = resolve_auto(tight, 1)
    assert tight.actor.mb_spec.max_tokens_per_mb == longest and "it does not fit" in line


def test_auto_roundpipe_knobs_fit_the_budget(tmp_path):
    from laden.memory.auto import HEADROOM, resolve_auto

    def peak(cfg):
        return RoundPipeTraining(patched_meta_model(cfg)).estimate(cfg, _shapes())

    base = ["actor.backend=roundpipe:d1", "actor.mb_spec.max_tokens_per_mb=512"]
    whole = peak(tiny_rl_config(tmp_path, *base, "actor.roundpipe.model_memory_limit=100"))
    smallest = peak(tiny_rl_config(tmp_path, *base, "actor.roundpipe.model_memory_limit=0.0001"))
    budget = int((smallest.gpu + whole.gpu) / 2 / HEADROOM)  # the whole model in one stage does not fit
    cfg = tiny_rl_config(tmp_path, *base, "actor.roundpipe.model_memory_limit=auto",
                         "actor.roundpipe.recompute_grain=auto", "actor.roundpipe.num_microbatch=auto")  # fmt: skip
    lines = resolve_auto(cfg, budget, host_budget=2**40)
    rp = cfg.actor.roundpipe
    assert rp.recompute_grain in ("stage", "layer") and 0 < rp.model_memory_limit < budget / 2**30
    assert peak(cfg).gpu <= HEADROOM * budget
    assert rp.num_microbatch == 4  # 32 sequences of 56 tokens, 9 to a micro-batch of 512 tokens
    assert [line.split("=auto")[0] for line in lines] == [
        "actor.roundpipe.model_memory_limit", "actor.roundpipe.recompute_grain", "actor.roundpipe.num_microbatch",
    ]  # fmt: skip


def test_auto_rollout_knobs(tmp_path):
    from laden.memory.auto import resolve_auto

    knobs = ["rollout.max_concurrent_rollouts=auto", "native.mem_fraction_static=auto",
             "actor.weight_chunked_mem_mb=auto"]  # fmt: skip
    cfg = tiny_rl_config(tmp_path, *knobs)
    resolve_auto(cfg, 2**34)
    assert cfg.rollout.max_concurrent_rollouts == 8 * 4  # the requests one step has in flight
    assert cfg.native.mem_fraction_static == 0.9 and cfg.actor.weight_chunked_mem_mb == 1024
    ahead = tiny_rl_config(tmp_path, *knobs, "rollout.max_head_offpolicyness=2")
    resolve_auto(ahead, 2**34)
    assert ahead.rollout.max_concurrent_rollouts == 8 * 4 * 3
    small = tiny_rl_config(tmp_path, "actor.weight_chunked_mem_mb=auto")
    resolve_auto(small, int((_training_peak(small) + 2 * 300 * 2**20) / 0.9))
    assert small.actor.weight_chunked_mem_mb == 256  # two buckets of 256 MB fit beside the peak, of 512 not


def test_a_run_with_every_auto_knob_records_its_choices(tmp_path):
    import yaml

    from laden.rl.trainer import run_rl

    knobs = ["actor.gradient_checkpointing=auto", "actor.mb_spec.max_tokens_per_mb=auto",
             "rollout.max_concurrent_rollouts=auto", "native.mem_fraction_static=auto",
             "actor.weight_chunked_mem_mb=auto", "total_train_steps=1"]  # fmt: skip
    result = run_rl(tiny_rl_config(tmp_path, *knobs), progress=False)
    saved = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert saved["auto"] == [] and saved["actor"]["mb_spec"]["max_tokens_per_mb"] == 32 * 56
    assert (
        saved["rollout"]["max_concurrent_rollouts"] == 32 and saved["actor"]["weight_chunked_mem_mb"] == 1024
    )


def test_the_suggested_layout_is_the_fastest_that_fits(tmp_path):
    from laden.memory.auto import HEADROOM
    from laden.memory.plan import suggest_backends

    cfg = tiny_rl_config(tmp_path)
    model = patched_meta_model(cfg)

    def peak(backend, gc):
        c = tiny_rl_config(
            tmp_path, f"actor.backend={backend}", f"actor.gradient_checkpointing={str(gc).lower()}"
        )
        return FsdpTraining(model).estimate(c, _shapes()).gpu

    plain, recompute = peak("fsdp:d1", False), peak("fsdp:d1", True)
    assert recompute < plain

    def suggested(budget, job="sft", gpus=1):
        return suggest_backends(
            cfg, gpus=gpus, gpu_budget=int(budget / HEADROOM), host_budget=2**40, job=job
        )[1]

    assert suggested(plain + 1024).split() == ["actor.backend=fsdp:d1", "actor.gradient_checkpointing=false"]
    assert "fsdp:d1 actor.gradient_checkpointing=true" in suggested(recompute + 1024)
    # below fsdp's smallest peak: the roundpipe engine plans its stages for the GPU it is given
    assert "actor.backend=roundpipe:d1" in suggested(recompute - 1024)
    assert "rollout.backend=native:d1 cluster.n_gpus_per_node=2" in suggested(plain + 1024, "rl", gpus=2)


def test_laden_plan_profiles_each_phase_without_a_gpu(tmp_path, capsys):
    import json

    out = tmp_path / "plan.json"
    overrides = [f"cluster.fileroot={tmp_path}", "actor.mb_spec.max_tokens_per_mb=auto"]
    assert main(["plan", "--job", "rl", "--profile", "--json", str(out), *overrides]) == 0
    text = capsys.readouterr().out
    assert "profile: predicted vs measured" in text and "actor.mb_spec.max_tokens_per_mb=auto -> " in text
    assert "profile: predicted vs measured host peak" in text and "GPU" not in text.split("fits (")[1]
    plan = json.loads(out.read_text())
    phases = {p["phase"]: p for p in plan["phases"]}
    assert set(phases) == {"training", "generation", "weight update"}
    for p in phases.values():
        measured = p["measured"]
        assert measured["gpu"] is None and measured["seconds"] > 0  # no GPU here: host figures only
        assert measured["host"] is None or measured["host"] >= 0
        assert p["on_cpu"] and p["predicted_gpu"] == 0 and p["predicted_host"] > 0
    training = phases["training"]["measured"]
    if training["host"] is not None:  # the process's peak resident set, its baseline included
        assert training["host"] >= training["host_start"] > 0
    assert phases["training"]["components"]


def _engine_state_bytes(engine):
    """Parameters, gradients and optimizer states the engine allocated, by the plan's component names."""
    params = list(engine.model.parameters())
    states = sum(
        v.numel() * v.element_size()
        for state in engine.optimizer.state.values()
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and k != "step" and v.numel() > 1
    )
    return {
        "parameters (master)": sum(p.numel() * p.element_size() for p in params),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params),
        "optimizer states (adam)": states,
    }


def test_a_cpu_plan_holds_the_model_states_in_host_memory_as_the_engine_allocates(tmp_path):
    from laden.memory.estimate import PROCESS_BASELINE_BYTES, plan_phases

    cfg = tiny_rl_config(tmp_path)
    for_gpu = plan_phases(cfg, gpu_capacity=2**34, job="rl")
    phases = plan_phases(cfg, gpu_capacity=None, job="rl")
    assert [p.phase for p in phases] == ["training", "generation", "weight update"]
    assert all(p.on_cpu and p.gpu == 0 for p in phases)
    training = _by_name(phases[0])
    engine = _one_step(cfg)
    assert {name: training[name].host for name in _engine_state_bytes(engine)} == _engine_state_bytes(engine)
    # the engine trains the model as loaded, and its step peaks above the load
    assert not any(c.load_time for p in phases for c in p.components)
    loading = sum(c.host for c in for_gpu[0].components if c.load_time)
    assert (
        loading > 0 and phases[0].host == for_gpu[0].gpu + for_gpu[0].host - loading + PROCESS_BASELINE_BYTES
    )
    baseline = [[c.host for c in p.components if c.name.startswith("process baseline")] for p in phases]
    assert baseline == [[PROCESS_BASELINE_BYTES], [PROCESS_BASELINE_BYTES], []]  # the update: above its start


def test_a_cpu_plan_has_one_column_and_the_fixes_of_the_memory_it_uses(tmp_path):
    from laden.memory.estimate import plan_phases
    from laden.memory.plan import render

    cfg = tiny_rl_config(tmp_path)
    phases = plan_phases(cfg, gpu_capacity=None, job="sft")
    text, fits = render(phases, cfg, gpu_budget=None, host_budget=2**20)
    assert not fits and "training on fsdp (fsdp:d1) on the CPU" in text
    assert "host MiB" in text and "GPU" not in text
    assert "over the host budget" in text and "fix: actor.gradient_checkpointing=true" in text
    assert "offload" not in text  # the model states are in host memory already
    text, fits = render(
        plan_phases(cfg, gpu_capacity=2**34, job="sft"), cfg, gpu_budget=2**34, host_budget=None
    )
    assert fits and "GPU MiB  host MiB" in text


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_the_cpu_profile_counts_the_host_as_the_cpu_plan_does():
    from laden.memory.profile import _Phase

    cpu = torch.device("cpu")
    size = 64 * 2**20
    with _Phase("training", cpu, gpu_from_zero=True) as training:
        kept = torch.ones(size // 4)  # touched: resident
    with _Phase("weight update", cpu, gpu_from_zero=False) as update:
        more = torch.ones(size // 4)
    assert training.result is not None and update.result is not None
    start = training.result.host_start
    assert start is not None and training.result.host is not None
    # 0.9: the kernel syncs each thread's resident-set counters in batches of pages
    assert training.result.host >= start + 0.9 * size  # from the process's start: its baseline included
    assert (
        update.result.host is not None and 0.9 * size <= update.result.host < size + start
    )  # above its start
    del kept, more


def test_the_profile_packs_the_full_budget_of_longest_sequences(tmp_path):
    from laden.memory.profile import worst_case_micro_batches

    cfg = tiny_rl_config(tmp_path, "actor.mb_spec.max_tokens_per_mb=500", "actor.mb_spec.n_mbs=2")
    mbs = worst_case_micro_batches(cfg, vocab_size=100)
    assert [mb.seqlens for mb in mbs] == [[56] * 8 + [52]] * 2  # 48 + 8 tokens, the rest of 500 in the last
    assert all(mb.num_tokens == 500 and int(mb.input_ids.max()) < 100 for mb in mbs)


def test_auto_concurrency_for_a_gpu_is_what_its_kv_cache_holds(tmp_path):
    from laden.memory.auto import resolve_auto

    roomy = tiny_rl_config(tmp_path, "rollout.max_concurrent_rollouts=auto")
    (line,) = resolve_auto(roomy, 2**34, for_gpu=True)
    assert (
        roomy.rollout.max_concurrent_rollouts == 32 and "the KV cache" in line
    )  # capped at a step's requests
    none = tiny_rl_config(tmp_path, "rollout.max_concurrent_rollouts=auto")
    (line,) = resolve_auto(none, 12 * 2**20, for_gpu=True)  # 80% of 12 MiB: less than the prefill pass
    assert none.rollout.max_concurrent_rollouts == 1 and "holds no whole sequence" in line
    budget = 12 * 2**20
    while True:  # the smallest budget (by 5% steps) whose cache holds a sequence, and fewer than 32
        budget = int(budget * 1.05)
        tight = tiny_rl_config(tmp_path, "rollout.max_concurrent_rollouts=auto")
        (line,) = resolve_auto(tight, budget, for_gpu=True)
        if "holds no whole" not in line:
            break
    held = int(line.split(" holds ")[1].split()[0])
    assert 1 <= tight.rollout.max_concurrent_rollouts == held < 32


def test_a_profile_beside_rollout_servers_names_the_update_it_did_not_measure(tmp_path):
    from laden.memory.estimate import PhaseEstimate
    from laden.memory.profile import Measured, render_profile

    cfg = tiny_rl_config(tmp_path, "rollout.backend=sglang:d1", "cluster.n_gpus_per_node=2")
    phases = [PhaseEstimate("training", "fsdp", []), WeightUpdate().estimate(cfg, _shapes())]
    measured = [Measured(phase="training", gpu=2**30, gpu_reserved=2**30, host=0, seconds=1.0)]
    out = render_profile(phases, measured)
    assert "  training " in out and "not measured: weight update (the rollout engine is servers" in out
    assert "not measured" not in render_profile(phases[:1], measured)
