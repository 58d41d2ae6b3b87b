"""The batches, optimizers and tiny model of the roundpipe engine's `TrainEngine` protocol tests."""

from __future__ import annotations

import torch
from protocol_reference import packed_batches
from tiny import tiny_qwen3_config
from torch import nn
from transformers import AutoModelForCausalLM

from laden.engine.roundpipe import ModelExecutePlan
from laden.optim import OptimSettings

VOCAB = 64


BATCHES = packed_batches(VOCAB, num_micro_batches=3, docs_per_mb=2, seed=3)


NORMALIZER = 7.0  # not the token count, so it is really used


TEMPERATURE = 0.7


# Embedding + 3 decoder layers + head: two forward stages, a fused one and two backward stages.
STAGED = ModelExecutePlan.uniform(5, stage_layers=2, fused_layers=1)


SGD = OptimSettings(type="sgd", lr=0.5, weight_decay=0.0, gradient_clipping=0.0, total_steps=4)


ADAM = OptimSettings(lr=1e-2, eps=1e-3, weight_decay=0.1, gradient_clipping=0.5, total_steps=4)


def tiny_model(*, tied: bool = True) -> nn.Module:
    cfg = tiny_qwen3_config(vocab_size=VOCAB, num_hidden_layers=3)
    cfg.tie_word_embeddings = tied
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def tokens(batches) -> int:
    return sum(mb.num_loss_tokens for mb in batches)
