"""Sequence-tiled MLP: a decoder layer's feed-forward over tiles of tokens, recomputed in backward.

At long context a decoder layer's working set is its MLP, not its attention: for
Qwen3-1.7B at T = 262,144 tokens the gate and up projections are `[T, 6144]` bf16, 3 GiB
each, their activated product another 3 GiB, and autograd keeps all three for backward
plus as many gradients during it. The varlen attention kernel is O(T) and q/k/v are 1-2 GiB.

`TiledMLP` runs `mlp(x)` over tiles of `tile_tokens` rows. Forward keeps no graph and saves
only `x`; backward recomputes each tile's forward, backpropagates through it, writes that
tile's rows of the input gradient and adds its weight gradients to one accumulator per
parameter. Peak intermediate memory is a few `[tile_tokens, I]` tensors instead of several
`[T, I]`, plus one `[T, H]` output and input gradient that exist anyway.

Cost: backward runs the MLP forward once more, 2 x (MLP parameters) FLOPs per token, about
1.25N for Qwen3-1.7B (its MLPs hold 1.06B of the 1.7B parameters), against ~8N for a step
with layer recompute; at 262k tokens causal attention costs ~14x the MLP per token, so
the recompute adds a few percent. Weight gradients are summed over tiles in fp32 (for
bf16/fp16 parameters an fp32 copy of the MLP's weights per layer while its backward runs:
151 MB for Qwen3-1.7B), so tiling loses no precision to bf16 partial sums.
Sequences no longer than one tile take the plain path, so short-context training is unchanged.

Precondition, not checkable here: row i of `mlp(x)` depends only on row i of `x` (true of
every dense position-wise MLP; false of anything that mixes tokens, such as MoE capacity
limits or batch statistics), and the MLP is deterministic (dropout would draw different
masks in forward and recompute, so `enable_tiled_mlp` refuses a dropout with p > 0).
The autocast state of the forward is restored for the recompute, as activation
checkpointing does. Hooks on the MLP module itself run once per call; hooks on its
submodules (`gate_proj`, ...) run once per tile in forward and again in backward.

`enable_tiled_mlp` swaps each decoder layer's `mlp` to a subclass of its own class whose
only change is a tiled `forward` (`laden.model.patches.swap`, the way FSDP2's `fully_shard`
re-classes a module), instead of wrapping it: parameter names, state dicts and tied weights
do not change, and shallow copies of the module (the roundpipe engine runs layers as shells
bound to device weights) stay tiled and run on their own parameters, which an
instance-level `forward` bound to the original module would not. `disable_tiled_mlp` gives the original class back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from laden.model.patches import grad_sink
from laden.model.patches.swap import ClassSwap, check_own_forward, decoder_layers

__all__ = [
    "MLP_ATTRS",
    "TiledMLP",
    "disable_tiled_mlp",
    "enable_tiled_mlp",
    "tiled_forward",
]

MLP_ATTRS = ("gate_proj", "up_proj", "down_proj", "act_fn")
_TILE_ATTR = "_laden_tile_tokens"
_UNTILED_CLASS_ATTR = "_laden_untiled_class"
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _check_tile_tokens(tile_tokens: int) -> None:
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens <= 0:
        raise ValueError(
            f"tile_tokens={tile_tokens!r} must be a positive int (rows per tile); use e.g. 8192 "
            "(memory ~ tile_tokens x intermediate_size per intermediate tensor)"
        )


def _tile_view(x_flat: torch.Tensor, start: int, stop: int, ndim: int) -> torch.Tensor:
    """Rows [start, stop) of the flattened input, with the input's rank: [1, ..., n, H]."""
    tile = x_flat[start:stop]  # [n, H]
    return tile.view((1,) * (ndim - 2) + tuple(tile.shape))


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class TiledMLP(torch.autograd.Function):
    """`fn(x)` over tiles of `tile_tokens` rows of `x` [..., T, H], saving only `x` for backward.

    `TiledMLP.apply(fn, tile_tokens, x, *params)`: `params` are the tensors `fn` uses that
    need gradients (usually its trainable parameters); they receive gradients summed over
    tiles. `fn` must map each row independently (see the module docstring).
    """

    @staticmethod
    def forward(ctx, fn: Callable, tile_tokens: int, x: torch.Tensor, *params: torch.Tensor):
        ctx.fn, ctx.tile_tokens, ctx.ndim = fn, tile_tokens, x.dim()
        # The very objects `fn` uses: autograd.grad in backward differentiates wrt them.
        # (save_for_backward could hand back aliases under activation checkpointing.)
        ctx.params = params
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(x)
        x_flat = x.reshape(-1, x.shape[-1])  # [N, H]
        num_rows, out = x_flat.shape[0], None
        for start in range(0, num_rows, tile_tokens):
            stop = min(start + tile_tokens, num_rows)
            y = fn(_tile_view(x_flat, start, stop, x.dim()))  # [..., n, H_out]
            if out is None:  # shape and dtype known only now (autocast may change the dtype)
                out = y.new_empty((num_rows, y.shape[-1]))  # [N, H_out]
            out[start:stop] = y.reshape(stop - start, -1)
        assert out is not None, "the input has at least one row (checked by tiled_forward)"
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        need_x, need_params = ctx.needs_input_grad[2], ctx.needs_input_grad[3:]
        params = [p for p, need in zip(ctx.params, need_params) if need]
        x_flat = x.detach().reshape(-1, x.shape[-1])  # [N, H]
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])  # [N, H_out]
        grad_x = torch.empty_like(x_flat) if need_x else None  # [N, H]
        accs: list[torch.Tensor | None] = [None] * len(params)
        enabled, dtype = ctx.autocast
        for start in range(0, x_flat.shape[0], ctx.tile_tokens):
            stop = min(start + ctx.tile_tokens, x_flat.shape[0])
            tile = _tile_view(x_flat, start, stop, ctx.ndim).detach().requires_grad_(need_x)
            with (
                torch.enable_grad(),
                torch.autocast(x.device.type, dtype=dtype, enabled=enabled),
                grad_sink.suspended(),
            ):
                y = ctx.fn(tile)  # weights' gradients come back per tile, summed below: one per backward
            inputs = ([tile] if need_x else []) + params
            grads = torch.autograd.grad(y, inputs, grad_flat[start:stop].reshape(y.shape), allow_unused=True)
            if grad_x is not None:
                grad_x[start:stop] = grads[0].reshape(stop - start, -1)
            _accumulate(accs, grads[int(need_x) :])
            del y, grads, tile  # free this tile's graph before the next one is built
        param_grads = iter(_finish(accs, params))
        return (
            None,
            None,
            None if grad_x is None else grad_x.view_as(x),
            *(next(param_grads) if need else None for need in need_params),
        )


