"""Tiny models and checks shared by the lean-norm and lean-MLP patch tests."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from tiled_cases import _assert_model_same, _batch, _lm_step
from tiny import tiny_qwen3_config
from torch import nn

from laden.model.patches.lean_mlp import enable_lean_mlp, is_lean_mlp
from laden.model.patches.options import EAGER, PatchOptions


def _tiny_model(**overrides) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_qwen3_config(**overrides), dtype=torch.float32)


def check_enable_disable_round_trip(enable, disable, count: int, modules_of, plain_name: str) -> None:
    """Enable twice (counted, switched once) and disable twice on the tiny model: class names,
    state-dict keys and a training step unchanged throughout, the modules' attributes as before."""
    model = _tiny_model()
    keys = list(model.state_dict().keys())
    attrs = [sorted(m.__dict__) for m in modules_of(model)]
    want = _lm_step(model, _batch(seed=2))
    assert enable(model) == count
    assert enable(model) == count  # already swapped: counted, not switched twice
    assert {type(m).__mro__[1].__name__ for m in modules_of(model)} == {plain_name}
    assert list(model.state_dict().keys()) == keys
    _assert_model_same(_lm_step(model, _batch(seed=2)), want)
    assert disable(model) == count
    assert disable(model) == 0
    assert {type(m).__name__ for m in modules_of(model)} == {plain_name}
    assert [sorted(m.__dict__) for m in modules_of(model)] == attrs  # the options went too
    assert list(model.state_dict().keys()) == keys
    _assert_model_same(_lm_step(model, _batch(seed=2)), want)


def _layer_saved_bytes(
    model, num_tokens: int, documents: tuple[int, ...] = ()
) -> tuple[int, list[torch.Tensor]]:
    """Bytes of the distinct non-parameter storages autograd saves in one decoder layer's forward,
    over one document of `num_tokens` or, given `documents`, over those packed in one row."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storage_bytes: dict[int, int] = {}
    saved: list[torch.Tensor] = []  # keeps every saved tensor alive, so no storage is reused

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs:
            storage_bytes[ptr] = t.untyped_storage().nbytes()
            saved.append(t)
        return t

    hidden = model.config.hidden_size
    x = torch.randn(1, num_tokens, hidden, generator=torch.Generator().manual_seed(7))
    x = x.to(torch.bfloat16).requires_grad_()
    pos = torch.cat([torch.arange(n) for n in documents or (num_tokens,)])[None]
    assert pos.shape[1] == num_tokens, f"documents {documents} do not sum to {num_tokens} tokens"
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[0](
            x, attention_mask=None, position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos)
        )
    return sum(storage_bytes.values()), saved


HIDDEN, INTER = 16, 40


def _hf_mlp_class(family: str, name: str) -> type[nn.Module]:
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = getattr(module, name, None)
    if cls is None:
        pytest.skip(f"{name} is not in the installed transformers")
    return cls


def _hf_mlp(family="qwen3", name="Qwen3MLP", *, seed=0, **config) -> nn.Module:
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=4, **config)
    torch.manual_seed(seed)
    return _hf_mlp_class(family, name)(cfg)


def _holder(*mlps: nn.Module) -> nn.Module:
    """A minimal 'model' whose decoder layers hold the given MLPs (what enable_lean_mlp walks)."""
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Module() for _ in mlps)
    for layer, mlp in zip(model.layers, mlps):
        layer.mlp = mlp
    return model


def _lean_copy(mlp: nn.Module, options: PatchOptions = EAGER) -> nn.Module:
    lean = copy.deepcopy(mlp)
    assert enable_lean_mlp(_holder(lean), options=options) == 1
    assert type(lean).__name__ == f"Lean{type(mlp).__name__}" and isinstance(lean, type(mlp))
    assert is_lean_mlp(lean) and not is_lean_mlp(mlp)
    return lean
