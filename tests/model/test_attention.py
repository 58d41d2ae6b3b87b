"""Packed (padding-free) attention == running each document on its own with stock eager attention."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from patch_cases import VOCAB, _llama, _qwen3
from torch.utils._python_dispatch import TorchDispatchMode

from laden.model.attention import (
    LADEN_VARLEN,
    LADEN_VARLEN_KERNEL,
    _equal_documents,
    kernel_varlen_attention_forward,
    lm_head_weight,
    packed_causal_lm_loss,
    packed_forward_hidden,
    set_attention,
    shift_packed_labels,
    varlen_attention_forward,
)

pytestmark = pytest.mark.usefixtures("one_thread")

DOC_LENGTHS = (5, 11, 8)


def _documents(lengths=DOC_LENGTHS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(4, VOCAB, (n,), generator=gen) for n in lengths]
    labels = []
    for d in docs:
        lab = d.clone()
        lab[:2] = -100  # a "prompt" without loss
        labels.append(lab)
    return docs, labels


def _pack(docs, labels):
    lengths = [len(d) for d in docs]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    return torch.cat(docs), position_ids, torch.cat(labels), cu_seqlens, max(lengths)


def _param_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(model, docs, labels):
    """Each document alone through the stock eager attention; loss = summed next-token CE."""
    model.set_attn_implementation("eager")
    model.zero_grad()
    logits, loss = [], 0.0
    for ids, lab in zip(docs, labels):
        doc_logits = model(input_ids=ids[None]).logits[0]  # [L, V]
        targets = torch.cat([lab[1:], torch.tensor([-100])])
        loss = loss + F.cross_entropy(doc_logits.float(), targets, ignore_index=-100, reduction="sum")
        logits.append(doc_logits)
    loss.backward()
    return torch.cat(logits).detach(), loss.detach(), _param_grads(model)


def _packed(model, docs, labels, **loss_kwargs):
    model.zero_grad()
    ids, pos, lab, cu_seqlens, max_seqlen = _pack(docs, labels)
    with torch.no_grad():
        hidden = packed_forward_hidden(model, ids, pos, cu_seqlens, max_seqlen)  # [T, H]
        logits = hidden @ lm_head_weight(model).t()
    targets = shift_packed_labels(lab, cu_seqlens)
    loss = packed_causal_lm_loss(
        model, ids, pos, targets, cu_seqlens, max_seqlen, chunk_size=7, **loss_kwargs
    )
    loss.backward()
    return logits, loss.detach(), _param_grads(model)


def _assert_same(got, want):
    got_logits, got_loss, got_grads = got
    want_logits, want_loss, want_grads = want
    torch.testing.assert_close(got_logits, want_logits)
    torch.testing.assert_close(got_loss, want_loss)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], msg=lambda m, n=name: f"{n}: {m}")


MODELS = {
    "qwen3": _qwen3,
    "llama": lambda: _llama(tied=False),
    "llama_tied": lambda: _llama(tied=True),
}


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_packed_equals_unpacked(arch):
    model = MODELS[arch]()
    docs, labels = _documents()
    want = _reference(model, docs, labels)
    packed = copy.deepcopy(model)
    assert set_attention(packed, "auto") == LADEN_VARLEN
    _assert_same(_packed(packed, docs, labels), want)


def test_tiny_model_fixture_packed_equals_unpacked(tiny_model):
    docs, labels = _documents()
    want = _reference(tiny_model, docs, labels)
    packed = copy.deepcopy(tiny_model)
    set_attention(packed, "varlen")
    _assert_same(_packed(packed, docs, labels), want)


# transformers >= 5.2x renames it activation_checkpointing_enable; 5.17 only has this name.
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_packed_with_gradient_checkpointing_equals_unpacked():
    model = _qwen3()
    docs, labels = _documents()
    want = _reference(model, docs, labels)
    packed = copy.deepcopy(model)
    set_attention(packed, "auto")
    packed.gradient_checkpointing_enable()
    packed.train()
    _assert_same(_packed(packed, docs, labels), want)


def test_unchunked_loss_equals_chunked():
    model = _llama(tied=True)
    set_attention(model, "auto")
    docs, labels = _documents()
    _assert_same(_packed(copy.deepcopy(model), docs, labels, chunked=False), _packed(model, docs, labels))


def test_plain_forward_recovers_documents_from_position_ids():
    model = _qwen3()
    docs, labels = _documents()
    want_logits, _, _ = _reference(model, docs, labels)
    set_attention(model, "auto")
    ids, pos, _, _, _ = _pack(docs, labels)
    with torch.no_grad():
        logits = model(input_ids=ids[None], position_ids=pos[None]).logits[0]
    torch.testing.assert_close(logits, want_logits)


def test_padded_batch_uses_the_padding_mask():
    """Generation-style input (right-padded rows + 2-D attention_mask) still works under laden_varlen."""
    model = _llama(tied=False)
    docs, _ = _documents(lengths=(9, 6))
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for row, d in enumerate(docs):
        ids[row, : len(d)] = d
        mask[row, : len(d)] = 1
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        set_attention(model, "auto")
        got = model(input_ids=ids, attention_mask=mask).logits
    for row, d in enumerate(docs):
        torch.testing.assert_close(got[row, : len(d)], want[row, : len(d)])


def test_sliding_window_layer_equals_unpacked():
    model = _qwen3(num_hidden_layers=2)
    model.config.use_sliding_window = True
    model.config.sliding_window = 3
    model.config.layer_types = ["full_attention", "sliding_attention"]
    for layer, kind in zip(model.model.layers, model.config.layer_types):
        layer.self_attn.sliding_window = 3 if kind == "sliding_attention" else None
    model.model.has_sliding_layers = True
    docs, labels = _documents()
    want = _reference(model, docs, labels)
    packed = copy.deepcopy(model)
    set_attention(packed, "auto")
    _assert_same(_packed(packed, docs, labels), want)


class _SquareShapes(TorchDispatchMode):
    """Records every op output shape that has two dimensions equal to `size`."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.hits = size, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and list(t.shape).count(self.size) >= 2:
                self.hits.append((str(func), tuple(t.shape)))
        return out


