"""Ulysses context parallel (c2 == c1) and tensor parallel (t2 == t1) on CPU gloo, both KV-head rules."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fsdp_cases import SETTINGS, STEPS, check_against_reference, run_engine, split_steps, tiny_model
from workers import run_workers

from laden.engine.fsdp import FSDPEngine
from laden.engine.parallel.ulysses import shard_packed_row
from laden.engine.parallel.vocab_parallel import vocab_parallel_cross_entropy, vocab_shard_range

# (model overrides, engine options): kv % 2 == 0 splits the KV heads; kv == 1 < 2 repeats the
# one KV head; the last case adds activation checkpointing (its recompute re-runs the collectives).
CASES = [({}, {}), ({"num_key_value_heads": 1}, {}), ({}, {"gradient_checkpointing": True})]


def _parallel_worker(rank: int, world_size: int, axis: str):
    results = []
    for overrides, options in CASES:
        engine = FSDPEngine(
            tiny_model(**overrides),
            **{axis: world_size},
            dtype=torch.float32,
            optimizer_dtype=torch.float32,
            optim=SETTINGS,
            **options,
        )
        results.append(run_engine(engine, split_steps(STEPS, 1)))
    return results, _vocab_parallel_worker(rank, world_size)


@pytest.mark.parametrize("axis", ["cp", "tp"])
def test_two_ranks_equal_one(axis):
    """c2 / t2: loss, grad norm, grads and updated params equal the plain single-process reference."""
    per_rank, vocab_parallel = zip(*run_workers(_parallel_worker, 2, axis))
    check_vocab_parallel(vocab_parallel)
    for i, (overrides, _) in enumerate(CASES):
        check_against_reference([r[i] for r in per_rank], model_fn=lambda o=overrides: tiny_model(**o))


def test_shard_packed_row_pads_with_its_own_document():
    ids = torch.arange(7)
    pos = torch.tensor([0, 1, 2, 0, 1, 2, 3])
    labels = torch.tensor([1, 2, -100, 4, 5, 6, -100])
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    shards = [shard_packed_row(ids, pos, labels, cu, 4, cp_rank=r, cp_size=3) for r in range(3)]
    assert [s.input_ids.tolist() for s in shards] == [[0, 1, 2], [3, 4, 5], [6, 0, 0]]
    assert shards[2].position_ids.tolist() == [3, 0, 1]
    assert shards[2].labels.tolist() == [-100, -100, -100]
    assert shards[0].cu_seqlens.tolist() == [0, 3, 7, 9]


def test_shard_packed_row_slices_fields_like_labels():
    ids = torch.arange(5)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    weights = torch.tensor([0.5, 1.5, 2.5, 3.5, 0.0])
    shards = [
        shard_packed_row(ids, ids, ids, cu, 5, cp_rank=r, cp_size=2, fields={"loss_weights": weights})
        for r in range(2)
    ]
    assert [s.fields["loss_weights"].tolist() for s in shards] == [[0.5, 1.5, 2.5], [3.5, 0.0, 0.0]]
    assert [s.labels.tolist() for s in shards] == [[0, 1, 2], [3, 4, -100]]


def _vocab_parallel_worker(rank: int, world_size: int):
    torch.manual_seed(0)
    hidden = torch.randn(10, 8, requires_grad=True)
    weight = torch.randn(13, 8, requires_grad=True)  # 13 rows: an uneven split (7 + 6)
    labels = torch.tensor([0, 5, 12, -100, 7, 3, 6, 11, -100, 9])
    start, end = vocab_shard_range(13, rank, world_size)
    shard = weight.detach()[start:end].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(
        hidden, shard, labels, vocab_start=start, group=dist.group.WORLD, chunk_size=4
    )
    loss.backward()
    return loss.detach(), hidden.grad, shard.grad, (start, end)


def check_vocab_parallel(results):
    """The vocab-parallel chunked CE equals the full-softmax CE: loss and both gradients."""
    torch.manual_seed(0)
    hidden = torch.randn(10, 8, requires_grad=True)
    weight = torch.randn(13, 8, requires_grad=True)
    labels = torch.tensor([0, 5, 12, -100, 7, 3, 6, 11, -100, 9])
    ref = torch.nn.functional.cross_entropy(hidden @ weight.t(), labels, reduction="sum")
    ref.backward()
    for loss, grad_hidden, grad_shard, (start, end) in results:
        torch.testing.assert_close(loss, ref.detach())
        torch.testing.assert_close(grad_hidden, hidden.grad)
        torch.testing.assert_close(grad_shard, weight.grad[start:end])


def test_head_rule_is_checked_with_the_valid_sizes():
    from laden.engine.parallel.parallelize import check_head_rule

    model = tiny_model()  # 4 heads, 2 KV heads
    with pytest.raises(
        ValueError, match=r"context parallel size 3 .* valid context parallel sizes for this model: 1, 2, 4"
    ):
        check_head_rule(model, 3, axis_name="context parallel")
    check_head_rule(model, 4, axis_name="tensor parallel")  # 4 % 2 KV heads == 0: KV heads repeated
