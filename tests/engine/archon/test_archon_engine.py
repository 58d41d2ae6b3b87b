"""The archon engine (`laden.engine.archon`) on gloo equals a plain one-process step at every layout.

The reference is stock Hugging Face: each document through the model's own forward on its own (no
packing, no laden code), the summed next-token cross-entropy over the loss tokens divided by the
step's loss-token count, `torch.nn.utils.clip_grad_norm_` and `torch.optim.SGD` (Adam's first step,
about lr * sign(g), would turn float noise in near-zero gradients into whole steps).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from workers import run_workers

from laden.engine.archon.pipeline import pad_to, padded_count, stage_bounds

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = ([7, 9, 5], [12, 3], [8, 8], [6, 4, 4])


def _model(tied: bool):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _samples():
    g = torch.Generator().manual_seed(1)
    return [
        [(torch.randint(3, 128, (n,), generator=g).tolist(), [0, 0] + [1] * (n - 2)) for n in mb]
        for mb in LENGTHS
    ]


def _settings():
    from laden.config import load_config
    from laden.optim import OptimSettings

    cfg = load_config("laden/assets/sft_tiny.yaml", ["actor.optimizer.type=sgd", "actor.optimizer.lr=1e-1", "actor.optimizer.lr_scheduler_type=constant",
                                                     "actor.optimizer.warmup_steps_proportion=0", "actor.optimizer.gradient_clipping=0.5",
                                                     "actor.optimizer.weight_decay=0"])  # fmt: skip
    return OptimSettings.from_config(cfg.actor.optimizer, 10)


def _reference(tied: bool):
    model = _model(tied)
    samples = [s for mb in _samples() for s in mb]
    tokens = sum(sum(mask[1:]) for _, mask in samples)
    loss = torch.zeros(())
    for ids, mask in samples:
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        per = F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
        loss = loss + (per * torch.tensor(mask[1:], dtype=torch.float32)).sum()
    loss = loss / tokens
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}  # clipped
    torch.optim.SGD(model.parameters(), lr=1e-1).step()
    return float(loss), grads, float(norm), {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine(model, dp, pp, schedule="1F1B", optim=None, recompute=False, tp=1, cp=1):
    from laden.engine.archon import ArchonEngine

    return ArchonEngine(model, dp=dp, pp=pp, tp=tp, cp=cp, optim=optim or _settings(), schedule=schedule, virtual_stages=2,
                        plan_tokens=32, dtype=torch.float32, device=torch.device("cpu"),
                        gradient_checkpointing=recompute)  # fmt: skip


def _share(dp_rank, dp):
    """This data-parallel rank's micro-batches of the step, and the step's loss-token count."""
    from laden.data import pack_samples

    every = [pack_samples(mb) for mb in _samples()]
    return every[dp_rank::dp], sum(mb.num_loss_tokens for mb in every)


def _layout(rank, world, tied, schedule, dp, pp):
    recompute = schedule.endswith("+recompute")
    context = schedule.endswith("+context")
    rest = world // (dp * pp)  # tensor parallel, or context parallel for a "+context" schedule
    engine = _engine(_model(tied), dp, pp, schedule.split("+")[0], recompute=recompute,
                     tp=1 if context else rest, cp=rest if context else 1)  # fmt: skip
    mbs, total = _share(engine.dp_rank, dp)
    before = float(engine.eval_batch(mbs, global_num_loss_tokens=total)["loss"])
    out = engine.train_batch(mbs, global_num_loss_tokens=total)
    weights = {n: t.clone() for n, t in engine.named_weights(torch.float32)}
    logprobs = [r["logprobs"] for r in engine.forward(mbs)]
    return before, float(out["loss"]), float(out["grad_norm"]), weights, logprobs, engine.dp_rank


LAYOUTS = [  # (world, tied, schedule, d, p)
    (2, False, "1F1B", 1, 2),
    (2, True, "GPipe", 1, 2),
    (2, True, "Interleaved1F1B", 1, 2),
    (3, True, "1F1B", 1, 3),
    (2, True, "1F1B", 2, 1),
    (4, True, "1F1B", 2, 2),
    (2, True, "1F1B+recompute", 1, 2),  # per-layer recompute (actor.gradient_checkpointing) inside the stages
    (2, True, "1F1B", 1, 1),  # d1t2: tensor parallel (the rest of the world)
    (4, False, "1F1B", 1, 2),  # d1p2t2
    (2, True, "1F1B+context", 1, 1),  # d1c2: Ulysses context parallel
    (4, True, "1F1B+context", 1, 2),  # d1p2c2
]


@pytest.mark.parametrize(("world", "tied", "schedule", "dp", "pp"), LAYOUTS)
def test_layouts_equal_one_process(world, tied, schedule, dp, pp):
    """archon:d1p2/d1p3/d2/d2p2/d1t2/d1p2t2 under each schedule == stock Hugging Face in one process: the loss before and
    after, the clipping norm, every updated weight (named_weights, on every rank), forward's log-probs."""
    loss, _, norm, params = _reference(tied)
    updated = _model(tied)
    updated.load_state_dict(params, strict=False)  # a tied head is the embedding
    for before, after, rank_norm, weights, logprobs, dp_rank in run_workers(
        _layout, world, tied, schedule, dp, pp
    ):
        assert before == pytest.approx(loss, rel=1e-5) and after == pytest.approx(loss, rel=1e-5)
        assert rank_norm == pytest.approx(norm, rel=1e-4)
        assert weights.keys() == {n for n in params if not (tied and n == "lm_head.weight")}
        for name, value in weights.items():
            torch.testing.assert_close(value, params[name], rtol=1e-5, atol=1e-6, msg=name)
        for mb, got in zip(_samples()[dp_rank::dp], logprobs):
            want = torch.cat([_reference_logprobs(updated, ids, mask) for ids, mask in mb])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def _reference_logprobs(model, ids, mask):
    """log p(next token) where the next token has a label, 0 elsewhere and at the document's last token."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return torch.cat([picked * torch.tensor(mask[1:], dtype=torch.float32), torch.zeros(1)])


def _adam():
    from laden.config import load_config
    from laden.optim import OptimSettings

    # eps well above float noise: Adam's first steps (about lr * sign(g)) would turn noise in near-zero
    # gradients, which differs between layouts, into whole steps
    cfg = load_config("laden/assets/sft_tiny.yaml", ["actor.optimizer.lr=1e-2", "actor.optimizer.lr_scheduler_type=constant",
                                                     "actor.optimizer.warmup_steps_proportion=0", "actor.optimizer.eps=1e-3"])  # fmt: skip
    return OptimSettings.from_config(cfg.actor.optimizer, 10)


def _steps(engine, dp, num_steps):
    for _ in range(num_steps):
        mbs, total = _share(engine.dp_rank, dp)
        engine.train_batch(mbs, global_num_loss_tokens=total)


def _save_after_one(rank, world, path, dp, pp):
    from laden.engine.checkpoint import save_engine

    engine = _engine(_model(True), dp, pp, optim=_adam())
    _steps(engine, dp, 1)
    save_engine(engine, Path(path), rank=rank)


def _resume_and_step(rank, world, path, dp, pp):
    from laden.engine.checkpoint import load_engine

    engine = _engine(_model(True), dp, pp, optim=_adam())
    load_engine(engine, Path(path))
    _steps(engine, dp, 1)
    return engine.version, {n: t.clone() for n, t in engine.named_weights(torch.float32)}


def test_checkpoint_saved_at_d2p2_resumes_at_d1_and_d1p2_and_equals_uninterrupted(tmp_path):
    """Adam (its states matter): two steps in one plain process == one step at d2p2, saved, then one more
    in one plain process or at d1p2 after loading."""
    from laden.engine.checkpoint import load_engine

    engine = _engine(_model(True), 1, 1, optim=_adam())
    _steps(engine, 1, 2)
    want = {n: t.clone() for n, t in engine.named_weights(torch.float32)}
    run_workers(_save_after_one, 4, str(tmp_path), 2, 2)
    plain = _engine(_model(True), 1, 1, optim=_adam())
    load_engine(plain, tmp_path)
    _steps(plain, 1, 1)
    resumed = [(plain.version, dict(plain.named_weights(torch.float32)))]
    resumed += run_workers(_resume_and_step, 2, str(tmp_path), 1, 2)
    for version, weights in resumed:
        assert version == 2 and weights.keys() == want.keys()
        for name, value in weights.items():
            torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_stage_bounds_balance_costs_not_counts():
    assert stage_bounds([10, 1, 1, 1, 1, 10], 2) == [range(0, 3), range(3, 6)]
    assert stage_bounds([30, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 6)]
    assert stage_bounds([1, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match="cannot cut 2 pipeline steps into 3 stages"):
        stage_bounds([1, 1], 3)


def test_pad_to_adds_a_document_without_loss():
    from laden.data import pack_samples

    mb = pack_samples([([5, 6, 7], [0, 1, 1])])
    padded = pad_to(mb, 8)
    assert padded.num_tokens == 8 and padded.cu_seqlens.tolist() == [0, 3, 8] and padded.seqlens == [3]
    assert padded.labels.tolist()[3:] == [-100] * 5 and padded.position_ids.tolist()[3:] == [0, 1, 2, 3, 4]
    assert padded.num_loss_tokens == mb.num_loss_tokens


def test_schedules_get_the_micro_batch_counts_they_accept():
    assert padded_count(1, name="1F1B", num_ranks=2) == 2 and padded_count(3, name="1F1B", num_ranks=2) == 3
    assert padded_count(3, name="Interleaved1F1B", num_ranks=2) == 4
    assert padded_count(1, name="GPipe", num_ranks=4) == 1


# ---------------------------------------------------------------- Mixture of Experts, expert parallel


def _moe_model():
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _moe_engine(dp, pp, ep, coef=0.01, optim=None, tp=1, cp=1):
    from laden.engine.archon import ArchonEngine

    return ArchonEngine(_moe_model(), dp=dp, pp=pp, ep=ep, tp=tp, cp=cp, optim=optim or _settings(), plan_tokens=32,
                        dtype=torch.float32, device=torch.device("cpu"), router_aux_loss_coef=coef)  # fmt: skip


def _moe_layout(rank, world, dp, pp, ep, tp=1, cp=1, coef=0.01):
    engine = _moe_engine(dp, pp, ep, coef=coef, tp=tp, cp=cp)
    mbs, total = _share(engine.dp_rank, dp)
    out = engine.train_batch(mbs, global_num_loss_tokens=total)
    return (
        float(out["loss"]),
        float(out["grad_norm"]),
        {n: t.clone() for n, t in engine.named_weights(torch.float32)},
        {k: float(v) for k, v in out.items() if k.startswith("moe_")},
    )


def _assert_moe_metrics(
    got: dict, want: dict, names=("moe_aux_loss", "moe_expert_load_max", "moe_dropped_fraction")
):
    """Every rank reports the whole model's routing figures over the whole step, as one process does."""
    for name in names:
        assert got[name] == pytest.approx(float(want[name]), rel=1e-5, abs=1e-7), name


