"""Every training engine keeps the `TrainEngine` protocol, built the way the trainers build it (its backend
object from `actor.backend`): fsdp in one process and on two gloo ranks, roundpipe, archon (its first
conformance test). The same custom per-token objective, one SGD step and a checkpoint round trip are
checked against plain PyTorch autograd (`protocol_reference`) in fp32 on the CPU."""

from __future__ import annotations

import pytest
import torch
from protocol_reference import (
    WeightedTokenLoss,
    packed_batches,
    protocol_engine,
    reference_weighted_grads,
    sgd_step_reference,
)
from tiny import tiny_qwen3_config
from workers import run_workers

from laden.engine.base import TrainEngine
from laden.model.hf.export import hf_state_names

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 96
LR = 0.5
NORMALIZER = 7.0  # any positive number the ranks agree on (not the token count, so it is really used)
BATCHES = packed_batches(VOCAB, num_micro_batches=4, docs_per_mb=2, seed=5)


def _model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=VOCAB), dtype=torch.float32)


def _engine(backend: str) -> TrainEngine:
    engine = protocol_engine(backend, _model(), lr=LR)
    assert isinstance(engine, TrainEngine)
    return engine


def _step(engine: TrainEngine, batches) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(this rank's loss, the weights after one step, after a checkpoint round trip into a fresh engine)."""
    loss = engine.forward_backward(batches, WeightedTokenLoss(), normalizer=NORMALIZER)
    engine.optimizer_step()
    assert engine.version == 1
    weights = {n: t.clone() for n, t in engine.named_weights(torch.float32)}
    return float(loss), weights, engine.state_dict()


def _check(loss: float, weights: dict[str, torch.Tensor]) -> None:
    model = _model()
    ref_loss, grads = reference_weighted_grads(model, BATCHES, NORMALIZER)
    torch.testing.assert_close(torch.tensor(loss), ref_loss)
    assert list(weights) == hf_state_names(model)
    for name, value in sgd_step_reference(model, grads, LR).items():
        torch.testing.assert_close(weights[name], value, msg=name)


@pytest.mark.parametrize("backend", ["fsdp:d1", "roundpipe:d1", "archon:d1"])
def test_one_process_engines_keep_the_protocol(backend):
    engine = _engine(backend)
    loss, weights, state = _step(engine, BATCHES)
    _check(loss, weights)
    fresh = _engine(backend)
    fresh.load_state_dict(state)
    assert fresh.version == 1
    for name, tensor in fresh.named_weights(torch.float32):
        torch.testing.assert_close(tensor, weights[name], msg=name)


def _rank(rank: int, world_size: int):
    engine = _engine(f"fsdp:d{world_size}")
    assert (engine.dp_rank, engine.dp_size) == (rank, world_size)
    loss, weights, _ = _step(engine, BATCHES[rank::world_size])  # each rank its share, one normaliser
    return loss, weights


def test_fsdp_on_two_gloo_ranks_keeps_the_protocol():
    (loss0, weights0), (loss1, weights1) = run_workers(_rank, 2)
    assert loss0 == loss1  # the global loss, reduced over the ranks
    _check(loss0, weights0)
    for name in weights0:
        assert torch.equal(weights0[name], weights1[name]), name
