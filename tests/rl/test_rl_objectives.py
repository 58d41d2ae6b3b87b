"""PPO-family objectives and GRPO advantages against plain PyTorch references written here.

The objective's reference walks the documents one at a time on full fp32 logits
(`log_softmax(logits / temperature)`), selects the loss tokens and writes each formula out:
clip, clip-higher, dual clip, GSPO's sequence ratio, the decoupled loss's behaviour weight and
cap, the k1/k2/k3 KL terms, token- and sequence-level averaging. `PPOObjective` must give the
same loss and the same gradients wrt the hidden states and the head weight, chunked (3 tokens
a chunk) and in one chunk, and the same gradients of every model parameter through the fsdp
engine. Advantages are checked against numbers worked out by hand.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from fsdp_cases import VOCAB, tiny_model

from laden.data.batch import IGNORE_INDEX, PackedBatch, pack_samples
from laden.engine.fsdp import FSDPEngine
from laden.optim import OptimSettings
from laden.rl import (
    DR_GRPO_NORM,
    GRPO_NORM,
    AdvantageSettings,
    NormSettings,
    PPOObjective,
    PPOSettings,
    dynamic_sampling_filter,
    grpo_advantages,
    mask_no_eos_with_zero,
    normalize,
    overlong_penalty,
    shape_rewards,
)

pytestmark = pytest.mark.usefixtures("one_thread")

V, H = 13, 8
EPS = 1e-5  # NormSettings' default

# ------------------------------------------------------------------ reference


def reference_loss(logits: torch.Tensor, batch: PackedBatch, s: PPOSettings) -> torch.Tensor:
    """The summed PPO loss of a packed row from its full `[T, V]` logits, one document at a time."""
    logp_all = torch.log_softmax(logits.float() / s.temperature, dim=-1)  # [T, V]
    f = batch.fields
    total = logits.new_zeros(())
    bounds = batch.cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        keep = batch.labels[a:b] != IGNORE_INDEX
        if not keep.any():
            continue
        lp = logp_all[a:b][keep].gather(1, batch.labels[a:b][keep][:, None])[:, 0]
        adv, behav = f["advantages"][a:b][keep], f["old_logprobs"][a:b][keep]
        base = f["prox_logprobs"][a:b][keep] if s.use_decoupled_loss else behav
        if s.importance_sampling_level == "sequence":
            ratio = torch.exp((lp - base).mean()).expand_as(lp)
            adv = adv.mean().expand_as(lp)
        else:
            ratio = torch.exp(lp - base)
        high = 1 + (s.eps_clip if s.eps_clip_higher is None else s.eps_clip_higher)
        objective = torch.min(ratio * adv, ratio.clamp(1 - s.eps_clip, high) * adv)
        if s.c_clip is not None:
            objective = torch.where(adv < 0, torch.max(objective, s.c_clip * adv), objective)
        loss = -objective
        if s.use_decoupled_loss:
            w = torch.exp(base - behav)
            if s.behav_imp_weight_cap is not None:
                w = torch.where(w <= s.behav_imp_weight_cap, w, torch.zeros_like(w))
            loss = loss * w
        if s.kl_ctl:
            d = lp - f["ref_logprobs"][a:b][keep]
            kl = {"k1": d, "k2": d**2 / 2, "k3": torch.exp(-d) - 1 + d}[s.kl_estimator]
            loss = loss + s.kl_ctl * kl.clamp(-10, 10)
        total = total + (loss.mean() if s.loss_agg_mode == "seq-mean-token-mean" else loss.sum())
    return total


def with_ppo_fields(batch: PackedBatch, logp: torch.Tensor, seed: int) -> PackedBatch:
    """Advantages and old / proximal / reference log-probs around `logp`, spread wide enough that
    every clip, the dual clip and the cap bind on some tokens; 0 where the label is -100."""
    g = torch.Generator().manual_seed(seed)
    mask = batch.labels != IGNORE_INDEX

    def field(values: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, values, torch.zeros_like(values))

    def noise() -> torch.Tensor:
        return torch.randn(batch.num_tokens, generator=g)

    return batch.with_fields(
        advantages=field(noise()),
        old_logprobs=field(logp + 0.5 * noise()),
        prox_logprobs=field(logp + 0.3 * noise()),
        ref_logprobs=field(logp + 0.5 * noise()),
    )


def token_problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, PackedBatch]:
    """(hidden [T, H], head weight [V, H], batch): five documents (one without loss tokens) plus padding."""
    g = torch.Generator().manual_seed(seed)
    lengths, prompts = [7, 5, 9, 3, 6], [2, 1, 3, 3, 0]
    samples = [
        (torch.randint(0, V, (n,), generator=g).tolist(), [0] * p + [1] * (n - p))
        for n, p in zip(lengths, prompts)
    ]
    batch = pack_samples(samples, pad_to_multiple_of=8)
    hidden = torch.randn(batch.num_tokens, H, generator=g)
    weight = 0.5 * torch.randn(V, H, generator=g)
    logp = torch.log_softmax(hidden @ weight.T, -1).gather(1, batch.labels.clamp(min=0)[:, None])[:, 0]
    return hidden, weight, with_ppo_fields(batch, logp, seed)


CASES = {
    "token_clip": PPOSettings(),
    "clip_higher": PPOSettings(eps_clip=0.1, eps_clip_higher=0.28),
    "dual_clip": PPOSettings(c_clip=1.5),
    "seq_mean": PPOSettings(loss_agg_mode="seq-mean-token-mean"),
    "gspo": PPOSettings(importance_sampling_level="sequence", eps_clip=0.1),
    "gspo_seq_mean": PPOSettings(importance_sampling_level="sequence", loss_agg_mode="seq-mean-token-mean"),
    "decoupled": PPOSettings(use_decoupled_loss=True),
    "decoupled_cap": PPOSettings(use_decoupled_loss=True, behav_imp_weight_cap=1.5),
    "kl_k1": PPOSettings(kl_ctl=0.1, kl_estimator="k1"),
    "kl_k2": PPOSettings(kl_ctl=0.1, kl_estimator="k2"),
    "kl_k3": PPOSettings(kl_ctl=0.1, kl_estimator="k3"),
    "everything": PPOSettings(
        eps_clip_higher=0.28,
        c_clip=2.0,
        use_decoupled_loss=True,
        behav_imp_weight_cap=2.0,
        kl_ctl=0.05,
        kl_estimator="k3",
        loss_agg_mode="seq-mean-token-mean",
        temperature=0.7,
    ),
}


def loss_and_grads(fn, hidden: torch.Tensor, weight: torch.Tensor):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w)
    return (loss.detach(), *torch.autograd.grad(loss, (h, w)))


# ------------------------------------------------------------------ the objective


@pytest.mark.parametrize("chunk_size", [3, 1024], ids=["chunked", "one_chunk"])
@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_grads_equal_reference(case: str, chunk_size: int):
    hidden, weight, batch = token_problem()
    settings = CASES[case]
    objective = PPOObjective(settings, chunk_size=chunk_size)
    assert chunk_size == 1024 or chunk_size < batch.num_tokens
    got = loss_and_grads(lambda h, w: objective(h, w, batch), hidden, weight)
    want = loss_and_grads(lambda h, w: reference_loss(h @ w.T, batch, settings), hidden, weight)
    for name, g, r in zip(("loss", "grad_hidden", "grad_weight"), got, want):
        torch.testing.assert_close(g, r, msg=name)
    assert got[1].abs().sum() > 0 and got[2].abs().sum() > 0  # some token is inside its clip range


def test_each_case_exercises_its_branch():
    """The data make every bound bind on some tokens but not on all, so the tests above see both sides."""
    hidden, weight, batch = token_problem()
    stats = {}
    for case in ("token_clip", "dual_clip", "decoupled_cap"):
        objective = PPOObjective(CASES[case], chunk_size=3)
        objective(hidden, weight, batch)
        stats[case] = objective.last_stats
    assert 0 < stats["token_clip"]["clip_fraction"] < 1
    assert 0 < stats["dual_clip"]["dual_clip_fraction"] < 1
    assert 0 < stats["decoupled_cap"]["behav_capped_fraction"] < 1


def test_stats_are_means_over_loss_tokens_and_pop_weights_by_tokens():
    hidden, weight, batch = token_problem()
    objective = PPOObjective(PPOSettings(), chunk_size=4)
    objective(hidden, weight, batch)
    stats = objective.last_stats
    mask = batch.labels != IGNORE_INDEX
    logp = torch.log_softmax(hidden @ weight.T, -1).gather(1, batch.labels.clamp(min=0)[:, None])[:, 0]
    log_ratio = (logp - batch.fields["old_logprobs"])[mask]
    adv = batch.fields["advantages"][mask]
    ratio = log_ratio.exp()
    clipped = (-adv * ratio) < (-adv * ratio.clamp(0.8, 1.2))
    assert stats["num_loss_tokens"] == batch.num_loss_tokens
    torch.testing.assert_close(stats["clip_fraction"], clipped.float().mean())
    torch.testing.assert_close(stats["importance_weight"], ratio.mean())
    torch.testing.assert_close(stats["approx_kl"], log_ratio.mean())
    assert all(not v.requires_grad for v in stats.values())

    hidden2, weight2, batch2 = token_problem(seed=1)
    objective(hidden2, weight2, batch2)
    second = objective.last_stats
    popped = objective.pop_stats()
    n1, n2 = stats["num_loss_tokens"], second["num_loss_tokens"]
    torch.testing.assert_close(popped["num_loss_tokens"], n1 + n2)
    for name in ("clip_fraction", "importance_weight", "approx_kl", "entropy"):
        torch.testing.assert_close(popped[name], (stats[name] * n1 + second[name] * n2) / (n1 + n2), msg=name)
    assert objective.pop_stats() == {}


def test_loss_normalizer_counts_tokens_or_sequences_with_loss():
    _, _, batch = token_problem()
    assert PPOObjective(PPOSettings()).loss_normalizer([batch, batch]) == 2 * batch.num_loss_tokens
    seq_mean = PPOObjective(PPOSettings(loss_agg_mode="seq-mean-token-mean"))
    assert seq_mean.loss_normalizer([batch, batch]) == 2 * 4  # the 3-token prompt-only document has none


def test_settings_report_every_error_at_once():
    with pytest.raises(ValueError) as info:
        PPOSettings(eps_clip=1.5, c_clip=0.5, behav_imp_weight_cap=3.0, kl_estimator="k4")  # type: ignore[arg-type]
    message = str(info.value)
    for part in ("actor.eps_clip=1.5", "actor.c_clip=0.5", "use_decoupled_loss: true", "kl_estimator='k4'"):
        assert part in message
    with pytest.raises(ValueError, match="must be > 1"):
        PPOSettings(use_decoupled_loss=True, behav_imp_weight_cap=0.9)
    with pytest.raises(ValueError, match="loss_chunk_size"):
        PPOObjective(chunk_size=0)


def test_missing_field_and_context_parallel_slice_are_refused():
    hidden, weight, batch = token_problem()
    no_ref = replace(batch, fields={k: v for k, v in batch.fields.items() if k != "ref_logprobs"})
    with pytest.raises(ValueError, match="'ref_logprobs'"):
        PPOObjective(PPOSettings(kl_ctl=0.1))(hidden, weight, no_ref)
    PPOObjective(PPOSettings())(hidden, weight, no_ref)  # read only when the KL term is on
    sliced = replace(batch, seqlens=[*batch.seqlens, batch.num_tokens])  # documents longer than the row
    with pytest.raises(ValueError, match="context-parallel slice"):
        PPOObjective(PPOSettings(importance_sampling_level="sequence"))(hidden, weight, sliced)
    PPOObjective(PPOSettings())(hidden, weight, sliced)  # token-level needs no documents


# ------------------------------------------------------------------ through the fsdp engine


def model_logits(model, batch: PackedBatch) -> torch.Tensor:
    """`[T, V]` logits of a packed row, each document through the model on its own."""
    bounds = batch.cu_seqlens.tolist()
    docs = [batch.input_ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat([model(input_ids=d[None]).logits[0] for d in docs])


def engine_batches(temperature: float) -> list[PackedBatch]:
    g = torch.Generator().manual_seed(5)
    ref = tiny_model()
    out = []
    for mb in range(2):
        samples = []
        for _ in range(3):
            n = int(torch.randint(4, 9, (1,), generator=g))
            prompt = int(torch.randint(1, n - 1, (1,), generator=g))
            samples.append(
                (torch.randint(4, VOCAB, (n,), generator=g).tolist(), [0] * prompt + [1] * (n - prompt))
            )
        batch = pack_samples(samples)
        with torch.no_grad():
            logp = torch.log_softmax(model_logits(ref, batch).float() / temperature, -1)
        out.append(with_ppo_fields(batch, logp.gather(1, batch.labels.clamp(min=0)[:, None])[:, 0], seed=mb))
    return out


@pytest.mark.parametrize("case", ["everything", "gspo_seq_mean"])
def test_fsdp_engine_gradients_equal_reference(case: str):
    settings = replace(CASES[case], temperature=0.7)
    batches = engine_batches(settings.temperature)
    objective = PPOObjective(settings, chunk_size=5)
    normalizer = objective.loss_normalizer(batches)
    engine = FSDPEngine(
        tiny_model(),
        device=torch.device("cpu"),
        dtype=torch.float32,
        optimizer_dtype=torch.float32,
        optim=OptimSettings(type="sgd", lr=0.1, weight_decay=0.0, gradient_clipping=0.0, total_steps=1),
    )
    loss = engine.forward_backward(batches, objective, normalizer=normalizer)

    ref = tiny_model()
    want = sum(reference_loss(model_logits(ref, mb), mb, settings) for mb in batches) / normalizer
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in engine.model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], msg=name)


# ------------------------------------------------------------------ advantages


def test_grpo_normalises_each_group_and_zero_std_groups_give_zero():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    std = math.sqrt(4 * 0.25 / 3)  # unbiased
    half = 0.5 / (std + EPS)
    want = torch.tensor([half, -half, -half, half, 0, 0, 0, 0])
    torch.testing.assert_close(normalize(rewards, GRPO_NORM, group_sizes=[4, 4]), want)
    biased = NormSettings(mean_level="group", std_level="group", std_unbiased=False)
    want_biased = torch.tensor([1, -1, -1, 1, 0, 0, 0, 0]) * 0.5 / (0.5 + EPS)
    torch.testing.assert_close(normalize(rewards, biased, group_sizes=[4, 4]), want_biased)


def test_dr_grpo_subtracts_the_group_mean_only():
    got = normalize([1.0, 0.0, 0.0, 1.0, 3.0, 1.0], DR_GRPO_NORM, group_sizes=[4, 2])
    torch.testing.assert_close(got, torch.tensor([0.5, -0.5, -0.5, 0.5, 1.0, -1.0]))


def test_leave_one_out_and_batch_level():
    loo = NormSettings(mean_level="group", mean_leave1out=True, std_level=None)
    got = normalize([1.0, 0.0, 0.0, 3.0], loo, group_sizes=[3, 1])
    torch.testing.assert_close(got, torch.tensor([1.0, -0.5, -0.5, 0.0]))  # a singleton is its own baseline
    got = normalize([1.0, 2.0, 3.0, 4.0], NormSettings())  # batch mean 2.5, std sqrt(5/3)
    torch.testing.assert_close(got, (torch.tensor([1.0, 2.0, 3.0, 4.0]) - 2.5) / (math.sqrt(5 / 3) + EPS))


@pytest.mark.parametrize("settings", [GRPO_NORM, NormSettings()], ids=["group", "batch"])
def test_weighted_normalisation_equals_normalising_every_token(settings: NormSettings):
    """`weights` = tokens per completion gives what normalising the per-token copies gives (AReaL's adv_norm)."""
    values = torch.tensor([1.0, 0.0, 2.0, 1.0, 3.0])
    lengths = torch.tensor([2, 3, 1, 4, 2])
    sizes = [3, 2]
    tokens = values.repeat_interleave(lengths)
    if settings.mean_level == "group":
        token_groups = tokens.split([6, 6])
        plain = torch.cat([(t - t.mean()) / (t.std() + EPS) for t in token_groups])
    else:
        plain = (tokens - tokens.mean()) / (tokens.std() + EPS)
    got = normalize(values, settings, group_sizes=sizes, weights=lengths)
    torch.testing.assert_close(got.repeat_interleave(lengths), plain)


def test_reward_shaping_overlong_penalty_and_no_eos_mask():
    got = shape_rewards([-30.0, 0.0, 2.0, 30.0], reward_bias=1.0, reward_scaling=2.0, reward_clip=20.0)
    torch.testing.assert_close(got, torch.tensor([-20.0, 2.0, 6.0, 20.0]))
    penalty = overlong_penalty(
        [5, 6, 7, 8, 10, 12], max_new_tokens=10, overlong_tokens=4, overlong_penalty_factor=1.0
    )
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    half = overlong_penalty([8], max_new_tokens=10, overlong_tokens=4, overlong_penalty_factor=0.5)
    torch.testing.assert_close(half, torch.tensor([-0.25]))
    masked = mask_no_eos_with_zero([1.0, 2.0, 3.0], [True, False, True])
    torch.testing.assert_close(masked, torch.tensor([1.0, 0.0, 3.0]))


def test_dynamic_sampling_drops_groups_of_equal_rewards():
    keep, sizes = dynamic_sampling_filter([1, 1, 1, 0, 1, 0, 2, 2], [3, 3, 2])
    assert keep.tolist() == [False, False, False, True, True, True, False, False]
    assert sizes == [3]


def test_grpo_advantages_runs_areal_order():
    """overlong penalty -> bias, scale, clip -> reward_norm -> no-EOS mask -> adv_norm."""
    settings = AdvantageSettings(
        reward_bias=-0.5,
        reward_scaling=2.0,
        reward_clip=5.0,
        reward_norm=DR_GRPO_NORM,
        mask_no_eos_with_zero=True,
        overlong_reward_penalty=True,
        overlong_tokens=4,
        overlong_penalty_factor=1.0,
    )
    inputs = dict(
        group_sizes=[2, 2], completion_lengths=[3, 8, 10, 6], has_eos=[1, 1, 0, 1], max_new_tokens=10
    )
    # penalties [0, -0.5, -1, 0] -> rewards [1, -0.5, 0, 0] -> shaped [1, -2, -1, -1]
    # -> group means -0.5 and -1 -> [1.5, -1.5, 0, 0] -> the truncated third stays 0
    got = grpo_advantages([1.0, 0.0, 1.0, 0.0], settings, **inputs)
    torch.testing.assert_close(got, torch.tensor([1.5, -1.5, 0.0, 0.0]))
    with_adv_norm = grpo_advantages(
        [1.0, 0.0, 1.0, 0.0], replace(settings, adv_norm=NormSettings()), **inputs
    )
    tokens = got.repeat_interleave(torch.tensor([3, 8, 10, 6]))
    want = (got - tokens.mean()) / (tokens.std() + EPS)  # token-weighted batch mean and std
    torch.testing.assert_close(with_adv_norm, want)


def test_advantage_inputs_are_validated():
    with pytest.raises(ValueError, match="group_sizes"):
        normalize([1.0, 2.0, 3.0], GRPO_NORM, group_sizes=[2, 2])
    with pytest.raises(ValueError, match="needs group_sizes"):
        normalize([1.0, 2.0], GRPO_NORM)
    with pytest.raises(ValueError, match="non-finite"):
        normalize([1.0, float("nan")], NormSettings())
    with pytest.raises(ValueError) as info:
        AdvantageSettings(overlong_reward_penalty=True, reward_clip=0.0)
    for part in ("actor.overlong_tokens", "actor.overlong_penalty_factor", "actor.reward_clip=0.0"):
        assert part in str(info.value)
    with pytest.raises(ValueError, match="mean_level='prompt'"):
        NormSettings(mean_level="prompt")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has_eos"):
        grpo_advantages([1.0, 0.0], AdvantageSettings(mask_no_eos_with_zero=True), group_sizes=[2])
    with pytest.raises(ValueError, match="overlong_tokens=12"):
        overlong_penalty([3], max_new_tokens=10, overlong_tokens=12, overlong_penalty_factor=1.0)
