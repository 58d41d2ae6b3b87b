"""PPO with a critic: GAE, the clipped value loss and the value model against plain references; the
critic in `laden rl` (it learns, and a resumed run equals an uninterrupted one); its config."""

from __future__ import annotations

import json
import logging
from importlib import resources

import pytest
import torch
from repo_paths import SUPPORT
from rl_runs import crash_then_resume, tiny_rl_config
from torch.testing import assert_close

from laden.config import ConfigError, load_config
from laden.config.usage import fields_without_effect
from laden.data import pack_samples
from laden.rl import critic as critic_module
from laden.rl.advantages import NormSettings
from laden.rl.critic import Critic, ValueObjective, ValueSettings
from laden.rl.gae import explained_variance, gae, last_token_rewards, normalize_tokens
from laden.rl.settings import value_settings
from laden.rl.trainer import run_rl

pytestmark = pytest.mark.usefixtures("one_thread")

ASSETS = resources.files("laden") / "assets"
AREAL = SUPPORT / "areal_configs"


def _cfg(tmp_path, *overrides):
    return tiny_rl_config(tmp_path, *overrides)


# ---------------------------------------------------------------- GAE


def _gae_loop(rewards: list[float], values: list[float], gamma: float, lam: float):
    """GAE as the textbook writes it, one token at a time; values[-1] is the bootstrap."""
    advantages, last = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * values[t + 1] - values[t]
        last = delta + gamma * lam * last
        advantages[t] = last
    return advantages, [a + v for a, v in zip(advantages, values)]


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.7), (1.0, 0.5)])
def test_gae_equals_a_plain_loop(gamma, lam):
    gen = torch.Generator().manual_seed(int(gamma * 100 + lam * 10))
    lengths = [5, 0, 1, 8, 3]  # uneven, an empty completion, a single token
    rewards = [torch.randn(n, generator=gen) for n in lengths]
    values = [torch.randn(n + 1, generator=gen) for n in lengths]
    values[2][-1] = 0.0  # a terminal completion: nothing after its last token
    adv, ret = gae(rewards, values, discount=gamma, gae_lambda=lam)
    for r, v, a, R in zip(rewards, values, adv, ret):
        ref_a, ref_r = _gae_loop(r.double().tolist(), v.double().tolist(), gamma, lam)
        assert_close(a, torch.tensor(ref_a, dtype=torch.float32))
        assert_close(R, torch.tensor(ref_r, dtype=torch.float32))


def test_reward_at_the_last_token_and_gae_input_checks():
    rewards = last_token_rewards([1.5, -2.0, 3.0], [3, 1, 0])
    assert [r.tolist() for r in rewards] == [[0.0, 0.0, 1.5], [-2.0], []]
    with pytest.raises(ValueError, match="one more entry per completion"):
        gae([torch.zeros(2)], [torch.zeros(2)], discount=1.0, gae_lambda=1.0)
    with pytest.raises(ValueError, match=r"actor.discount=1.5 .* must be in \[0, 1\]"):
        gae([torch.zeros(2)], [torch.zeros(3)], discount=1.5, gae_lambda=1.0)
    assert explained_variance(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])) == 1.0
    assert explained_variance(torch.zeros(2), torch.tensor([1.0, 3.0])) == 0.0


@pytest.mark.parametrize("level", ["batch", "group"])
def test_advantage_norm_counts_every_token_once(level):
    gen = torch.Generator().manual_seed(3)
    lengths, group_sizes = [3, 0, 5, 2, 4], [2, 3]
    adv = [torch.randn(n, generator=gen) for n in lengths]
    out = normalize_tokens(adv, NormSettings(mean_level=level, std_level=level), group_sizes=group_sizes)
    groups = [adv[:2], adv[2:]] if level == "group" else [adv]
    expected = []
    for members in groups:
        tokens = torch.cat(members).double()
        centred = (tokens - tokens.mean()) / (tokens.std(unbiased=True) + 1e-5)
        expected.append(centred.float())
    assert_close(torch.cat(out), torch.cat(expected))
    assert [a.numel() for a in out] == lengths
    assert all(torch.equal(a, b) for a, b in zip(normalize_tokens(adv, None, group_sizes=group_sizes), adv))


# ---------------------------------------------------------------- the value loss


def _reference_value_loss(value, old, target, mask, eps):
    """AReaL's clipped value loss, written out: 0.5 max((v-R)^2, (v_old + clip(v-v_old) - R)^2), summed."""
    total = value.new_zeros(())
    for t in range(value.numel()):
        if not mask[t]:
            continue
        clipped = old[t] + torch.clamp(value[t] - old[t], -eps, eps)
        total = total + 0.5 * torch.maximum((value[t] - target[t]) ** 2, (clipped - target[t]) ** 2)
    return total


