"""PPO's value model (`laden.model.value_head`) on the archon engine at every parallel layout equals a
plain one-process reference: the values `forward` returns, the value loss, its clipping norm and every
weight after one SGD step (so the gradients of the decoder and the one-row head).

The reference is stock Hugging Face: each document through the model's decoder on its own (no packing,
no laden code), its hidden states times the `[1, H]` head, and the clipped value loss written out here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from workers import run_workers

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = ([7, 9, 5], [12, 3], [8, 8], [6, 4, 4])
EPS = 0.05


def _model():
    from transformers import AutoModelForCausalLM, Qwen3Config

    from laden.model.value_head import to_value_model

    config = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    model = to_value_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    with torch.no_grad():  # a head away from its zero start, so the values and the head's gradient are not 0
        model.lm_head.weight.copy_(torch.randn(1, 32, generator=torch.Generator().manual_seed(7)) / 4)
    return model


def _samples():
    """Per micro-batch: (token ids, loss mask, old values, returns) per document."""
    g = torch.Generator().manual_seed(1)
    out = []
    for mb in LENGTHS:
        docs = []
        for n in mb:
            ids = torch.randint(3, 128, (n,), generator=g).tolist()
            old, ret = (torch.randn(n, generator=g) / 4).tolist(), torch.randn(n, generator=g).tolist()
            docs.append((ids, [0, 0] + [1] * (n - 2), old, ret))
        out.append(docs)
    return out


def _packed(docs):
    from laden.data import pack_samples

    fields = {"old_values": [d[2] for d in docs], "returns": [d[3] for d in docs]}
    return pack_samples([(ids, mask) for ids, mask, _, _ in docs], fields=fields)


def _settings():
    from laden.optim import OptimSettings

    return OptimSettings(type="sgd", lr=0.1, weight_decay=0.0, gradient_clipping=0.5)


def _value_loss(value, old, ret, mask):
    """AReaL's clipped value loss, summed over the loss tokens (one token at a time)."""
    total = torch.zeros(())
    for t in range(value.numel()):
        if mask[t]:
            clipped = old[t] + torch.clamp(value[t] - old[t], -EPS, EPS)
            total = total + 0.5 * torch.maximum((value[t] - ret[t]) ** 2, (clipped - ret[t]) ** 2)
    return total


def _reference():
    """(values per document before the step, loss, clipping norm, weights after one SGD step)."""
    model = _model()
    docs = [d for mb in _samples() for d in mb]
    tokens = sum(sum(d[1][1:]) for d in docs)
    values, loss = [], torch.zeros(())
    for ids, mask, old, ret in docs:
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # [n, H]
        value = (hidden @ model.lm_head.weight.t()).squeeze(-1)
        values.append(value.detach().clone())
        # position i holds the state before token i + 1: that token's mask and fields (pack_samples' shift)
        loss = loss + _value_loss(value[:-1], torch.tensor(old[1:]), torch.tensor(ret[1:]), mask[1:])
    loss = loss / tokens
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return (
        values,
        float(loss.detach()),
        float(norm),
        {n: p.detach().clone() for n, p in model.named_parameters()},
    )


def _layout(rank, world, dp, pp, tp, cp, kind="archon"):
    from laden.engine.archon import ArchonEngine
    from laden.engine.fsdp import FSDPEngine
    from laden.rl.critic import ValueObjective, ValueSettings

    if kind == "fsdp":
        engine: Any = FSDPEngine(_model(), dp=dp, tp=tp, cp=cp, optim=_settings(), dtype=torch.float32,
                                 device=torch.device("cpu"))  # fmt: skip
    else:
        engine = ArchonEngine(_model(), dp=dp, pp=pp, tp=tp, cp=cp, optim=_settings(), plan_tokens=32,
                              dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    every = [_packed(mb) for mb in _samples()]
    mbs, total = every[engine.dp_rank :: dp], sum(mb.num_loss_tokens for mb in every)
    values = [r["values"] for r in engine.forward(mbs, outputs=("values",))]
    loss = engine.forward_backward(mbs, ValueObjective(ValueSettings(eps_clip=EPS)), normalizer=total)
    norm = engine.optimizer_step()["grad_norm"]
    weights = {n: t.clone() for n, t in engine.named_weights(torch.float32)}
    return values, float(loss), float(norm), weights, engine.dp_rank


LAYOUTS = [  # (world, d, p, t, c, engine)
    (1, 1, 1, 1, 1, "archon"),
    (2, 2, 1, 1, 1, "archon"),
    (2, 1, 2, 1, 1, "archon"),
    (2, 1, 1, 2, 1, "archon"),
    (2, 1, 1, 1, 2, "archon"),
    (4, 1, 2, 2, 1, "archon"),
    (2, 1, 1, 2, 1, "fsdp"),  # the replicated one-row head is the same code on the fsdp engine
]


@pytest.mark.parametrize(("world", "dp", "pp", "tp", "cp", "kind"), LAYOUTS)
def test_value_model_on_archon_equals_a_plain_reference(world, dp, pp, tp, cp, kind):
    """archon:d1/d2/d1p2/d1t2/d1c2 == the reference: values, loss, clipped-gradient norm, updated weights."""
    values, loss, norm, params = _reference()
    per_mb = []
    i = 0
    for mb in LENGTHS:
        per_mb.append(torch.cat(values[i : i + len(mb)]))
        i += len(mb)
    for got_values, got_loss, got_norm, weights, dp_rank in run_workers(_layout, world, dp, pp, tp, cp, kind):
        for got, want in zip(got_values, per_mb[dp_rank::dp]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert got_loss == pytest.approx(loss, rel=1e-5) and got_norm == pytest.approx(norm, rel=1e-4)
        assert weights.keys() == params.keys() and weights["lm_head.weight"].shape == (1, 32)
        for name, value in weights.items():
            torch.testing.assert_close(value, params[name], rtol=1e-5, atol=1e-6, msg=name)
