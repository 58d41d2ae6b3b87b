"""Token-budget partitioning (ffd, kk) and padding-free packed batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from laden.data import (
    IGNORE_INDEX,
    ffd_partition,
    kk_partition,
    pack_samples,
    partition_microbatches,
    unpack,
)

# ---------------------------------------------------------------- partitioning


@st.composite
def partition_inputs(draw):
    max_tokens = draw(st.integers(1, 300))
    seqlens = draw(st.lists(st.integers(1, max_tokens), max_size=40))
    n_mbs = draw(st.integers(1, 12))
    return seqlens, max_tokens, n_mbs


@settings(max_examples=300, deadline=None)
@given(inputs=partition_inputs(), algorithm=st.sampled_from(["ffd", "kk"]))
def test_partition_invariants(inputs, algorithm):
    seqlens, max_tokens, n_mbs = inputs
    bins = partition_microbatches(seqlens, max_tokens_per_mb=max_tokens, n_mbs=n_mbs, algorithm=algorithm)
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(len(seqlens)))  # nothing lost, nothing duplicated
    assert all(b for b in bins)
    assert all(sum(seqlens[i] for i in b) <= max_tokens for b in bins)
    assert len(bins) >= min(n_mbs, len(seqlens))
    assert len(bins) >= -(-sum(seqlens) // max_tokens)
    assert all(b == sorted(b) for b in bins)
    assert [b[0] for b in bins] == sorted(b[0] for b in bins)
    again = partition_microbatches(
        list(seqlens), max_tokens_per_mb=max_tokens, n_mbs=n_mbs, algorithm=algorithm
    )
    assert again == bins


@settings(max_examples=100, deadline=None)
@given(inputs=partition_inputs())
def test_ffd_without_min_bins_never_has_two_mergeable_bins(inputs):
    seqlens, max_tokens, _ = inputs
    loads = sorted(sum(seqlens[i] for i in b) for b in ffd_partition(seqlens, max_tokens))
    # First fit would have merged the two lightest bins if they fit together.
    assert len(loads) < 2 or loads[0] + loads[1] > max_tokens


def _greedy_loads(seqlens: list[int], num_bins: int) -> list[int]:
    """Reference: each sequence in input order goes to the currently lightest bin."""
    loads = [0] * num_bins
    for length in seqlens:
        loads[loads.index(min(loads))] += length
    return loads


@pytest.mark.parametrize(
    "seqlens",
    [
        [4, 5, 6, 7, 8],
        [10, 9, 8, 7, 6, 5, 4, 3, 2, 1],
        [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7],
        [100, 1, 1, 1, 1, 1, 1, 1, 1, 1, 50, 50],
        [17, 23, 5, 31, 2, 19, 11, 7, 13, 29, 3],
    ],
)
@pytest.mark.parametrize("num_bins", [2, 3, 4])
def test_kk_balance_no_worse_than_greedy(seqlens, num_bins):
    bins = kk_partition(seqlens, sum(seqlens), num_bins)
    assert len(bins) == num_bins
    loads = [sum(seqlens[i] for i in b) for b in bins]
    greedy = _greedy_loads(seqlens, num_bins)
    assert max(loads) <= max(greedy)
    assert max(loads) - min(loads) <= max(greedy) - min(greedy)


@pytest.mark.parametrize("algorithm", ["ffd", "kk"])
def test_over_long_sequence_names_the_budget_field(algorithm):
    with pytest.raises(
        ValueError, match=r"actor\.mb_spec\.max_tokens_per_mb=100 .* 130 tokens.* at least 130"
    ):
        partition_microbatches([50, 130, 20], max_tokens_per_mb=100, algorithm=algorithm)


def test_partition_argument_errors():
    with pytest.raises(ValueError, match="packing_algorithm='best'"):
        partition_microbatches([1], max_tokens_per_mb=10, algorithm="best")
    with pytest.raises(ValueError, match="n_mbs=0"):
        partition_microbatches([1], max_tokens_per_mb=10, n_mbs=0)
    with pytest.raises(ValueError, match="at least 1"):
        ffd_partition([3, 0], 10)


def test_empty_input_gives_no_bins():
    assert ffd_partition([], 10, 4) == [] == kk_partition([], 10, 4)


# ---------------------------------------------------------------- packed batches


def _reference_labels(input_ids: list[int], loss_mask: list[int]) -> list[int]:
    """Label j is x[j+1] if m[j+1] == 1 else -100; the last position is -100."""
    labels = [x if m == 1 else IGNORE_INDEX for x, m in zip(input_ids[1:], loss_mask[1:])]
    return labels + [IGNORE_INDEX]


def test_packed_layout_on_hand_made_example():
    samples = [([10, 11, 12], [0, 1, 1]), ([20, 21], [0, 1]), ([30, 31, 32, 33], [0, 0, 1, 1])]
    batch = pack_samples(samples)
    assert batch.input_ids.tolist() == [10, 11, 12, 20, 21, 30, 31, 32, 33]
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert batch.labels.tolist() == [11, 12, -100, 21, -100, -100, 32, 33, -100]
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.input_ids.dtype == batch.position_ids.dtype == batch.labels.dtype == torch.long
    assert batch.max_seqlen == 4 and batch.seqlens == [3, 2, 4] and batch.num_loss_tokens == 5


samples_strategy = st.lists(
    st.integers(1, 12).flatmap(
        lambda n: st.tuples(
            st.lists(st.integers(0, 99), min_size=n, max_size=n),
            st.lists(st.integers(0, 1), min_size=n, max_size=n),
        )
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(samples=samples_strategy, multiple=st.one_of(st.none(), st.integers(1, 16)))
def test_pack_matches_per_document_reference(samples, multiple):
    batch = pack_samples(samples, pad_to_multiple_of=multiple)
    real = sum(len(ids) for ids, _ in samples)
    assert batch.num_tokens % (multiple or 1) == 0 and batch.num_tokens - real == batch.num_padding_tokens
    assert batch.num_padding_tokens < (multiple or 1)
    assert [t.tolist() for t in unpack(batch)] == [ids for ids, _ in samples]
    assert [t.tolist() for t in unpack(batch, batch.labels)] == [_reference_labels(*s) for s in samples]
    assert [t.tolist() for t in unpack(batch, batch.position_ids)] == [
        list(range(len(ids))) for ids, _ in samples
    ]
    expected_loss_tokens = sum(sum(mask[1:]) for _, mask in samples)
    assert batch.num_loss_tokens == expected_loss_tokens
    # The padding document, if any, is its own segment with no loss.
    pad = batch.num_padding_tokens
    assert batch.cu_seqlens[-1].item() == batch.num_tokens
    assert batch.labels[real:].eq(IGNORE_INDEX).all()
    assert batch.position_ids[real:].tolist() == list(range(pad))
    boundaries = [0] + [sum(len(ids) for ids, _ in samples[: i + 1]) for i in range(len(samples))]
    assert batch.cu_seqlens.tolist() == boundaries + ([batch.num_tokens] if pad else [])


def test_padding_keeps_loss_tokens_and_labels():
    samples = [([5, 6, 7], [0, 1, 1]), ([8, 9], [1, 1])]
    plain = pack_samples(samples)
    padded = pack_samples(samples, pad_to_multiple_of=8, pad_token_id=0)
    assert padded.num_tokens == 8 and padded.num_padding_tokens == 3
    assert padded.num_loss_tokens == plain.num_loss_tokens
    assert padded.labels[:5].tolist() == plain.labels.tolist()
    assert padded.cu_seqlens.tolist() == [0, 3, 5, 8] and padded.max_seqlen == 3
    assert padded.seqlens == plain.seqlens


def test_pack_rejects_bad_samples():
    with pytest.raises(ValueError, match="sample 1 has 2 tokens and 1 loss-mask"):
        pack_samples([([1], [0]), ([1, 2], [1])])
    with pytest.raises(ValueError, match="at least one sample"):
        pack_samples([])


def test_to_returns_a_moved_copy():
    batch = pack_samples([([1, 2, 3], [0, 1, 1])])
    moved = batch.to("cpu")
    assert moved is not batch
    for name in ("input_ids", "position_ids", "labels", "cu_seqlens"):
        torch.testing.assert_close(getattr(moved, name), getattr(batch, name))
    assert (moved.max_seqlen, moved.num_loss_tokens, moved.seqlens) == (3, 2, [3])


@pytest.mark.gpu
def test_pinned_batch_copies_to_gpu():
    batch = pack_samples([([1, 2, 3], [0, 1, 1]), ([4, 5], [1, 1])]).pin_memory()
    assert batch.input_ids.is_pinned() and batch.cu_seqlens.is_pinned()
    on_gpu = batch.to("cuda", non_blocking=True)
    torch.cuda.synchronize()  # the copies above are asynchronous
    assert on_gpu.labels.device.type == "cuda"
    assert on_gpu.labels.cpu().tolist() == batch.labels.tolist()


def test_packed_forward_backward_equals_per_document(tiny_model):
    """packed == unpacked: summed loss and gradients of one packed row match per-document passes."""
    generator = torch.Generator().manual_seed(0)
    vocab = tiny_model.config.vocab_size
    samples = []
    for length, prompt_len in [(7, 3), (12, 5), (5, 1)]:
        ids = torch.randint(4, vocab, (length,), generator=generator).tolist()
        samples.append((ids, [0] * prompt_len + [1] * (length - prompt_len)))
    batch = pack_samples(samples, pad_to_multiple_of=8)

    # use_cache=False: transformers only splits attention by position_ids when no cache is built.
    logits = tiny_model(
        input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], use_cache=False
    ).logits[0]
    packed_loss = torch.nn.functional.cross_entropy(logits, batch.labels, reduction="sum")
    packed_loss.backward()
    packed_grads = [p.grad.clone() for p in tiny_model.parameters()]
    tiny_model.zero_grad()

    reference_loss = torch.zeros(())
    for ids, mask in samples:
        ids_t = torch.tensor(ids)
        doc_logits = tiny_model(input_ids=ids_t[None], use_cache=False).logits[0]  # [n, V]
        targets = torch.where(torch.tensor(mask[1:]) == 1, ids_t[1:], IGNORE_INDEX)
        reference_loss = reference_loss + torch.nn.functional.cross_entropy(
            doc_logits[:-1], targets, reduction="sum"
        )
    reference_loss.backward()

    torch.testing.assert_close(packed_loss, reference_loss)
    for packed, param in zip(packed_grads, tiny_model.parameters()):
        torch.testing.assert_close(packed, param.grad)
    assert batch.num_loss_tokens == sum(sum(m[1:]) for _, m in samples)


def test_split_documents_keeps_every_token_and_the_summed_loss():
    import torch.nn.functional as F

    from laden.data.batch import pack_samples, split_documents

    gen = torch.Generator().manual_seed(0)
    samples = [
        (torch.randint(0, 50, (n,), generator=gen).tolist(), [0, 0] + [1] * (n - 2)) for n in (5, 9, 3, 6)
    ]
    fields = {"advantages": [torch.rand(len(ids), generator=gen).tolist() for ids, _ in samples]}
    whole = pack_samples(samples, pad_to_multiple_of=8, fields=fields)
    parts = split_documents(whole)
    assert [p.seqlens for p in parts] == [[5, 9], [3, 6]] and sum(
        p.num_tokens for p in parts
    ) == whole.num_tokens
    assert sum(p.num_loss_tokens for p in parts) == whole.num_loss_tokens
    assert parts[1].cu_seqlens.tolist() == [0, 3, 9, 10] and parts[1].max_seqlen == 6  # the padding goes last
    logits = torch.randn(whole.num_tokens, 50, generator=gen)

    def loss(batch, offset):
        rows = logits[offset : offset + batch.num_tokens]
        per = F.cross_entropy(rows, batch.labels.clamp(min=0), reduction="none") * batch.fields["advantages"]
        return (per * (batch.labels != -100)).sum()

    torch.testing.assert_close(loss(parts[0], 0) + loss(parts[1], parts[0].num_tokens), loss(whole, 0))
    for name in ("input_ids", "position_ids", "labels"):
        assert torch.equal(torch.cat([getattr(p, name) for p in parts]), getattr(whole, name))
    one = pack_samples(samples[:1])
    assert split_documents(one) == [one]