def _accumulate(accs: list[torch.Tensor | None], grads: Sequence[torch.Tensor | None]) -> None:
    """accs[i] += grads[i]; bf16/fp16 gradients are summed in fp32 so tiling loses no precision."""
    for i, g in enumerate(grads):
        if g is None:
            continue
        if accs[i] is None:
            acc_dtype = torch.float32 if g.dtype in _LOW_PRECISION else g.dtype
            accs[i] = g.to(dtype=acc_dtype, copy=True)
        else:
            accs[i].add_(g)  # type: ignore[union-attr]


def _finish(accs: list[torch.Tensor | None], params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return [None if acc is None else acc.to(p.dtype) for acc, p in zip(accs, params)]


def tiled_forward(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    params: Sequence[torch.Tensor],
    *,
    tile_tokens: int,
) -> torch.Tensor:
    """`fn(x)` for x [..., T, H] computed over tiles of `tile_tokens` rows (all leading dims flattened).

    `params`: the tensors `fn` closes over; those that require grad get gradients. An input
    of at most `tile_tokens` rows runs `fn(x)` directly (one tile: nothing to save by tiling).
    """
    _check_tile_tokens(tile_tokens)
    if x.dim() < 2:
        raise ValueError(f"tiled_forward needs x of shape [..., T, H]; got {tuple(x.shape)}")
    num_rows = x.numel() // max(x.shape[-1], 1)
    if num_rows <= tile_tokens:
        return fn(x)
    trainable = [p for p in params if p.requires_grad]
    return TiledMLP.apply(fn, tile_tokens, x, *trainable)


def _tiled_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The tiled class's `forward`: the original class's forward, over tiles of the sequence."""
    untiled = functools.partial(_SWAP.original(self).forward, self)
    return tiled_forward(untiled, x, list(self.parameters()), tile_tokens=self.__dict__[_TILE_ATTR])


_SWAP = ClassSwap(
    prefix="Tiled",
    marker=_UNTILED_CLASS_ATTR,
    methods=lambda cls: {"forward": _tiled_mlp_forward},
    owner=__name__,
)


class_swap = _SWAP.lookup  # what unpickling a tiled MLP looks up


def tile_tokens_of(module: nn.Module | None) -> int | None:
    """The tile size of an MLP `enable_tiled_mlp` tiled; None for any other module (or None)."""
    return module.__dict__[_TILE_ATTR] if module is not None and _SWAP.applied(module) else None


def _check_mlp(model: nn.Module, index: int, layer: nn.Module) -> nn.Module:
    mlp = getattr(layer, "mlp", None)
    missing = ["mlp"] if mlp is None else [a for a in MLP_ATTRS if not hasattr(mlp, a)]
    if mlp is None or missing:
        raise ValueError(
            f"{type(model).__name__}: decoder layer {index} ({type(layer).__name__}, mlp "
            f"{type(mlp).__name__}) lacks {', '.join(missing)}; enable_tiled_mlp expects every layer's "
            f"`mlp` to be a dense gated MLP with {', '.join(MLP_ATTRS)} (Qwen3, Qwen2, Llama, Mistral); "
            "mixture-of-experts blocks are not position-wise and cannot be tiled this way"
        )
    check_own_forward(mlp, f"{type(model).__name__}: layers.{index}.mlp", "tiling")
    for name, sub in mlp.named_modules():
        if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
            raise ValueError(
                f"{type(model).__name__}: layers.{index}.mlp.{name} is a dropout with p={sub.p}; the "
                "tiled MLP recomputes its forward in backward and would draw a different mask; set that "
                "dropout to 0 (e.g. lora_dropout=0) or leave the MLP untiled"
            )
    return mlp


def enable_tiled_mlp(model: nn.Module, *, tile_tokens: int) -> int:
    """Tile every decoder layer's `mlp` of a Hugging Face causal LM over `tile_tokens` rows.

    Returns the number of MLPs tiled. Calling it again changes the tile size. Parameters,
    their names and the state dict are untouched; `disable_tiled_mlp` undoes it.
    """
    _check_tile_tokens(tile_tokens)
    layers = decoder_layers(
        model, "enable_tiled_mlp", "; for other modules call laden.model.patches.tiled.tiled_forward directly"
    )
    mlps = [_check_mlp(model, i, layer) for i, layer in enumerate(layers)]  # all checked before any patch
    for mlp in mlps:
        _SWAP.apply(mlp)
        mlp.__dict__[_TILE_ATTR] = tile_tokens
    return len(mlps)


def disable_tiled_mlp(model: nn.Module) -> int:
    """Give every MLP `enable_tiled_mlp` tiled its original class back; returns how many."""
    undone = _SWAP.undo(model)
    for module in undone:
        del module.__dict__[_TILE_ATTR]
    return len(undone)