def test_moe_without_router_loss_equals_stock_hugging_face():
    """archon:d1 on a Qwen3-MoE model, router loss off: stock Hugging Face's per-document loss and update."""
    from laden.data import pack_samples

    model = _moe_model()
    samples = [s for mb in _samples() for s in mb]
    tokens = sum(sum(mask[1:]) for _, mask in samples)
    loss = sum(
        (F.cross_entropy(model(input_ids=torch.tensor([ids])).logits[0, :-1], torch.tensor(ids[1:]), reduction="none")
         * torch.tensor(mask[1:], dtype=torch.float32)).sum() for ids, mask in samples) / tokens  # fmt: skip
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    torch.optim.SGD(model.parameters(), lr=1e-1).step()
    engine = _moe_engine(1, 1, 1, coef=0.0)
    mbs = [pack_samples(mb) for mb in _samples()]
    out = engine.train_batch(mbs, global_num_loss_tokens=tokens)
    assert float(out["loss"]) == pytest.approx(float(loss), rel=1e-5) and float(out["moe_aux_loss"]) > 0
    want = dict(model.named_parameters())
    for name, value in engine.named_weights(torch.float32):
        torch.testing.assert_close(value, want[name].detach(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(("world", "dp", "pp", "ep"), [(2, 2, 1, 2), (4, 2, 2, 2)])
def test_expert_parallel_layouts_equal_one_process(world, dp, pp, ep):
    """archon:d2e2 and archon:d2p2e2 (experts split over two ranks, tokens exchanged all-to-all) == the same
    MoE model with its router loss in one process: loss, clipping norm, every updated weight."""
    from laden.data import pack_samples

    engine = _moe_engine(1, 1, 1)
    every = [pack_samples(mb) for mb in _samples()]
    out = engine.train_batch(every, global_num_loss_tokens=sum(mb.num_loss_tokens for mb in every))
    want = {n: t.clone() for n, t in engine.named_weights(torch.float32)}
    assert float(out["moe_aux_loss"]) > 0 and float(out["moe_expert_load_max"]) > 1
    for loss, norm, weights, metrics in run_workers(_moe_layout, world, dp, pp, ep):
        _assert_moe_metrics(metrics, out)
        assert loss == pytest.approx(float(out["loss"]), rel=1e-5)
        assert norm == pytest.approx(float(out["grad_norm"]), rel=1e-4)
        assert weights.keys() == want.keys()
        for name, value in weights.items():
            torch.testing.assert_close(value, want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("world", "dp", "ep", "tp", "cp"), [(2, 1, 1, 2, 1), (2, 1, 1, 1, 2), (4, 2, 2, 2, 1), (4, 2, 2, 1, 2)]
)
def test_tensor_and_context_parallel_beside_experts_equal_one_process(world, dp, ep, tp, cp):
    """archon:d1t2, d1c2, d2t2e2 and d2c2e2 on the MoE model: the experts (and routers) whole on each tensor
    rank, each context rank routing its own slice of the tokens; == one process. The router loss is over a
    forward's tokens, which context parallel slices: it is off for c2 (and on for t2)."""
    from laden.data import pack_samples

    coef = 0.0 if cp > 1 else 0.01
    engine = _moe_engine(1, 1, 1, coef=coef)
    every = [pack_samples(mb) for mb in _samples()]
    out = engine.train_batch(every, global_num_loss_tokens=sum(mb.num_loss_tokens for mb in every))
    want = {n: t.clone() for n, t in engine.named_weights(torch.float32)}
    for loss, norm, weights, metrics in run_workers(_moe_layout, world, dp, 1, ep, tp, cp, coef):
        # a context rank's router loss is over its slice of the tokens; the expert loads add up
        _assert_moe_metrics(
            metrics, out, ("moe_expert_load_max",) if cp > 1 else ("moe_aux_loss", "moe_expert_load_max")
        )
        assert loss == pytest.approx(float(out["loss"]), rel=1e-5)
        assert norm == pytest.approx(float(out["grad_norm"]), rel=1e-4)
        assert weights.keys() == want.keys()
        for name, value in weights.items():
            torch.testing.assert_close(value, want[name], rtol=1e-4, atol=1e-6, msg=name)


def _moe_save_after_one(rank, world, path):
    from laden.engine.checkpoint import save_engine

    engine = _moe_engine(2, 2, 2, optim=_adam())
    _steps(engine, 2, 1)
    save_engine(engine, Path(path), rank=rank)


def test_moe_checkpoint_saved_at_d2p2e2_resumes_at_d1_and_equals_uninterrupted(tmp_path):
    from laden.engine.checkpoint import load_engine

    engine = _moe_engine(1, 1, 1, optim=_adam())
    _steps(engine, 1, 2)
    want = {n: t.clone() for n, t in engine.named_weights(torch.float32)}
    run_workers(_moe_save_after_one, 4, str(tmp_path))
    resumed = _moe_engine(1, 1, 1, optim=_adam())
    load_engine(resumed, tmp_path)
    _steps(resumed, 1, 1)
    assert resumed.version == 2
    for name, value in resumed.named_weights(torch.float32):
        torch.testing.assert_close(value, want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_megatron_modes_run_on_archon_with_one_warning(caplog):
    import logging

    from laden.config import load_config
    from laden.engine.archon import ArchonEngine
    from laden.engine.factory import build_engine

    cfg = load_config("examples/sft_tiny.yaml", ["actor.backend=megatron:d1"], job="sft")
    with caplog.at_level(logging.WARNING, logger="laden.archon"):
        engine = build_engine(cfg, _model(True), total_steps=2, device=torch.device("cpu"))
    assert isinstance(engine, ArchonEngine) and (engine.dp, engine.pp, engine.ep) == (1, 1, 1)
    assert caplog.text.count("laden has no Megatron-Core") == 1


def test_offloaded_and_onloaded_trains_as_never_offloaded():
    from laden.engine.base import OffloadedError

    plain, moved = _engine(_model(True), 1, 1, optim=_adam()), _engine(_model(True), 1, 1, optim=_adam())
    _steps(plain, 1, 2)
    _steps(moved, 1, 1)
    moved.offload()
    with pytest.raises(OffloadedError, match="onload"):
        _steps(moved, 1, 1)
    moved.onload()
    _steps(moved, 1, 1)
    want = dict(plain.named_weights(torch.float32))
    for name, value in moved.named_weights(torch.float32):
        assert torch.equal(value, want[name]), name


def test_moe_settings_on_a_dense_model_are_named_as_doing_nothing(caplog):
    import logging

    from laden.config import load_config
    from laden.engine.factory import build_engine

    overrides = [
        "actor.backend=archon:d1",
        "actor.archon.router_aux_loss_coef=0.01",
        "actor.archon.moe_capacity_factor=1.5",
    ]
    cfg = load_config("examples/sft_tiny.yaml", overrides, job="sft")
    with caplog.at_level(logging.WARNING, logger="laden.archon"):
        build_engine(cfg, _model(True), total_steps=2, device=torch.device("cpu"))
    assert "actor.archon.router_aux_loss_coef=0.01, actor.archon.moe_capacity_factor=1.5" in caplog.text
    assert "has no Mixture-of-Experts layers" in caplog.text
    caplog.clear()
    plain = load_config("examples/sft_tiny.yaml", ["actor.backend=archon:d1"], job="sft")
    with caplog.at_level(logging.WARNING, logger="laden.archon"):
        build_engine(plain, _model(True), total_steps=2, device=torch.device("cpu"))
    assert "Mixture-of-Experts" not in caplog.text


def test_an_moe_evaluation_before_the_first_step_runs():
    """`laden sft` evaluates before training (`evaluator.eval_before_train`): an MoE model's forward without a
    training step before it has no loss scale of a step yet, and must not need one."""
    from laden.data import pack_samples

    engine = _moe_engine(dp=1, pp=1, ep=1)
    mbs = [pack_samples(mb) for mb in _samples()]
    out = engine.eval_batch(mbs, global_num_loss_tokens=sum(mb.num_loss_tokens for mb in mbs))
    assert torch.isfinite(out["loss"])