def test_cpu_path_builds_no_token_by_token_tensor():
    model = _qwen3()
    docs, labels = _documents()
    ids, pos, lab, cu_seqlens, max_seqlen = _pack(docs, labels)
    num_tokens = len(ids)

    set_attention(model, "auto")
    tracker = _SquareShapes(num_tokens)
    with tracker:
        targets = shift_packed_labels(lab, cu_seqlens)
        packed_causal_lm_loss(model, ids, pos, targets, cu_seqlens, max_seqlen).backward()
    assert tracker.hits == []

    # The detector does fire for the stock SDPA path, which builds a block-diagonal [T, T] mask.
    set_attention(model, "sdpa")
    sdpa_tracker = _SquareShapes(num_tokens)
    with sdpa_tracker, torch.no_grad():
        packed_forward_hidden(model, ids, pos, cu_seqlens, max_seqlen)
    assert sdpa_tracker.hits


def test_shift_packed_labels_stays_inside_documents():
    docs, labels = _documents()
    _, _, lab, cu_seqlens, _ = _pack(docs, labels)
    want = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in labels])
    torch.testing.assert_close(shift_packed_labels(lab, cu_seqlens), want)


def test_attention_function_rejects_dropout_and_softcap():
    q = torch.randn(1, 2, 4, 8)
    module = torch.nn.Module()
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="attention_dropout"):
        varlen_attention_forward(module, q, q, q, None, dropout=0.1, cu_seq_lens_q=cu, max_length_q=4)
    with pytest.raises(NotImplementedError, match="softcap"):
        varlen_attention_forward(module, q, q, q, None, softcap=30.0, cu_seq_lens_q=cu, max_length_q=4)