def test_value_loss_and_gradients_equal_a_plain_reference():
    gen = torch.Generator().manual_seed(0)
    samples = [([1, 2, 3, 4, 5], [0, 0, 1, 1, 1]), ([6, 7, 8], [0, 1, 1]), ([9, 10, 11, 12], [0, 0, 0, 1])]
    per_token = {name: [torch.randn(len(ids), generator=gen).tolist() for ids, _ in samples]
                 for name in ("old_values", "returns")}  # fmt: skip
    batch = pack_samples(samples, fields=per_token)
    hidden = torch.randn(batch.num_tokens, 16, generator=gen, requires_grad=True)
    head = torch.randn(1, 16, generator=gen, requires_grad=True)
    objective = ValueObjective(ValueSettings(eps_clip=0.3))
    loss = objective(hidden, head, batch)
    loss.backward()
    grads = hidden.grad.clone(), head.grad.clone()
    hidden.grad, head.grad = None, None
    value = (hidden @ head.t()).squeeze(-1)
    mask = batch.labels != -100
    old, target = batch.fields["old_values"], batch.fields["returns"]
    reference = _reference_value_loss(value, old, target, mask, 0.3)
    reference.backward()
    assert_close(loss, reference)
    assert_close(grads[0], hidden.grad)
    assert_close(grads[1], head.grad)
    stats = objective.pop_stats()
    clipped = old + (value - old).clamp(-0.3, 0.3)
    binds = ((clipped - target) ** 2 > (value - target) ** 2) & mask
    assert 0 < binds.sum() < mask.sum()  # the clip binds on some tokens, not all
    assert_close(stats["value_clip_fraction"], binds.sum() / mask.sum())
    with pytest.raises(ValueError, match=r"critic.eps_clip=0.0 must be > 0"):
        ValueSettings(eps_clip=0.0)


# ---------------------------------------------------------------- the value model on both engines


def _traj(prompt, completion, stop_reason):
    from laden.rl.workflow import Trajectory

    return Trajectory(prompt_ids=tuple(prompt), completion_ids=list(completion), logprobs=[0.0] * len(completion),
                      versions=[0] * len(completion), reward=0.0, stop_reason=stop_reason, group_id="g",
                      sample_index=0, info={})  # fmt: skip


def _random_head(real):
    def build(model):
        model = real(model)
        with torch.no_grad():
            model.lm_head.weight.copy_(
                torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(7)) / 8
            )
        return model

    return build


@pytest.mark.parametrize(
    ("backend", "mask_no_eos"), [("fsdp:d1", False), ("roundpipe:d1", True), ("archon:d1", True)]
)
def test_critic_values_and_one_step_equal_a_plain_reference(tmp_path, monkeypatch, backend, mask_no_eos):
    """Values at the states before each completion token and after the last; one SGD step of the value
    loss; on every engine kind, against the Hugging Face model run per document."""
    from laden.engine.runtime import Runtime
    from laden.model.hf.loading import load_causal_lm
    from laden.model.value_head import to_value_model

    lr, eps = 0.1, 0.05
    cfg = _cfg(tmp_path, f"critic={{backend: '{backend}', eps_clip: {eps}, mask_no_eos_with_zero: {str(mask_no_eos).lower()}, "
               f"optimizer: {{type: sgd, lr: {lr}, weight_decay: 0.0, gradient_clipping: 0.0}}}}")  # fmt: skip
    monkeypatch.setattr(critic_module, "to_value_model", _random_head(to_value_model))
    rt = Runtime(rank=0, world_size=1, device=torch.device("cpu"))
    critic = Critic(cfg, rt, settings=value_settings(cfg), total_steps=1, global_sum=lambda n: n)
    trajs = [
        _traj([4, 5, 6], [7, 8, 9, 10], "stop"),
        _traj([11], [12, 13], "length"),
        _traj([14, 15], [16], "stop"),
    ]
    values = critic.values(trajs)

    reference = _random_head(to_value_model)(
        load_causal_lm(
            str(ASSETS / "tiny"), dtype=torch.float32, init_from_config=True, seed=cfg.seed, attn_impl="sdpa"
        )
    )
    gen = torch.Generator().manual_seed(1)
    old = {id(t): v[:-1] + 0.1 * torch.randn(v.numel() - 1, generator=gen) for t, v in zip(trajs, values)}
    returns = {id(t): torch.randn(len(t.completion_ids), generator=gen) for t in trajs}
    total, count = torch.zeros(()), 0
    for t, v in zip(trajs, values):
        ids = torch.tensor([[*t.prompt_ids, *t.completion_ids]])
        hidden = reference.model(input_ids=ids).last_hidden_state[0]  # [P + C, H]
        ref = (hidden @ reference.lm_head.weight.t()).squeeze(-1)[len(t.prompt_ids) - 1 :]
        assert_close(v, ref.detach(), rtol=1e-4, atol=1e-5)
        if mask_no_eos and not t.has_eos:
            continue
        c = len(t.completion_ids)
        total = total + _reference_value_loss(
            ref[:-1], old[id(t)], returns[id(t)], torch.ones(c, dtype=torch.bool), eps
        )
        count += c
    (total / count).backward()

    metrics = critic.update([trajs], old, returns)
    assert_close(torch.tensor(metrics["critic_loss"]), (total / count).detach(), rtol=1e-4, atol=1e-6)
    weights = dict(critic.engine.named_weights(torch.float32, device="cpu"))
    assert weights.keys() == dict(reference.named_parameters()).keys()
    for name, param in reference.named_parameters():  # the step taken is -lr * the reference gradient
        step = -lr * param.grad
        assert_close(
            weights[name] - param.detach(), step, rtol=1e-3, atol=1e-5 * float(step.abs().max()), msg=name
        )
    assert weights["lm_head.weight"].shape == (1, 64)


