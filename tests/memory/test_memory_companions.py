"""`laden plan` counts the models a job holds beside the policy: the reference model and the teacher
(frozen, their weights as their engines allocate them), the critic (its model states as its engine
allocates them); the pair jobs plan two sequences a pair, no reference model, and the reward model's
one-row head; `--profile` measures what the plan predicts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from rl_runs import ASSETS, tiny_rl_config

from laden.cli import main
from laden.engine.backend import resolve_backend
from laden.engine.runtime import Runtime
from laden.memory.estimate import plan_phases

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ASSETS / "tiny"
COMPANIONS = ["actor.kl_ctl=0.1", f"teacher={{path: '{TINY}', init_from_config: true, dtype: bfloat16}}"]


def _training(cfg, job="rl"):
    (phase,) = [p for p in plan_phases(cfg, gpu_capacity=2**34, job=job) if p.phase == "training"]
    return {c.name: c for c in phase.components}


def _runtime(cfg):
    backend = resolve_backend(cfg)
    return Runtime(rank=0, world_size=1, device=torch.device("cpu"), backend=backend), backend


def _held(engine, backend_name):
    """The bytes a CPU engine holds: its parameters (fsdp) or its host store (roundpipe)."""
    if backend_name == "fsdp":
        return sum(p.numel() * p.element_size() for p in engine.model.parameters())
    from laden.engine.roundpipe.host.memory import measured_host_bytes

    return sum(measured_host_bytes(engine.pipe.store, engine.optimizer).values())


@pytest.mark.parametrize(
    ("backend", "optim_step"), [("fsdp:d1", "sync"), ("roundpipe:d1", "sync"), ("roundpipe:d1", "async")]
)
def test_frozen_models_are_planned_as_their_engines_hold_them(tmp_path, backend, optim_step):
    from laden.model.hf.loading import load_tokenizer
    from laden.rl.scoring import build_teacher, frozen_engine

    cfg = tiny_rl_config(
        tmp_path, f"actor.backend={backend}", f"actor.roundpipe.optim_step={optim_step}", *COMPANIONS
    )
    parts = _training(cfg)
    rt, engine_backend = _runtime(cfg)
    ref = frozen_engine(cfg, rt, engine_backend, total_steps=1)
    teacher = build_teacher(cfg, rt, engine_backend, load_tokenizer(str(TINY)), total_steps=1)
    name = engine_backend.name
    for label, engine in (("reference model, frozen", ref), ("teacher, frozen", teacher)):
        planned = {k: c for k, c in parts.items() if k.startswith(label)}
        assert sum(c.gpu + c.host for c in planned.values()) == _held(engine, name), label
        # where the engine keeps weights: the GPU under fsdp, the host under roundpipe
        assert all((c.host if name == "roundpipe" else c.gpu) == c.gpu + c.host for c in planned.values())
    # the teacher in bf16 holds 2 bytes a parameter, the float32 reference 4
    n = sum(p.numel() for p in ref.model.parameters()) if name == "fsdp" else None
    if n is not None:
        assert parts["teacher, frozen: weights (bfloat16)"].gpu == 2 * n
        assert parts["reference model, frozen: weights (float32)"].gpu == 4 * n


def test_the_critic_is_planned_as_its_engine_allocates(tmp_path):
    from laden.data import pack_samples
    from laden.rl.critic import Critic, ValueSettings

    cfg = tiny_rl_config(tmp_path, "critic={optimizer: {type: adam, lr: 1.0e-3}}")
    parts = _training(cfg)
    rt, _ = _runtime(cfg)
    critic = Critic(cfg, rt, settings=ValueSettings(), total_steps=1, global_sum=lambda n: n)
    ids = list(range(3, 40))
    zeros = torch.zeros(len(ids))
    mb = pack_samples([(ids, [0] * 5 + [1] * (len(ids) - 5))]).with_fields(old_values=zeros, returns=zeros)
    critic.engine.forward_backward([mb], critic.objective, normalizer=mb.num_loss_tokens)
    critic.engine.optimizer_step()
    params = list(critic.engine.model.parameters())
    states = sum(v.numel() * v.element_size() for s in critic.engine.optimizer.state.values()
                 for k, v in s.items() if isinstance(v, torch.Tensor) and k != "step")  # fmt: skip
    assert parts["critic: parameters (master)"].gpu == sum(p.numel() * p.element_size() for p in params)
    assert parts["critic: gradients"].gpu == sum(p.grad.numel() * p.grad.element_size() for p in params)
    assert parts["critic: optimizer states (adam)"].gpu == states
    # a one-row head: fewer parameters than the policy's [V, H] head
    assert parts["critic: parameters (master)"].gpu < parts["parameters (master)"].gpu


def test_a_plain_rl_config_plans_the_policy_alone(tmp_path):
    assert not any(
        name.startswith(("reference", "teacher", "critic")) for name in _training(tiny_rl_config(tmp_path))
    )


def _pair_config(tmp_path: Path, job: str, **actor) -> Path:
    rows = [
        {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": "no idea"}
        for a in range(1, 5)
        for b in range(4)
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {"path": str(tmp_path / "pairs.jsonl"), "type": job, "batch_size": 4, "max_length": 32}
    cfg = {"experiment_name": job, "trial_name": "t", "cluster": {"fileroot": str(tmp_path / "runs")},
           "train_dataset": data, "valid_dataset": {**data, "max_length": 40},
           "actor": {"path": str(TINY), "init_from_config": True, "dtype": "float32", **actor}}  # fmt: skip
    path = tmp_path / f"{job}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("job", ["dpo", "rw"])
def test_pair_jobs_plan_two_sequences_a_pair_and_no_second_model(tmp_path, job, capsys):
    from laden.config import load_config
    from laden.memory.estimate import patched_meta_model, tokens_per_microbatch

    path = _pair_config(tmp_path, job)
    cfg = load_config(str(path), [], job=job)
    assert tokens_per_microbatch(cfg) == 2 * 40  # a pair of two sides of the longer max_length (valid's)
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", str(path), "--gpu-mem", "16GiB", "--json", str(out)]) == 0
    (training,) = json.loads(out.read_text())["phases"]
    names = [c["name"] for c in training["components"]]
    assert not any(
        n.startswith(("reference", "teacher", "critic")) for n in names
    )  # DPO: log-probs, not a model
    params = next(c["gpu"] for c in training["components"] if c["name"] == "parameters (master)")
    model = patched_meta_model(cfg)
    assert params == 4 * sum(p.numel() for p in model.parameters())
    head_rows = model.get_output_embeddings().weight.shape[0]
    assert head_rows == (1 if job == "rw" else 104)  # the reward model's one-row head


def _mid_model(tmp_path: Path) -> Path:
    """A model 100 times the tiny one's parameters (9M): its states stand out from the process's baseline."""
    path = tmp_path / "mid"
    path.mkdir()
    for f in TINY.iterdir():
        if f.name != "config.json":
            shutil.copy(f, path / f.name)
    config = json.loads((TINY / "config.json").read_text())
    config.update(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, layer_types=["full_attention"] * 4)  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_the_cpu_profile_measures_the_models_beside_the_policy(tmp_path):
    """In a process of its own, as a user runs it: the plan counts the process's baseline from its start."""
    import subprocess
    import sys

    mid = _mid_model(tmp_path)
    out = tmp_path / "plan.json"
    overrides = [f"actor.path={mid}", f"train_dataset.path={ASSETS / 'rl_tiny.jsonl'}",
                 f"valid_dataset.path={ASSETS / 'rl_tiny_valid.jsonl'}", f"cluster.fileroot={tmp_path}",
                 "rollout.max_concurrent_rollouts=8", "actor.kl_ctl=0.1", f"teacher.path={mid}",
                 "teacher.init_from_config=true", "critic.backend=fsdp:d1"]  # fmt: skip
    config = str(ASSETS / "rl_tiny.yaml")
    command = [sys.executable, "-m", "laden.cli", "plan", "--config", config, "--profile", "--json", str(out)]
    done = subprocess.run([*command, *overrides], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    phases = {p["phase"]: p for p in json.loads(out.read_text())["phases"]}
    training = phases["training"]
    others = sum(
        c["host"] for c in training["components"] if c["name"].startswith(("reference", "teacher", "critic"))
    )
    assert others > 0.2 * training["predicted_host"]  # they matter: without them the plan is far below
    for phase in (
        "training",
        "generation",
    ):  # the targets of benchmarks/plan_accuracy.py: the host within 15%
        assert abs(phases[phase]["host_error"]) <= 0.15, (phase, phases[phase])


def test_only_laden_sft_plans_whole_logits_for_chunked_loss_false(tmp_path):
    """`actor.chunked_loss` is read by `laden sft` alone: the other jobs' losses are always chunked."""
    from laden.config import load_config
    from laden.engine.estimates import layer_activations
    from laden.memory.estimate import patched_meta_model

    def loss_transient(cfg):  # the head step's: the loss's logits
        return layer_activations(patched_meta_model(cfg), cfg, 512)[-1][1]

    rl = [
        tiny_rl_config(tmp_path, f"actor.chunked_loss={v}", "actor.loss_chunk_size=8")
        for v in ("false", "true")
    ]
    assert loss_transient(rl[0]) == loss_transient(rl[1])
    path = _pair_config(tmp_path, "dpo")
    dpo = [load_config(str(path), [f"actor.chunked_loss={v}", "actor.loss_chunk_size=8"], job="dpo")
           for v in ("false", "true")]  # fmt: skip
    assert loss_transient(dpo[0]) == loss_transient(dpo[1])
    sft = [load_config(str(ASSETS / "sft_tiny.yaml"), [
        f"actor.path={TINY}", f"train_dataset.path={ASSETS / 'sft_tiny_train.jsonl'}",
        f"valid_dataset.path={ASSETS / 'sft_tiny_valid.jsonl'}", "actor.loss_chunk_size=8",
        f"actor.chunked_loss={v}"], job="sft") for v in ("false", "true")]  # fmt: skip
    assert loss_transient(sft[0]) > 10 * loss_transient(
        sft[1]
    )  # laden sft reads it: 512 tokens' logits, not 8
