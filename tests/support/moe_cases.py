"""A tiny Qwen3-MoE with decided routers and the plain reference of the router load-balancing loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from laden.model import moe

TOP_K = 2


def moe_config(num_experts: int = 4, **overrides) -> Qwen3MoeConfig:
    base = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=num_experts,
        num_experts_per_tok=TOP_K, tie_word_embeddings=False, pad_token_id=0,
    )  # fmt: skip
    return Qwen3MoeConfig(**{**base, **overrides})


def tiny_moe(num_experts: int = 4, **overrides) -> nn.Module:
    """A seeded fp32 Qwen3-MoE whose routers have real preferences (std 0.5, not near-ties)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        moe_config(num_experts, **overrides), dtype=torch.float32, attn_implementation="eager"
    )
    for block in moe.moe_blocks(model):
        nn.init.normal_(block.gate.weight, std=0.5)
    return model


def reference_aux(logits: torch.Tensor, top_k: int = TOP_K) -> torch.Tensor:
    """E * sum_i f_i * P_i: f_i the share of the N*k top-k choices on expert i, P_i its mean probability."""
    probs = logits.float().softmax(-1)  # [N, E]
    chosen = F.one_hot(probs.topk(top_k).indices, logits.shape[-1]).float()  # [N, k, E]
    f = chosen.sum((0, 1)) / (logits.shape[0] * top_k)
    return logits.shape[-1] * (f * probs.mean(0)).sum()
