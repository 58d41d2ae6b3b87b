"""A value model: a causal LM whose output projection has one row, read as V(s) per token.

PPO's critic is the policy's architecture with a scalar head (AReaL builds it as a token
classifier with one label). laden keeps the causal-LM class and replaces `lm_head` by a
`[1, H]` linear layer instead, so every engine trains and shards it as it does a language
model: the engines hand an objective the final hidden states `[T, H]` and the head weight,
which here is `[1, H]`, and `token_values` turns the two into one value per token (no
`[T, V]` logits, no vocabulary). The cost of keeping the class: the module tree still holds
the input embedding, and a Hugging Face export of the value model is a causal LM with a
vocabulary of one output, which only laden reads back.

The head starts at zero (AReaL's starts random with the model's `initializer_range`): the
first values are all 0, so the first step's advantages are the discounted returns
themselves, and every run from the same decoder weights starts from the same critic.
Tied input and output embeddings are untied (the head no longer is the embedding).
"""

from __future__ import annotations

import torch
from torch import nn


def to_value_model(model: nn.Module) -> nn.Module:
    """`model` (a Hugging Face causal LM) with its `lm_head` replaced by a zero `[1, H]` head, in place.

    The new head takes the old one's device and dtype (a meta skeleton stays meta: its weights
    come from rank 0 under `fsdp.memory_efficient_load`).
    """
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight") or not hasattr(model, "lm_head"):
        raise ValueError(f"{type(model).__name__} has no lm_head; a value model is built from a causal LM")
    old = head.weight  # [V, H]
    value_head = nn.Linear(old.shape[1], 1, bias=False, device=old.device, dtype=old.dtype)
    if old.device.type != "meta":
        with torch.no_grad():
            value_head.weight.zero_()
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    model.lm_head = value_head
    if hasattr(model, "get_expanded_tied_weights_keys"):  # transformers' record of tied names
        model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=False)
    return model


def token_values(hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """`[T]` fp32 values: `hidden [T, H]` times the one-row head `[1, H]` (differentiable)."""
    if head_weight.dim() != 2 or head_weight.shape[0] != 1:
        raise ValueError(
            f"values need a value model's one-row head [1, H]; this head is {tuple(head_weight.shape)} (a "
            "language model's [V, H]): build the model with laden.model.value_head.to_value_model"
        )
    return (hidden.reshape(-1, hidden.shape[-1]).float() @ head_weight.float().t()).squeeze(-1)
