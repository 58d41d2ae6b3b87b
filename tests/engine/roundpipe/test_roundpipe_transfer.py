"""Parked data between stages: reused host buffers and tensors parked once per call (CPU)."""

from __future__ import annotations

import pytest
import torch
from roundpipe_cases import tied_tiny_qwen3

from laden import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from laden.engine.roundpipe import transfer
from laden.engine.roundpipe.transfer import HostBuffers
from laden.model.split import causal_lm_loss, shift_labels

pytestmark = pytest.mark.usefixtures("one_thread")


class FakeEvent:
    """A copy's event that completes when the test says so."""

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_a_buffer_is_handed_out_again_only_after_the_copies_that_read_it_finished():
    pool = HostBuffers(pin=False)
    a, view = pool.take(torch.Size([4, 8]), torch.float32)
    assert view.shape == (4, 8) and view.dtype == torch.float32 and view.data_ptr() == a.data_ptr()
    reading = FakeEvent()
    pool.give([a], [reading, None])
    b, _ = pool.take(torch.Size([4, 8]), torch.float32)
    assert b.data_ptr() != a.data_ptr() and pool.allocated == 2  # a's copy is still queued
    reading.done = True
    c, _ = pool.take(torch.Size([4, 8]), torch.float32)
    assert c.data_ptr() == a.data_ptr() and pool.allocated == 2


def test_a_buffer_whose_copy_is_queued_does_not_hold_back_the_ones_given_after_it():
    pool = HostBuffers(pin=False)
    first, _ = pool.take(torch.Size([16]), torch.bfloat16)
    second, _ = pool.take(torch.Size([16]), torch.bfloat16)
    pool.give([first], [FakeEvent(done=False)])
    pool.give([second], [FakeEvent(done=True)])
    again, _ = pool.take(torch.Size([16]), torch.bfloat16)
    assert again.data_ptr() == second.data_ptr() and pool.allocated == 2


def test_buffers_are_power_of_two_byte_buffers_shared_by_shapes_and_dropped_when_a_call_left_them_unused():
    pool = HostBuffers(pin=False)
    a, view = pool.take(torch.Size([3, 5]), torch.float32)  # 60 bytes
    assert a.dtype == torch.uint8 and a.numel() == 512
    view.fill_(1.5)
    assert a[:60].view(torch.float32).eq(1.5).all()
    pool.give([a], [None])
    b, other = pool.take(torch.Size([100]), torch.int32)  # 400 bytes: the same 512-byte buffer
    assert b.data_ptr() == a.data_ptr() and other.shape == (100,) and other.dtype == torch.int32
    big, _ = pool.take(torch.Size([513]), torch.uint8)
    assert big.numel() == 1024 and pool.allocated == 2
    pool.give([b, big], [None])
    pool.end_call()  # both were used in this call: kept
    assert pool.free_bytes() == 512 + 1024
    c, _ = pool.take(torch.Size([8]), torch.float32)
    pool.give([c], [None])
    pool.end_call()  # the 1024-byte buffer sat unused through this call: dropped
    assert pool.free_bytes() == 512


def _train(rp: RoundPipe, cfg: RoundPipeRunConfig, calls: int) -> list[torch.Tensor]:
    vocab = rp.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(calls):
        ids = torch.randint(0, vocab, (4, 8), generator=gen)
        losses.append(rp.forward_backward(input_kwargs={"input_ids": ids}, label=shift_labels(ids),
                                          loss_fn=causal_lm_loss, run_config=cfg))  # fmt: skip
    return losses


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_reused_buffers_and_shared_tensors_train_exactly_as_fresh_copies(monkeypatch, grain):
    """Every stage boundary of a 5-layer plan parks and fetches a decoder state per micro-batch:
    with the pool and the shared position ids, losses and accumulated gradients are bitwise
    those of a fresh host buffer and a fresh copy at every boundary; the pool allocates nothing
    after the first call, and each micro-batch's integer tensors cross the bus once per call: its
    token ids to the device, the position ids the embedding's stage makes to the host; later
    stages on the device reuse the device tensors."""
    plan = ModelExecutePlan(fwd_plan=[range(0, 1), range(1, 2), range(2, 3)],
                            bwd_plan=[range(3, 5), range(2, 3), range(1, 2), range(0, 1)])  # fmt: skip
    cfg = RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain, execute_plan=plan)
    shared_copies = []
    real_remember = transfer.Shared.remember

    def remember(self, dev, host):
        shared_copies.append(dev.shape)
        real_remember(self, dev, host)

    monkeypatch.setattr(transfer.Shared, "remember", remember)
    pooled = RoundPipe(tied_tiny_qwen3())
    losses = _train(pooled, cfg, 1)
    allocated = pooled.pipe.host_buffers.allocated
    assert allocated > 0
    assert len(shared_copies) == 2 * 2  # 2 micro-batches x (token ids, position ids), over 3 boundaries
    losses += _train(pooled, cfg, 2)
    assert pooled.pipe.host_buffers.allocated == allocated  # later calls reuse the first call's buffers
    assert len(shared_copies) == 2 * 2 * 3

    monkeypatch.setattr(transfer.Shared, "eligible", staticmethod(lambda t: False))
    monkeypatch.setattr(HostBuffers, "give", lambda self, buffers, readers: None)  # nothing comes back
    fresh = RoundPipe(tied_tiny_qwen3())
    fresh_losses = _train(fresh, cfg, 1) + _train(fresh, cfg, 2)
    assert len(shared_copies) == 2 * 2 * 3  # nothing shared without eligible tensors
    assert fresh.pipe.host_buffers.allocated > 3 * allocated  # a new buffer at every park
    for got, want in zip(losses, fresh_losses, strict=True):
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(want))
    pooled.synchronize()
    fresh.synchronize()
    grads = dict(pooled.named_parameters())
    for name, p in fresh.named_parameters():
        assert p.grad is not None and torch.equal(grads[name].grad, p.grad), name
