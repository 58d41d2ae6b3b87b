"""The written-out gated MLP, batches and one LM training step, shared by the tiled/lean/fused MLP tests."""

from __future__ import annotations

import torch
from torch import nn

NUM_TOKENS, HIDDEN, INTERMEDIATE = 13, 8, 24


class GatedMLP(nn.Module):
    """The Qwen3/Llama feed-forward, written out: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


VOCAB = 96  # the tiny_model fixture's char tokenizer is smaller; ids below stay in range


def _batch(seed=0, shape=(2, 24)):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, 40, shape, generator=gen)


def _lm_step(model, ids):
    """Loss and every parameter gradient of one training step (no KV cache, as in training)."""
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_model_same(got, want):
    torch.testing.assert_close(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for name, w in want[1].items():
        torch.testing.assert_close(got[1][name], w, msg=lambda m, n=name: f"{n}: {m}")


def _other_arch(name: str) -> nn.Module:
    import transformers

    config_cls = getattr(transformers, f"{name}Config")
    model_cls = getattr(transformers, f"{name}ForCausalLM")
    cfg = config_cls(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return model_cls(cfg).float()