def _causal_per_document(q, k, v, bounds, scaling):
    """Reference: q [N, Hq, D], k/v [N, Hkv, D]; softmax over each document's earlier tokens, in fp32."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        scores = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * scaling  # [H, L, L]
        future = torch.ones(b - a, b - a, dtype=torch.bool).triu(1)
        out.append(
            torch.einsum("hqk,khd->qhd", scores.masked_fill(future, float("-inf")).softmax(-1), v[a:b])
        )
    return torch.cat(out)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("forward", [varlen_attention_forward, kernel_varlen_attention_forward])
def test_equal_documents_run_as_one_sdpa_batch(batch, forward):
    """Documents of one length (three of 12 tokens) run as one [3, H, 12, D] SDPA batch: outputs
    and gradients equal causal attention within each document, rows of [B, T] flattened."""
    gen = torch.Generator().manual_seed(0)
    num_tokens, docs, scaling = 36, 3, 0.3
    q = torch.randn(batch, 8, num_tokens // batch, 16, generator=gen).requires_grad_()
    k = torch.randn(batch, 2, num_tokens // batch, 16, generator=gen).requires_grad_()
    v = torch.randn(batch, 2, num_tokens // batch, 16, generator=gen).requires_grad_()
    bounds = [0, 12, 24, 36]
    cu = torch.tensor(bounds, dtype=torch.int32)
    out, _ = forward(torch.nn.Module(), q, k, v, None, scaling=scaling, cu_seq_lens_q=cu, max_length_q=12)
    assert out.shape == (batch, num_tokens // batch, 8, 16)
    grad = torch.randn(out.shape, generator=gen)
    got_grads = torch.autograd.grad(out, (q, k, v), grad)

    flat = [
        t.detach().transpose(1, 2).reshape(num_tokens, t.shape[1], 16).requires_grad_() for t in (q, k, v)
    ]
    want = _causal_per_document(*flat, bounds, scaling)
    want_grads = torch.autograd.grad(want, flat, grad.reshape(num_tokens, 8, 16))
    torch.testing.assert_close(out.reshape(num_tokens, 8, 16), want)
    for got, w, t in zip(got_grads, want_grads, (q, k, v)):
        torch.testing.assert_close(got.transpose(1, 2).reshape(num_tokens, t.shape[1], 16), w)
    assert _equal_documents(cu, 12, num_tokens, None) == docs


def test_unequal_documents_and_short_windows_keep_the_per_document_path():
    cu = torch.tensor([0, 12, 24, 36], dtype=torch.int32)
    assert _equal_documents(cu, 12, 36, sliding_window=None) == 3
    assert _equal_documents(cu, 12, 36, sliding_window=12) == 3  # the window spans a whole document
    assert _equal_documents(cu, 12, 36, sliding_window=8) == 0
    assert _equal_documents(torch.tensor([0, 10, 24, 36], dtype=torch.int32), 14, 36, None) == 0
    assert _equal_documents(torch.tensor([0], dtype=torch.int32), 0, 0, None) == 0


def test_varlen_impl_keeps_the_varlen_kernel():
    model = _qwen3()
    assert set_attention(model, "auto") == LADEN_VARLEN
    assert set_attention(model, "varlen") == LADEN_VARLEN_KERNEL
    assert model.config._attn_implementation == LADEN_VARLEN_KERNEL


def test_set_attention_rejects_unknown_impl():
    with pytest.raises(ValueError, match="attn_impl='flash'"):
        set_attention(_qwen3(), "flash")


@pytest.mark.gpu
@pytest.mark.parametrize("sliding_window", [None, 16])
def test_varlen_kernel_matches_per_document_sdpa_on_cuda(sliding_window):
    """bf16 on CUDA goes through torch's varlen_attn; compare with the per-document path."""
    torch.manual_seed(0)
    lengths = (37, 129, 64)
    num_tokens = sum(lengths)
    cu = torch.tensor([0, 37, 166, 230], dtype=torch.int32, device="cuda")
    q = torch.randn(1, 8, num_tokens, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, num_tokens, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, num_tokens, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    module = torch.nn.Module()
    out, _ = varlen_attention_forward(
        module,
        q,
        k,
        v,
        None,
        scaling=0.125,
        sliding_window=sliding_window,
        cu_seq_lens_q=cu,
        max_length_q=129,
    )
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))

    q32, k32, v32 = (t.detach().float().cpu().requires_grad_() for t in (q, k, v))
    cu_cpu = cu.cpu()
    want, _ = varlen_attention_forward(
        module,
        q32,
        k32,
        v32,
        None,
        scaling=0.125,
        sliding_window=sliding_window,
        cu_seq_lens_q=cu_cpu,
        max_length_q=129,
    )
    want_grads = torch.autograd.grad(want.square().sum(), (q32, k32, v32))
    torch.testing.assert_close(out.float().cpu(), want, rtol=2e-2, atol=2e-2)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g.float().cpu(), w, rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
def test_equal_documents_on_cuda_match_the_varlen_kernel():
    """bf16 rows of equal documents (cuDNN's SDPA on Hopper) against the varlen kernel: outputs
    and gradients within bf16 tolerance."""
    torch.manual_seed(0)
    num_tokens, length = 512, 256
    cu = torch.tensor([0, length, num_tokens], dtype=torch.int32, device="cuda")
    q = torch.randn(1, 16, num_tokens, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, num_tokens, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 8, num_tokens, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, num_tokens, 16, 128, device="cuda", dtype=torch.bfloat16)
    results = []
    for forward in (varlen_attention_forward, kernel_varlen_attention_forward):
        out, _ = forward(
            torch.nn.Module(), q, k, v, None, scaling=128**-0.5, cu_seq_lens_q=cu, max_length_q=length
        )
        results.append((out.float(), *(g.float() for g in torch.autograd.grad(out, (q, k, v), grad))))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_packed_bf16_model_on_cuda_matches_unpacked():
    """The whole packed path through the varlen kernel, bf16 on CUDA, against per-document eager."""
    model = _qwen3(num_attention_heads=4, num_key_value_heads=2).to("cuda", torch.bfloat16)
    docs, labels = _documents(lengths=(37, 129, 64))
    docs, labels = [d.cuda() for d in docs], [lab.cuda() for lab in labels]
    model.set_attn_implementation("eager")
    model.zero_grad()
    want_loss = 0.0
    for ids, lab in zip(docs, labels):
        logits = model(input_ids=ids[None]).logits[0].float()
        targets = torch.cat([lab[1:], lab.new_full((1,), -100)])
        want_loss = want_loss + F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    want_loss.backward()
    want_grads = _param_grads(model)

    set_attention(model, "auto")
    model.zero_grad()
    ids, pos, lab, cu_seqlens, max_seqlen = _pack(docs, labels)
    targets = shift_packed_labels(lab, cu_seqlens)
    loss = packed_causal_lm_loss(
        model, ids, pos.cuda(), targets, cu_seqlens.cuda(), max_seqlen, chunk_size=64
    )
    loss.backward()
    torch.testing.assert_close(loss, want_loss, rtol=2e-2, atol=0.0)
    for name, want in want_grads.items():
        got = _param_grads(model)[name].float()
        rel = (got - want.float()).norm() / want.float().norm().clamp(min=1e-6)
        assert rel < 5e-2, f"{name}: relative gradient error {rel:.3g}"
