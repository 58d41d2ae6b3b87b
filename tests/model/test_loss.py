"""Chunked linear + cross-entropy / log-probs == the plain full-logits PyTorch computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from memtrack import LargestTensor

from laden.model.loss import (
    chunked_entropy,
    chunked_linear_cross_entropy,
    chunked_token_logprobs,
    chunked_token_logprobs_and_entropy,
    linear_cross_entropy,
)

NUM_TOKENS, HIDDEN, VOCAB = 45, 16, 70


def _inputs(dtype=torch.float32, seed=0, ignore_every=4):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(NUM_TOKENS, HIDDEN, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (NUM_TOKENS,), generator=gen)
    if ignore_every:
        labels[::ignore_every] = -100
    return hidden, weight, labels


def _reference_ce(hidden, weight, labels):
    logits = hidden.float() @ weight.float().t()  # [T, V]
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 45, 4096])
def test_chunked_ce_matches_reference(chunk_size):
    hidden, weight, labels = _inputs()
    loss = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size)
    ref = _reference_ce(hidden, weight, labels)
    torch.testing.assert_close(loss, ref)
    assert loss.dtype == torch.float32
    # a non-unit upstream gradient (the caller divides by the global token count)
    for got, want in zip(_grads(loss / 13.0, hidden, weight), _grads(ref / 13.0, hidden, weight)):
        torch.testing.assert_close(got, want)


def test_plain_linear_cross_entropy_matches_reference():
    hidden, weight, labels = _inputs()
    loss = linear_cross_entropy(hidden, weight, labels)
    ref = _reference_ce(hidden, weight, labels)
    torch.testing.assert_close(loss, ref)
    for got, want in zip(_grads(loss, hidden, weight), _grads(ref, hidden, weight)):
        torch.testing.assert_close(got, want)


def test_all_labels_ignored_gives_zero_loss_and_zero_grads():
    hidden, weight, labels = _inputs()
    labels.fill_(-100)
    loss = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=8)
    grad_hidden, grad_weight = _grads(loss, hidden, weight)
    torch.testing.assert_close(loss, torch.zeros((), dtype=torch.float32))
    torch.testing.assert_close(grad_hidden, torch.zeros_like(hidden))
    torch.testing.assert_close(grad_weight, torch.zeros_like(weight))


def test_custom_ignore_index():
    hidden, weight, labels = _inputs(ignore_every=0)
    labels[::3] = 5
    loss = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=8, ignore_index=5)
    logits = hidden @ weight.t()
    ref = F.cross_entropy(logits, labels, ignore_index=5, reduction="sum")
    torch.testing.assert_close(loss, ref)
    for got, want in zip(_grads(loss, hidden, weight), _grads(ref, hidden, weight)):
        torch.testing.assert_close(got, want)


def test_frozen_weight_and_frozen_hidden():
    hidden, weight, labels = _inputs()
    frozen = weight.detach()
    loss = chunked_linear_cross_entropy(hidden, frozen, labels, chunk_size=8)
    (got,) = _grads(loss, hidden)
    (want,) = _grads(_reference_ce(hidden, frozen, labels), hidden)
    torch.testing.assert_close(got, want)

    loss = chunked_linear_cross_entropy(hidden.detach(), weight, labels, chunk_size=8)
    (got,) = _grads(loss, weight)
    (want,) = _grads(_reference_ce(hidden.detach(), weight, labels), weight)
    torch.testing.assert_close(got, want)


def test_tied_weight_gradients_accumulate():
    """The lm_head shares the embedding matrix: both uses contribute to one gradient."""
    torch.manual_seed(0)
    embed = torch.nn.Embedding(VOCAB, HIDDEN)
    proj = torch.nn.Linear(HIDDEN, HIDDEN)
    ids = torch.randint(0, VOCAB, (NUM_TOKENS,))
    labels = torch.roll(ids, -1)
    labels[-1] = -100

    def run(loss_fn):
        embed.zero_grad()
        proj.zero_grad()
        hidden = torch.tanh(proj(embed(ids)))  # [T, H]
        loss_fn(hidden, embed.weight, labels).backward()
        return embed.weight.grad.clone(), proj.weight.grad.clone()

    got = run(lambda h, w, y: chunked_linear_cross_entropy(h, w, y, chunk_size=6))
    want = run(_reference_ce)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_bf16_inputs_return_bf16_grads_close_to_fp32():
    hidden, weight, labels = _inputs(dtype=torch.bfloat16)
    loss = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=8)
    grad_hidden, grad_weight = _grads(loss, hidden, weight)
    assert loss.dtype == torch.float32
    assert grad_hidden.dtype == torch.bfloat16 and grad_weight.dtype == torch.bfloat16
    # Reference: the same bf16 values, upcast to fp32 for the whole computation.
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    ref = _reference_ce(h32, w32, labels)
    want_h, want_w = _grads(ref, h32, w32)
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=1e-1)
    torch.testing.assert_close(grad_hidden.float(), want_h, rtol=5e-2, atol=3e-2)
    torch.testing.assert_close(grad_weight.float(), want_w, rtol=5e-2, atol=3e-2)


@pytest.mark.gpu
def test_cuda_bf16_weight_gradient_sums_chunks_in_fp32():
    """On CUDA each chunk's [V, H] weight-gradient product is added into the fp32 accumulator by
    one fp32-output GEMM: the bf16 gradient is the exact sum of the chunks' products (of the bf16
    logit gradients and hidden rows the loss computes) rounded once, within one bf16 unit in the
    last place where the GPU's fp32 sum lands beside a rounding boundary. Adding bf16-rounded
    products chunk by chunk is further off."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from laden.model.patches import grad_sink

    chunk = 2
    hidden, weight, labels = (t.cuda() for t in _inputs(dtype=torch.bfloat16))
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    assert grad_sink._fp32_out_addmm(hidden.device, torch.bfloat16)
    _, got = _grads(chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk), hidden, weight)
    # The chunks' factors as the loss makes them (on the GPU, the same kernels), summed in fp64.
    exact = torch.zeros(weight.shape, dtype=torch.float64)
    per_chunk_bf16 = torch.zeros(weight.shape, dtype=torch.float64)
    for start in range(0, NUM_TOKENS, chunk):
        h, y = hidden.detach()[start : start + chunk], labels[start : start + chunk]
        probs = torch.log_softmax(torch.mm(h, weight.detach().t(), out_dtype=torch.float32), dim=-1).exp()
        valid = y != -100
        probs[torch.arange(len(y), device=y.device)[valid], y[valid]] -= 1
        g = probs.to(torch.bfloat16).double().cpu()  # [c, V]
        x = (h.double() * valid[:, None]).cpu()  # [c, H]
        exact += g.t() @ x
        per_chunk_bf16 += (g.t() @ x).to(torch.bfloat16).double()
    want = exact.to(torch.bfloat16).double()
    ulp = want.abs() * 2**-7 + 1e-30
    err = (got.double().cpu() - want).abs()
    assert (err <= ulp).all()
    assert err.sum() < (per_chunk_bf16.to(torch.bfloat16).double() - want).abs().sum()


