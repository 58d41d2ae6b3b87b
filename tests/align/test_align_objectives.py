"""The DPO and pairwise reward losses against plain PyTorch written here: losses and gradients, fp64,
packed micro-batches of several pairs against each sequence on its own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from laden.align.data import Pair, pack_pairs
from laden.align.objectives import DPOObjective, DPOSettings, PairwiseRewardObjective


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
