"""Pieces shared by the model-patch tests: attention's tiny models, the fused-kernel fixture, a recording gradient sink."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_qwen3_config

from laden.model.patches import fused as fused_module
from laden.model.patches.grad_sink import accumulate_product
from laden.model.patches.options import PatchOptions


class RecordingSink:
    """An fp32 accumulator that counts its writes."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.acc = torch.zeros(weight.shape, dtype=torch.float32)
        self.calls = 0

    def accumulate(self, grad_out, inp, weight_dtype) -> None:
        accumulate_product(self.acc, grad_out, inp, weight_dtype)
        self.calls += 1


def _stack_gate_up(mlp) -> None:
    """Gate and up weights as rows of one flat buffer (how the roundpipe engine uploads a layer)."""
    flat = torch.cat([mlp.gate_proj.weight.detach().reshape(-1), mlp.up_proj.weight.detach().reshape(-1)])
    n = mlp.gate_proj.weight.numel()
    shape = mlp.gate_proj.weight.shape
    mlp.gate_proj.weight = torch.nn.Parameter(flat[:n].view(shape))
    mlp.up_proj.weight = torch.nn.Parameter(flat[n:].view(mlp.up_proj.weight.shape))


FUSED = PatchOptions(fused=True)


@pytest.fixture
def fused(monkeypatch) -> list[str]:
    """The names of the functions `fused.call` hands to the compiler (which still compiles them)."""
    compiled: list[str] = []
    real = fused_module._compiled
    monkeypatch.setattr(
        fused_module, "_compiled", lambda fn, static: compiled.append(fn.__name__) or real(fn, static)
    )
    return compiled


VOCAB = 96


def _llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def _qwen3(**overrides):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=VOCAB, **overrides)).float()