# ---------------------------------------------------------------- `laden rl` with a critic

PPO = ["critic={optimizer: {lr: 3.0e-3, weight_decay: 0.0}}", "actor.discount=0.9", "actor.gae_lambda=0.95",
       "actor.reward_bias=1.0", "total_train_steps=6", "checkpoint.save_freq_steps=3"]  # fmt: skip


def _metrics(result) -> list[dict]:
    """The training steps' rows (not the held-out evaluation before training, step 0)."""
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] > 0]


def test_ppo_with_a_critic_learns_values_and_resumes_exactly(tmp_path, monkeypatch):
    full = run_rl(_cfg(tmp_path / "a", *PPO), progress=False)
    records = _metrics(full)
    losses = [r["critic_loss"] for r in records]
    assert losses[-1] < 0.75 * losses[0], losses  # the critic learns the (biased) returns
    assert records[0]["value_mean"] == 0.0  # the value head starts at zero
    assert records[-1]["value_mean"] > 0.3
    assert all(
        r["critic_lr"] == pytest.approx(3.0e-3) and 0 <= r["value_clip_fraction"] <= 1 for r in records
    )
    assert all(
        name in r for r in records for name in ("explained_variance", "return_mean", "critic_grad_norm")
    )
    assert (full.run_dir / "checkpoints" / "step_6" / "critic" / "model.safetensors").exists()

    resumed = crash_then_resume(_cfg(tmp_path / "b", *PPO), monkeypatch, at_step=4)
    assert resumed.rewards == full.rewards[3:]
    for ra, rb in zip(records, _metrics(resumed)):
        for name in ("reward_mean", "loss", "critic_loss", "value_mean", "return_mean", "critic_grad_norm"):
            assert ra[name] == rb[name], (ra["step"], name)


def test_ppo_with_a_critic_on_archon_trains_as_on_fsdp(tmp_path):
    """The same PPO steps with the critic on the archon engine as on the fsdp engine (actor on fsdp)."""
    steps = ["total_train_steps=2", "checkpoint.save_freq_steps=2"]
    runs = {backend: _metrics(run_rl(_cfg(tmp_path / backend[:6], *PPO, *steps, f"critic.backend={backend}"),
                                     progress=False))
            for backend in ("fsdp:d1", "archon:d1")}  # fmt: skip
    fsdp, archon = runs["fsdp:d1"], runs["archon:d1"]
    assert [r["step"] for r in archon] == [1, 2] and archon[0]["reward_mean"] == fsdp[0]["reward_mean"]
    for got, want in zip(archon, fsdp):
        for name in ("critic_loss", "critic_grad_norm", "value_mean", "return_mean", "loss"):
            assert got[name] == pytest.approx(want[name], rel=1e-4, abs=1e-6), (got["step"], name)
    assert archon[1]["value_mean"] != 0.0  # the critic's step moved its values


