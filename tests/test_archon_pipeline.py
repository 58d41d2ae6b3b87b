"""Pipeline parallel stages (`laden.engine.archon.pipeline`) on gloo equal a plain one-process step.

The reference is stock Hugging Face: each document through the model's own forward on its own (no
packing, no laden code), the summed next-token cross-entropy over the loss tokens divided by the
step's loss-token count, `torch.nn.utils.clip_grad_norm_` and `torch.optim.SGD` (Adam's first step,
about lr * sign(g), would turn float noise in near-zero gradients into whole steps).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from workers import run_workers

from laden.engine.archon.pipeline import pad_to, stage_bounds

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
                                                     "actor.optimizer.warmup_steps_proportion=0", "actor.optimizer.gradient_clipping=0.5"])  # fmt: skip
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


def _stage(rank, world, tied, schedule):
    from laden.data import pack_samples
    from laden.engine.archon.pipeline import PipelineTrainer

    model = _model(tied)
    trainer = PipelineTrainer(model, optim=_settings(), schedule=schedule, plan_tokens=32)
    mbs = [pack_samples(mb) for mb in _samples()]
    out = trainer.train_batch(mbs, global_num_loss_tokens=sum(mb.num_loss_tokens for mb in mbs))
    grads = {n: p.grad.clone() for n, p in trainer.named}
    params = {n: p.detach().clone() for n, p in trainer.named}
    return (
        float(out["loss"]),
        float(out["grad_norm"]),
        grads,
        params,
        [(r.start, r.stop) for r in trainer.bounds],
    )


@pytest.mark.parametrize(
    ("world", "tied", "schedule"), [(2, False, "1F1B"), (2, True, "GPipe"), (3, True, "1F1B")]
)
def test_pipeline_stages_equal_one_process(world, tied, schedule):
    loss, grads, norm, params = _reference(tied)
    results = run_workers(_stage, world, tied, schedule)
    bounds = results[0][4]
    assert [b[0] for b in bounds] == [0, *[b[1] for b in bounds[:-1]]] and bounds[-1][1] == 5  # 5 steps, cut
    for rank_loss, rank_norm, rank_grads, rank_params, _ in results:
        assert rank_loss == pytest.approx(loss, rel=1e-5) and rank_norm == pytest.approx(norm, rel=1e-4)
        for name, value in rank_grads.items():  # clipped in place, as the reference's
            torch.testing.assert_close(value, grads[name], rtol=1e-4, atol=1e-6, msg=name)
        for name, value in rank_params.items():
            torch.testing.assert_close(value, params[name], rtol=1e-5, atol=1e-6, msg=name)
    held = {n for r in results for n in r[3]}
    assert held == set(params)  # every parameter is on some stage


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