def test_no_grad_forward_matches_and_saves_no_gradient():
    hidden, weight, labels = _inputs()
    with torch.no_grad():
        loss = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=8)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, _reference_ce(hidden, weight, labels).detach())


def test_chunked_ce_never_materialises_full_logits():
    """T=4096, V=32000, H=64 fp32, chunk 512: no op output and no saved tensor reaches [T, V]."""
    num_tokens, vocab, hidden_size, chunk = 4096, 32000, 64, 512
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=gen).mul_(0.1).requires_grad_()
    labels = torch.randint(0, vocab, (num_tokens,), generator=gen)

    saved_numels: list[int] = []

    def pack(t):
        saved_numels.append(t.numel())
        return t

    tracker = LargestTensor()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), tracker:
        loss = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)
        loss.backward()
    assert tracker.max_numel == chunk * vocab  # one chunk of logits, 1/8 of [T, V]
    assert max(saved_numels) == vocab * hidden_size  # grad_weight; never logits
    assert torch.isfinite(loss)

    # The detector does see full logits when they exist.
    small = LargestTensor()
    with small:
        linear_cross_entropy(hidden[:64], weight, labels[:64])
    assert small.max_numel == 64 * vocab


def _reference_logprobs_entropy(hidden, weight, labels, temperature):
    logp_all = torch.log_softmax((hidden.float() @ weight.float().t()) / temperature, dim=-1)  # [T, V]
    valid = labels >= 0
    logp = logp_all.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("chunk_size", [7, 4096])
def test_token_logprobs_and_entropy_match_log_softmax(temperature, chunk_size):
    hidden, weight, labels = _inputs(ignore_every=5)
    logp, entropy = chunked_token_logprobs_and_entropy(
        hidden, weight, labels, chunk_size=chunk_size, temperature=temperature
    )
    ref_logp, ref_entropy = _reference_logprobs_entropy(hidden, weight, labels, temperature)
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(entropy, ref_entropy)
    gen = torch.Generator().manual_seed(1)
    w_logp, w_ent = torch.randn(NUM_TOKENS, generator=gen), torch.randn(NUM_TOKENS, generator=gen)
    got = _grads((logp * w_logp).sum() + (entropy * w_ent).sum(), hidden, weight)
    want = _grads((ref_logp * w_logp).sum() + (ref_entropy * w_ent).sum(), hidden, weight)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_token_logprobs_alone_and_entropy_alone(temperature):
    hidden, weight, labels = _inputs(ignore_every=0)

    ref_logp, _ = _reference_logprobs_entropy(hidden, weight, labels, temperature)
    logp = chunked_token_logprobs(hidden, weight, labels, chunk_size=10, temperature=temperature)
    torch.testing.assert_close(logp, ref_logp)
    for g, w in zip(_grads(logp.sum(), hidden, weight), _grads(ref_logp.sum(), hidden, weight)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)

    _, ref_entropy = _reference_logprobs_entropy(hidden, weight, labels, temperature)
    entropy = chunked_entropy(hidden, weight, chunk_size=10, temperature=temperature)
    torch.testing.assert_close(entropy, ref_entropy)
    for g, w in zip(_grads(entropy.sum(), hidden, weight), _grads(ref_entropy.sum(), hidden, weight)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_token_logprobs_bf16_grads_keep_input_dtypes():
    hidden, weight, labels = _inputs(dtype=torch.bfloat16, ignore_every=0)
    logp = chunked_token_logprobs(hidden, weight, labels, chunk_size=8)
    grad_hidden, grad_weight = _grads(logp.sum(), hidden, weight)
    assert logp.dtype == torch.float32
    assert grad_hidden.dtype == torch.bfloat16 and grad_weight.dtype == torch.bfloat16
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    ref_logp, _ = _reference_logprobs_entropy(h32, w32, labels, 1.0)
    want_h, want_w = _grads(ref_logp.sum(), h32, w32)
    torch.testing.assert_close(logp, ref_logp, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(grad_hidden.float(), want_h, rtol=5e-2, atol=3e-2)
    torch.testing.assert_close(grad_weight.float(), want_w, rtol=5e-2, atol=3e-2)


def test_bad_arguments_raise_value_error():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="chunk_size=0"):
        chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="labels must be"):
        chunked_linear_cross_entropy(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match="temperature=0"):
        chunked_token_logprobs(hidden, weight, labels, temperature=0.0)
