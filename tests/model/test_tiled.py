"""Sequence-tiled MLP == the plain MLP: outputs, input and weight gradients, whole models, memory."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from memtrack import LargestTensor
from tiled_cases import (
    HIDDEN,
    INTERMEDIATE,
    NUM_TOKENS,
    GatedMLP,
    _assert_model_same,
    _batch,
    _lm_step,
    _other_arch,
)
from torch import nn

from laden.model.attention import packed_causal_lm_loss, set_attention, shift_packed_labels
from laden.model.patches.tiled import TiledMLP, disable_tiled_mlp, enable_tiled_mlp, tiled_forward


def _mlp(seed=0, **kwargs) -> GatedMLP:
    torch.manual_seed(seed)
    return GatedMLP(**kwargs)


def _run(mlp, x, grad_out, tile_tokens=None):
    """Output, input gradient and parameter gradients for a non-unit upstream gradient."""
    mlp.zero_grad()
    x = x.detach().requires_grad_(x.requires_grad)
    if tile_tokens is None:
        out = mlp(x)
    else:
        out = tiled_forward(mlp, x, list(mlp.parameters()), tile_tokens=tile_tokens)
    out.backward(grad_out)
    grads = {n: p.grad for n, p in mlp.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def _assert_same(got, want, **tol):
    for g, w in zip(got[:2], want[:2]):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w, **tol)
    assert got[2].keys() == want[2].keys()
    for name, w in want[2].items():
        torch.testing.assert_close(got[2][name], w, msg=lambda m, n=name: f"{n}: {m}", **tol)


@pytest.mark.parametrize("shape", [(NUM_TOKENS, HIDDEN), (2, NUM_TOKENS, HIDDEN)], ids=["TH", "BTH"])
@pytest.mark.parametrize("tile_tokens", [1, 4, 13, 100])  # 13 divides 13 and 26 rows; 4 divides neither
def test_tiled_mlp_matches_plain(shape, tile_tokens):
    mlp = _mlp(bias=True)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen).requires_grad_()
    grad_out = torch.randn(shape, generator=gen)
    _assert_same(_run(mlp, x, grad_out, tile_tokens), _run(mlp, x, grad_out))


def test_frozen_weights_and_frozen_input():
    """LoRA-like: some weights frozen; and an input without gradient (weights only)."""
    mlp = _mlp()
    mlp.gate_proj.weight.requires_grad_(False)
    mlp.down_proj.weight.requires_grad_(False)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, NUM_TOKENS, HIDDEN, generator=gen)
    grad_out = torch.randn(2, NUM_TOKENS, HIDDEN, generator=gen)
    got = _run(mlp, x.requires_grad_(), grad_out, tile_tokens=5)
    assert set(got[2]) == {"up_proj.weight"}
    _assert_same(got, _run(mlp, x, grad_out))
    got = _run(mlp, x.detach(), grad_out, tile_tokens=5)
    assert got[1] is None
    _assert_same(got, _run(mlp, x.detach(), grad_out))


def test_explicit_params_through_apply():
    """TiledMLP.apply with a closure over plain tensors (not a module)."""
    gen = torch.Generator().manual_seed(3)
    w1 = torch.randn(INTERMEDIATE, HIDDEN, generator=gen).requires_grad_()
    w2 = torch.randn(HIDDEN, INTERMEDIATE, generator=gen).requires_grad_()
    x = torch.randn(NUM_TOKENS, HIDDEN, generator=gen).requires_grad_()
    grad_out = torch.randn(NUM_TOKENS, HIDDEN, generator=gen)

    def fn(t):
        return torch.tanh(t @ w1.t()) @ w2.t()

    got = torch.autograd.grad(TiledMLP.apply(fn, 3, x, w1, w2), (x, w1, w2), grad_out)
    want = torch.autograd.grad(fn(x), (x, w1, w2), grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_bf16_keeps_dtypes_and_is_close_to_fp32():
    mlp = _mlp(hidden=32, intermediate=96)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(40, 32, generator=gen)
    grad_out = torch.randn(40, 32, generator=gen)
    want = _run(mlp, x.requires_grad_(), grad_out)
    mlp16 = copy.deepcopy(mlp).bfloat16()
    got = _run(mlp16, x.detach().bfloat16().requires_grad_(), grad_out.bfloat16(), tile_tokens=7)
    assert got[0].dtype == got[1].dtype == torch.bfloat16
    assert all(g.dtype == torch.bfloat16 for g in got[2].values())
    got32 = (got[0].float(), got[1].float(), {n: g.float() for n, g in got[2].items()})
    _assert_same(got32, want, rtol=5e-2, atol=5e-2)


def test_no_grad_forward_matches():
    mlp = _mlp()
    x = torch.randn(2, NUM_TOKENS, HIDDEN)
    with torch.no_grad():
        out = tiled_forward(mlp, x, list(mlp.parameters()), tile_tokens=4)
        torch.testing.assert_close(out, mlp(x))
    assert out.grad_fn is None


class _AutocastProbe(GatedMLP):
    """Records whether CPU autocast was on at every call (forward tiles and backward recompute)."""

    def __init__(self):
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, x):
        self.seen.append(torch.is_autocast_enabled("cpu"))
        return super().forward(x)


@pytest.mark.parametrize("forward_autocast", [True, False])
def test_backward_recompute_uses_the_forward_autocast_state(forward_autocast):
    mlp = _AutocastProbe()
    x = torch.randn(NUM_TOKENS, HIDDEN, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=forward_autocast):
        out = tiled_forward(mlp, x, list(mlp.parameters()), tile_tokens=5)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not forward_autocast):
        out.float().square().sum().backward()
    assert mlp.seen == [forward_autocast] * 6  # 3 tiles in forward, 3 recomputed in backward
    assert x.grad is not None and x.grad.dtype == torch.float32


def test_bad_tile_tokens():
    mlp = _mlp()
    x = torch.randn(NUM_TOKENS, HIDDEN)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=f"tile_tokens={bad!r}"):
            tiled_forward(mlp, x, [], tile_tokens=bad)
    with pytest.raises(ValueError, match=r"\[\.\.\., T, H\]"):
        tiled_forward(mlp, torch.randn(HIDDEN), [], tile_tokens=2)


# --- whole models ------------------------------------------------------------------------------


def _tiled_copy(model, tile_tokens=5):
    tiled = copy.deepcopy(model)
    assert enable_tiled_mlp(tiled, tile_tokens=tile_tokens) == model.config.num_hidden_layers
    return tiled


def test_tiny_qwen3_tiled_equals_untiled(tiny_model):
    ids = _batch()
    want = _lm_step(tiny_model, ids)
    tiled = _tiled_copy(tiny_model)
    assert tiled.state_dict().keys() == tiny_model.state_dict().keys()
    assert all(type(layer.mlp).__name__ == "TiledQwen3MLP" for layer in tiled.model.layers)
    assert all(isinstance(layer.mlp, type(tiny_model.model.layers[0].mlp)) for layer in tiled.model.layers)
    _assert_model_same(_lm_step(tiled, ids), want)


@pytest.mark.parametrize("arch", ["Qwen2", "Llama", "Mistral"])
def test_other_architectures_tiled_equal_untiled(arch):
    model = _other_arch(arch)
    ids = _batch(seed=4)
    want = _lm_step(model, ids)
    _assert_model_same(_lm_step(_tiled_copy(model, tile_tokens=8), ids), want)


# transformers >= 5.2x renames it activation_checkpointing_enable; 5.17 only has this name.
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_tiled_with_gradient_checkpointing(tiny_model, use_reentrant):
    ids = _batch(seed=1)
    want = _lm_step(tiny_model, ids)
    tiled = _tiled_copy(tiny_model, tile_tokens=7)
    tiled.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    tiled.train()
    _assert_model_same(_lm_step(tiled, ids), want)


def _packed_step(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = (9, 17, 6)
    ids = torch.randint(4, 40, (sum(lengths),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    targets = shift_packed_labels(ids.clone(), cu_seqlens)
    model.zero_grad()
    loss = packed_causal_lm_loss(model, ids, pos, targets, cu_seqlens, max(lengths), chunk_size=8)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiled_with_packed_varlen_attention(tiny_model, checkpointing):
    set_attention(tiny_model, "auto")
    want = _packed_step(tiny_model)
    tiled = _tiled_copy(tiny_model, tile_tokens=6)  # tiles straddle document boundaries
    if checkpointing:
        tiled.gradient_checkpointing_enable()
        tiled.train()
    _assert_model_same(_packed_step(tiled), want)


def test_disable_and_reenable(tiny_model):
    ids = _batch(seed=2)
    want = _lm_step(tiny_model, ids)
    assert enable_tiled_mlp(tiny_model, tile_tokens=4) == 2
    assert enable_tiled_mlp(tiny_model, tile_tokens=9) == 2  # changes the tile size, no double patch
    assert all(layer.mlp._laden_tile_tokens == 9 for layer in tiny_model.model.layers)
    _assert_model_same(_lm_step(tiny_model, ids), want)
    assert disable_tiled_mlp(tiny_model) == 2
    assert disable_tiled_mlp(tiny_model) == 0
    assert all(type(layer.mlp).__name__ == "Qwen3MLP" for layer in tiny_model.model.layers)
    _assert_model_same(_lm_step(tiny_model, ids), want)


def test_copies_and_pickles_stay_tiled_on_their_own_weights(tiny_model):
    """A shallow copy with its own parameter dict (how roundpipe binds device weights) and a
    pickle round trip both run tiled, each on its own parameters."""
    enable_tiled_mlp(tiny_model, tile_tokens=3)
    mlp = tiny_model.model.layers[0].mlp
    shell = copy.copy(mlp)
    shell._modules = {name: copy.copy(sub) for name, sub in mlp._modules.items()}
    for sub in shell._modules.values():
        sub._parameters = {
            k: None if v is None else nn.Parameter(v.detach() * 2) for k, v in sub._parameters.items()
        }
    restored = pickle.loads(pickle.dumps(mlp))
    x = torch.randn(10, 64)
    for module, scale in ((shell, 2.0), (restored, 1.0)):
        assert type(module) is type(mlp) and module._laden_tile_tokens == 3
        calls: list[int] = []
        hook = module.up_proj.register_forward_hook(
            lambda m, args, out, calls=calls: calls.append(out.shape[0])
        )
        want = GatedMLP(64, 128)
        want.load_state_dict({k: v * scale for k, v in mlp.state_dict().items()})
        torch.testing.assert_close(module(x), want(x))
        assert calls == [3, 3, 3, 1]
        hook.remove()


def test_instance_level_forward_is_refused(tiny_model):
    mlp = tiny_model.model.layers[0].mlp
    mlp.forward = mlp.forward  # as accelerate's device_map hooks do
    with pytest.raises(ValueError, match="forward replaced on the instance"):
        enable_tiled_mlp(tiny_model, tile_tokens=8)


def test_unknown_architectures_are_refused(tiny_model):
    with pytest.raises(ValueError, match=r"model\.model\.layers"):
        enable_tiled_mlp(nn.Linear(4, 4), tile_tokens=8)
    tiny_model.model.layers[1].mlp = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(ValueError, match="decoder layer 1 .*lacks gate_proj, up_proj, down_proj, act_fn"):
        enable_tiled_mlp(tiny_model, tile_tokens=8)
    assert type(tiny_model.model.layers[0].mlp).__name__ == "Qwen3MLP"  # nothing tiled on failure


def test_dropout_in_the_mlp_is_refused(tiny_model):
    tiny_model.model.layers[0].mlp.up_proj = nn.Sequential(nn.Linear(64, 128), nn.Dropout(0.1))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.up_proj\.1 is a dropout with p=0\.1"):
        enable_tiled_mlp(tiny_model, tile_tokens=8)
    with pytest.raises(ValueError, match="tile_tokens=0"):
        enable_tiled_mlp(tiny_model, tile_tokens=0)


# --- memory ------------------------------------------------------------------------------------


def test_tiled_mlp_never_allocates_a_full_intermediate():
    """T=512, H=16, I=256, tile 64: no op output exceeds [tile, I]; only x is saved for backward."""
    num_tokens, hidden, intermediate, tile = 512, 16, 256, 64
    assert num_tokens * hidden <= tile * intermediate  # the [T, H] output and gradient fit the bound
    mlp = _mlp(hidden=hidden, intermediate=intermediate)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, num_tokens, hidden, generator=gen).requires_grad_()
    grad_out = torch.randn(1, num_tokens, hidden, generator=gen)

    saved_numels: list[int] = []

    def pack(t):
        saved_numels.append(t.numel())
        return t

    tracker = LargestTensor()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), tracker:
        out = tiled_forward(mlp, x, list(mlp.parameters()), tile_tokens=tile)
    with tracker:
        out.backward(grad_out)
    assert saved_numels == [num_tokens * hidden]  # x alone
    assert tracker.max_numel == tile * intermediate  # one tile's gate/up activations
    assert mlp.gate_proj.weight.grad is not None and x.grad is not None

    # The detector does see [T, I] in the plain MLP.
    plain = LargestTensor()
    with plain:
        mlp(x).backward(grad_out)
    assert plain.max_numel == num_tokens * intermediate


def test_plain_decoder_mlp_reference_is_the_hf_one(tiny_model):
    """The test's GatedMLP is the same function as the model's own MLP (so the tests above apply)."""
    hf = tiny_model.model.layers[0].mlp
    mine = GatedMLP(64, 128)
    mine.load_state_dict(hf.state_dict())
    x = torch.randn(3, 64)
    torch.testing.assert_close(mine(x), hf(x))
    torch.testing.assert_close(F.silu(x), hf.act_fn(x))


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_roundpipe_streamed_tiled_equals_resident_untiled(tiny_model, grain):
    """laden's RoundPipe (layer weights streamed to the device, recompute per layer) with tiled MLPs."""
    from laden import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
    from laden.model.split import causal_lm_loss, shift_labels

    ids = _batch(seed=3, shape=(2, 16))
    labels = shift_labels(ids)
    ref = copy.deepcopy(tiny_model)
    logits = ref(input_ids=ids).logits
    ref_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
    ref_loss.backward()

    enable_tiled_mlp(tiny_model, tile_tokens=5)
    plan = ModelExecutePlan(fwd_plan=[range(0, 3)], bwd_plan=[range(3, 4), range(1, 3), range(0, 1)])
    cfg = RoundPipeRunConfig(num_microbatch=1, recompute_grain=grain, execute_plan=plan)
    rp = RoundPipe(tiny_model)
    loss = rp.forward_backward(
        input_kwargs={"input_ids": ids}, label=labels, loss_fn=causal_lm_loss, run_config=cfg
    )
    rp.synchronize()
    torch.testing.assert_close(loss, ref_loss.detach())
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), tiny_model.named_parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, p_ref.grad, msg=name)