def test_areal_ppo_megatron_config_loads_with_its_critic_on_archon(caplog):
    with caplog.at_level(logging.WARNING, logger="laden.config.areal"):
        cfg = load_config(AREAL / "gsm8k_ppo_megatron.yaml", AREAL_PATHS, job="rl")
    assert cfg.actor.backend == "megatron:d4p1t1" and cfg.critic is not None
    assert cfg.critic.backend == "megatron:d4p1t1"  # `${actor.backend}`, run on the archon engine
    assert critic_module.critic_engine_config(cfg).actor.archon == cfg.actor.archon
    assert not any("critic.backend" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- the critic section

AREAL_PATHS = [
    f"actor.path={ASSETS / 'tiny'}",
    "train_dataset.path=train.jsonl",
    "valid_dataset.path=valid.jsonl",
]


def test_areal_ppo_config_with_a_critic_loads_as_the_critic_section(caplog):
    with caplog.at_level(logging.WARNING, logger="laden.config.areal"):
        cfg = load_config(AREAL / "gsm8k_ppo.yaml", AREAL_PATHS, job="rl")
    c = cfg.critic
    assert c is not None and (c.backend, c.eps_clip, c.ppo_n_minibatches, c.init_from_config) == (
        "fsdp:d4p1t1", 0.5, 1, False)  # fmt: skip
    assert (
        c.optimizer == cfg.actor.optimizer and c.mb_spec is not None and c.mb_spec.max_tokens_per_mb == 10240
    )
    assert not any(
        "critic.is_critic" in r.getMessage() or "critic.path" in r.getMessage() for r in caplog.records
    )
    errors = _errors(
        AREAL / "gsm8k_ppo.yaml", [*AREAL_PATHS, "critic.is_critic=false", "+critic.use_lora=true"]
    )
    assert any(
        e.startswith("critic.is_critic=false: laden's critic section always trains a value model")
        for e in errors
    )
    assert any(e.startswith("critic.use_lora=true: LoRA on the critic is not implemented") for e in errors)
    legacy = load_config(AREAL / "gsm8k_ppo.yaml", [*AREAL_PATHS, "critic.backend=fsdp"], job="rl")
    # a bare engine name takes the actor's sizes
    assert legacy.critic is not None and legacy.critic.backend == "fsdp:d4p1t1"


def _errors(path, overrides):
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, job="rl")
    return info.value.errors


def test_critic_section_rules(tmp_path):
    rl = str(ASSETS / "rl_tiny.yaml")
    base = [
        f"actor.path={ASSETS / 'tiny'}",
        f"train_dataset.path={ASSETS / 'rl_tiny.jsonl'}",
        f"cluster.fileroot={tmp_path}",
    ]
    (error,) = _errors(rl, [*base, "critic={backend: 'fsdp:d2'}", "cluster.n_gpus_per_node=2"])
    assert (
        error.startswith("critic.backend='fsdp:d2' must train in the actor's processes")
        and "fsdp:d1" in error
    )
    (error,) = _errors(rl, [*base, "critic={backend: 'fsdp:d1t2'}", "cluster.n_gpus_per_node=2"])
    assert "1 process with d=1, t=1 and c=1" in error and "set critic.backend: fsdp:d1," in error
    # the same processes and d, but pipeline stages where the actor has data ranks: other shares of the batch
    pipelined = [
        *base,
        "actor.backend=archon:d2",
        "critic={backend: 'archon:d1p2'}",
        "cluster.n_gpus_per_node=2",
    ]
    (error,) = _errors(rl, pipelined)
    assert error.endswith("set critic.backend: archon:d2, or leave it ''")
    (error,) = _errors(
        rl, [*base, "actor.backend=archon:d1p2", "critic={backend: 'fsdp:d2'}", "cluster.n_gpus_per_node=2"]
    )
    assert error.endswith("the fsdp engine has no p dimension: leave critic.backend '' (the actor's)")
    for actor in (
        "archon:d1t2",
        "megatron:d1p2",
        "archon:d1c2",
        "fsdp:d1t2",
    ):  # the critic takes the actor's layout
        cfg = load_config(
            rl, [*base, f"actor.backend={actor}", "critic={}", "cluster.n_gpus_per_node=2"], job="rl"
        )
        assert cfg.critic is not None and critic_module.critic_engine_config(cfg).actor.backend == actor
    (error,) = _errors(rl, [*base, "critic={eps_clip: 0.0}"])
    assert error == "critic.eps_clip=0.0 must be greater than 0; set it to a positive number"
    (error,) = _errors(rl, [*base, "critic={mb_spec: {max_tokens_per_mb: 16}}"])
    assert error.startswith("critic.mb_spec.max_tokens_per_mb=16 is smaller than")
    sft = load_config(
        None,
        [f"actor.path={ASSETS / 'tiny'}", "train_dataset.path=x.jsonl", "critic={eps_clip: 0.3}"],
        job="sft",
    )
    (line,) = fields_without_effect(sft, job="sft", engine="fsdp")
    assert line.startswith("critic.eps_clip=0.3 has no effect in `laden sft`")
    ppo = load_config(rl, [*base, "critic={backend: 'roundpipe:d1', fsdp: {offload_params: true}}"], job="rl")
    (line,) = fields_without_effect(ppo, job="rl", engine="fsdp")
    assert (
        line.startswith("critic.fsdp.offload_params=True has no effect") and "critic.backend=fsdp:..." in line
    )
