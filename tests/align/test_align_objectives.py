"""The DPO and pairwise reward losses against plain PyTorch written here: losses and gradients, fp64,
packed micro-batches of several pairs against each sequence on its own."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from laden.align.data import Pair, pack_pairs
from laden.align.objectives import DPOObjective, DPOSettings, PairwiseRewardObjective
from laden.data.batch import pack_samples
from laden.engine.parallel.padding import ZeroFields, padding_batch


def _pairs(seed: int = 0, n: int = 3) -> list[Pair]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        sides = []
        for _ in range(2):
            prompt, completion = (
                int(torch.randint(1, 4, (1,), generator=g)),
                int(torch.randint(2, 6, (1,), generator=g)),
            )
            ids = torch.randint(0, 11, (prompt + completion,), generator=g).tolist()
            sides.append((ids, [0] * prompt + [1] * completion))
        ref = tuple(torch.randn(len(s[0]), generator=g, dtype=torch.float64).tolist() for s in sides)
        out.append(Pair(chosen=sides[0], rejected=sides[1], ref=ref))  # type: ignore[arg-type]
    return out


def _hidden_for(pairs, h: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(len(s[0]), h, generator=g, dtype=torch.float64)
        for p in pairs
        for s in (p.chosen, p.rejected)
    ]


def _seq_logp(hidden: torch.Tensor, weight: torch.Tensor, ids: list[int], mask: list[int]) -> torch.Tensor:
    """Plain log pi(completion): full logits, the log-prob of each next token where its mask is 1."""
    logp = torch.log_softmax(hidden[:-1] @ weight.t(), dim=-1)
    target = torch.tensor(ids[1:])
    keep = torch.tensor(mask[1:], dtype=torch.bool)
    return logp.gather(1, target[:, None])[:, 0][keep].sum()


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_loss_and_gradients_match_reference(loss_type):
    beta, vocab, h = 0.3, 11, 8
    pairs = _pairs()
    hiddens = _hidden_for(pairs, h)
    weight = torch.randn(vocab, h, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    # reference: each sequence on its own
    hs = [x.clone().requires_grad_() for x in hiddens]
    w = weight.clone().requires_grad_()
    total = 0.0
    for k, p in enumerate(pairs):
        (ci, cm), (ri, rm) = p.chosen, p.rejected
        pc, pr = _seq_logp(hs[2 * k], w, ci, cm), _seq_logp(hs[2 * k + 1], w, ri, rm)
        # the reference log-probs of the tokens the policy scores (per input token, the first not a target)
        rc = sum(v for v, m in zip(p.ref[0][1:], cm[1:]) if m)
        rr = sum(v for v, m in zip(p.ref[1][1:], rm[1:]) if m)
        if loss_type == "sigmoid":
            total = total - F.logsigmoid(beta * ((pc - pr) - (rc - rr)))
        else:
            total = total + ((pc - rc) / sum(cm[1:]) - (pr - rr) / sum(rm[1:]) - 1 / (2 * beta)) ** 2
    (total / len(pairs)).backward()

    # packed: two micro-batches (2 pairs + 1 pair), summed, divided by the number of pairs
    objective = DPOObjective(DPOSettings(beta=beta, loss_type=loss_type), chunk_size=3)
    hp = [x.clone().requires_grad_() for x in hiddens]
    wp = weight.clone().requires_grad_()
    loss = 0.0
    for group in ([0, 1], [2]):
        mb = pack_pairs([pairs[i] for i in group], with_ref=True)
        hidden = torch.cat([hp[2 * i + s] for i in group for s in (0, 1)])
        loss = loss + objective(hidden, wp, mb)
    loss = loss / len(pairs)
    loss.backward()
    torch.testing.assert_close(loss.double(), total.detach() / len(pairs), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wp.grad, w.grad, rtol=1e-4, atol=1e-6)
    for a, b in zip(hp, hs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)
    sums = objective.sums.pop()
    assert float(sums["pairs"]) == 3
    assert 0 <= float(sums["accuracy"]) <= 3


def test_reward_loss_and_gradients_match_reference():
    h = 8
    pairs = _pairs(seed=3, n=4)
    hiddens = _hidden_for(pairs, h, seed=4)
    head = torch.randn(1, h, dtype=torch.float64, generator=torch.Generator().manual_seed(5))

    hs = [x.clone().requires_grad_() for x in hiddens]
    w = head.clone().requires_grad_()
    scores = torch.stack([(x[-1] @ w[0]) for x in hs]).view(-1, 2)  # the score: the last token's value
    reference = -F.logsigmoid(scores[:, 0] - scores[:, 1]).mean()
    reference.backward()

    objective = PairwiseRewardObjective()
    hp = [x.clone().requires_grad_() for x in hiddens]
    wp = head.clone().requires_grad_()
    loss = 0.0
    for group in ([0], [1, 2, 3]):
        mb = pack_pairs([pairs[i] for i in group])
        loss = loss + objective(torch.cat([hp[2 * i + s] for i in group for s in (0, 1)]), wp, mb)
    loss = loss / len(pairs)
    loss.backward()
    torch.testing.assert_close(loss.double(), reference.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wp.grad, w.grad, rtol=1e-4, atol=1e-6)
    for a, b in zip(hp, hs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)
    sums = objective.sums.pop()
    accuracy = float((scores[:, 0] > scores[:, 1]).double().sum())
    assert float(sums["accuracy"]) == accuracy
    margin = float((scores[:, 0] - scores[:, 1]).detach().sum())
    torch.testing.assert_close(float(sums["margin"]), margin, rtol=1e-5, atol=1e-5)  # the values are fp32


@pytest.mark.parametrize("beta", [0.0, -0.1, float("nan")])
def test_beta_must_be_positive(beta):
    with pytest.raises(ValueError, match=r"actor.beta=.* must be > 0"):
        DPOSettings(beta=beta)


def test_dpo_without_reference_logprobs_says_how_to_give_them():
    pairs = _pairs(n=1)
    mb = pack_pairs(pairs)
    with pytest.raises(ValueError, match="ref_logprobs"):
        DPOObjective(DPOSettings())(torch.randn(mb.num_tokens, 4), torch.randn(11, 4), mb)


def _objective(job: str):
    return DPOObjective(DPOSettings(beta=0.3), chunk_size=3) if job == "dpo" else PairwiseRewardObjective()


@pytest.mark.parametrize("job", ["dpo", "rw"])
def test_a_padding_micro_batch_adds_zero_loss_and_no_pair_and_still_backpropagates(job):
    """A data-parallel rank with fewer micro-batches than another runs the engine's padding micro-batch
    (one document, no loss token, zeros for any field): it must run forward and backward like the others."""
    h = 8
    head = torch.randn(11 if job == "dpo" else 1, h, dtype=torch.float64, requires_grad=True)
    padding = padding_batch()
    padding = replace(padding, fields=ZeroFields(padding.labels))
    hidden = torch.randn(1, h, dtype=torch.float64, requires_grad=True)
    objective = _objective(job)
    loss = objective(hidden, head, padding)
    loss.backward()
    assert float(loss.detach()) == 0.0 and hidden.grad is not None and head.grad is not None
    assert not hidden.grad.any() and not head.grad.any()
    assert float(objective.sums.pop()["pairs"]) == 0


@pytest.mark.parametrize("job", ["dpo", "rw"])
def test_a_padding_document_after_the_pairs_changes_nothing(job):
    pairs = _pairs(seed=6, n=2)
    h = 8
    hiddens = _hidden_for(pairs, h, seed=7)
    head = torch.randn(
        11 if job == "dpo" else 1, h, dtype=torch.float64, generator=torch.Generator().manual_seed(8)
    )
    sides = [s for p in pairs for s in (p.chosen, p.rejected)]
    refs = [r for p in pairs for r in p.ref]
    padded = pack_samples(
        [*sides, ([0], [0])], fields={"ref_logprobs": [*refs, [0.0]]} if job == "dpo" else None
    )
    plain = pack_pairs(pairs, with_ref=job == "dpo")
    results = []
    for mb, extra in ((plain, []), (padded, [torch.randn(1, h, dtype=torch.float64)])):
        hidden = torch.cat([*hiddens, *extra]).requires_grad_()
        w = head.clone().requires_grad_()
        loss = _objective(job)(hidden, w, mb)
        loss.backward()
        results.append((loss.detach(), hidden.grad[: plain.num_tokens], w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_an_odd_document_with_loss_tokens_is_refused():
    pairs = _pairs(n=1)
    mb = pack_samples([pairs[0].chosen, pairs[0].rejected, pairs[0].chosen])
    with pytest.raises(
        ValueError, match=r"holds 3 documents; .*at most a padding document without loss tokens"
    ):
        PairwiseRewardObjective()(torch.randn(mb.num_tokens, 4), torch.randn(1, 4), mb)
