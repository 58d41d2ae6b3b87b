"""Expert parallelism and the router load-balancing loss for Hugging Face mixture-of-experts blocks.

Supported blocks: the transformers 5.x fused layout (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GPT-OSS):
a module with `experts` holding 3-D `gate_up_proj` / `down_proj` parameters (`[E, 2I, H]`, `[E, H, I]`,
or transposed with biases as GPT-OSS) and a top-k router (`gate` or `router`: a `weight [E, H]`, a
`top_k`, a forward returning `(router_logits, scores, indices)`). Anything else is refused with a
ValueError naming its class. Qwen2-MoE's shared expert is part of its block and stays replicated.

Expert parallel (`apply_expert_parallel`). Each of the `e` ranks of a group keeps experts
`[r E/e, (r+1) E/e)` as plain parameters of `E/e` rows (cut from the full weights, so every rank
of one seeded model holds consistent shards; each records its `ExpertShard`). The router runs on
every rank on its own tokens, as before; the experts' forward (swapped per module, like
`laden.model.patches`, never for a whole class) then sends each kept token-assignment to the rank
owning its expert with a differentiable all-to-all, runs the local experts on what arrives (one
matmul pair per expert, the weights cast to the activations' dtype so fp32 masters run under bf16
activations), sends the results back and combines them with the routing weights on the token's
own rank. The cost: one host sync per layer and forward (the split sizes of the all-to-all), a
Python loop over the `E/e` local experts instead of a grouped GEMM, and `config._experts_implementation`
is ignored for these blocks. An expert's gradient on its rank sums every token of the group that
reached it: an engine reduces it over the ranks that hold the same shard (the data-parallel replicas
outside the group), never over the group. With `capacity_factor` c, each expert takes at most
`ceil(c * N * k / E)` assignments from each source rank (N that rank's tokens, padding included),
in token order (token n's k choices before token n+1's); the rest are dropped (they add zero, as in
Switch / GShard) and counted. None or 0 is dropless. With no group (or one rank) the parameters stay
as they are and only the capacity applies. Every rank of the group must run every forward and
backward of the same layers in the same order, also with no tokens (the all-to-alls run in both).
The swapped modules hold the ProcessGroup, so an expert-parallel model is not copied or pickled.

Router loss (`enable_router_aux_loss`). Per MoE layer and forward, over that forward's N tokens,
the Switch Transformer loss `aux = E * sum_i f_i * P_i` (f_i: the fraction of the N*k assignments
routed to expert i, before any capacity drop; P_i: the mean router probability of expert i, the
softmax over all E logits in fp32). It is 1 for a perfectly balanced router; Hugging Face's
`load_balancing_loss_func` is k times it and pools every layer's tokens (so HF's
`router_aux_loss_coef` a corresponds to coef = k * a here). The loss never appears in any output:
an autograd Function is the identity on the router's routing weights and, in backward, also feeds
`coef * scale / M` into the layer's aux (the "aux-loss auto-scaler"), so it works in any pipeline
stage. The gradient is that of

    objective + coef * sum_f scale_f * (1 / M) * sum_{MoE layers l of forward f} aux_{l,f}

where M is the number of MoE blocks of the model passed in (pass the whole model, before it is cut
into pipeline stages) and `scale_f` is `RouterStats.scale` when forward f ran (read then and kept in
the graph, so 1F1B and non-reentrant recompute see the right one). An engine sets
`stats.scale = mb.num_loss_tokens / normalizer` before each micro-batch's forward: the router term is
then coef times the loss-token-weighted mean over micro-batches of the layer-mean aux, normalised like
the language-model loss. The aux is over all the tokens of the forward, padding included, unless
`stats.num_real_tokens` names how many leading rows are real (archon appends its padding document
at the end of a packed row). Each rank's aux is over its own tokens.

Metrics (`RouterStats.pop`): device tensors, no host sync; every forward counts except a recompute
inside backward (activation checkpointing). A forward without a graph counts too: under the roundpipe
engine, which runs a stage's forward and then recomputes it, the recomputed layers count twice, so
`moe_aux_loss` leans toward them (the gradient does not: only the recomputed graph is differentiated).
The metrics are this process's: its tokens, and the MoE layers of its pipeline stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from laden.model.patches.swap import ClassSwap

__all__ = [
    "ExpertShard",
    "RouterStats",
    "apply_expert_parallel",
    "enable_router_aux_loss",
    "expert_shard",
    "expert_shards",
    "gather_expert_shard",
    "load_balancing_loss",
    "moe_blocks",
]

ROUTER_NAMES = ("gate", "router")  # the top-k router's attribute: Qwen / Mixtral / OLMoE, GPT-OSS
_SHARD_ATTR = "_laden_expert_shard"
_EP_ATTR = "_laden_ep"
_AUX_ATTR = "_laden_router_aux"
FAMILIES = "Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE and GPT-OSS as laid out by transformers 5.x"


# ---------------------------------------------------------------------------- blocks


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The sparse MoE blocks of `model` (modules with an `experts` submodule), in layer order.

    ValueError, naming the class, for a block not in the fused layout of the module docstring.
    """
    blocks = [m for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)]
    for block in blocks:
        _check_block(block)
    return blocks


def _router(block: nn.Module) -> Any:
    """The block's top-k router module, or None."""
    for name in ROUTER_NAMES:
        router = getattr(block, name, None)
        weight = getattr(router, "weight", None)
        if hasattr(router, "top_k") and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return router
    return None


def _check_block(block: nn.Module) -> None:
    experts, router = _experts(block), _router(block)
    fused = all(
        isinstance(p, nn.Parameter) and p.dim() == 3
        for p in (getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None))
    )
    plain = getattr(experts, "has_gate", True) and not getattr(experts, "has_post_expert_norm", False)
    if router is None or not fused or not plain:
        raise ValueError(
            f"{type(block).__name__} (experts {type(experts).__name__}) is not a supported mixture-of-experts "
            f"block: laden.model.moe needs experts with 3-D gate_up_proj / down_proj parameters and a top-k "
            f"router at .gate or .router ({FAMILIES}); upgrade transformers or leave this model out"
        )
    ep = experts.__dict__.get(_EP_ATTR)
    rows = ep.num_local if ep is not None and ep.num_ranks > 1 else router.weight.shape[0]
    if experts.gate_up_proj.shape[0] != rows:
        raise ValueError(
            f"{type(block).__name__}: the router scores {router.weight.shape[0]} experts but the experts hold "
            f"{experts.gate_up_proj.shape[0]}; load the model whole before laden.model.moe changes it"
        )


def _experts(block: nn.Module) -> Any:
    return block.experts


def _num_experts(block: nn.Module) -> int:
    router = _router(block)
    assert router is not None
    return int(router.weight.shape[0])


# ---------------------------------------------------------------------------- expert shards


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertShard:
    """Where an expert-parallel parameter sits in the full one: `size` rows from `offset` along `dim`."""

    dim: int
    """The expert dimension (0 for every supported layout)."""
    offset: int
    """This rank's first expert."""
    size: int
    """The experts this rank holds (E / e)."""
    full_size: int
    """All the experts (E)."""
    group: Any
    """The expert-parallel ProcessGroup the shards are spread over, rank r holding offset r * size."""


def expert_shard(param: torch.Tensor) -> ExpertShard | None:
    """The shard record `apply_expert_parallel` left on `param`, or None for any other tensor."""
    return getattr(param, _SHARD_ATTR, None)


def expert_shards(model: nn.Module) -> dict[str, ExpertShard]:
    """Every expert-parallel parameter of `model` by name, with its shard."""
    found = ((name, expert_shard(p)) for name, p in model.named_parameters())
    return {name: shard for name, shard in found if shard is not None}


def gather_expert_shard(tensor: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """The full tensor (every rank's shard concatenated along `shard.dim`): a collective of `shard.group`,
    for checkpoints and weight export; `tensor` is this rank's shard (or anything laid out like it)."""
    local = tensor.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(shard.group))]
    dist.all_gather(parts, local, group=shard.group)
    return torch.cat(parts, dim=shard.dim)


# ---------------------------------------------------------------------------- expert parallel


@dataclass(eq=False, kw_only=True, slots=True)
class _ExpertParallel:
    """What a swapped experts module needs: its group, its experts and the dropped-assignment tally."""

    group: Any  # ProcessGroup, or None with one rank
    rank: int
    num_ranks: int
    num_experts: int
    capacity_factor: float | None
    num_dropped: torch.Tensor | None = None  # since the last RouterStats.pop, on the device
    num_assigned: int = 0

    @property
    def num_local(self) -> int:
        return self.num_experts // self.num_ranks

    def tally(self, dropped: torch.Tensor, assigned: int) -> None:
        if not _recomputing():
            self.num_dropped = dropped if self.num_dropped is None else self.num_dropped + dropped
            self.num_assigned += assigned

    def take(self) -> tuple[torch.Tensor | None, int]:
        out = (self.num_dropped, self.num_assigned)
        self.num_dropped, self.num_assigned = None, 0
        return out


def apply_expert_parallel(model: nn.Module, group: Any, *, capacity_factor: float | None = None) -> None:
    """Spread every MoE block's experts over the ranks of `group` (module docstring).

    group: a ProcessGroup of e ranks (every rank calls this with the same model); None (or one
    rank) keeps every expert here and only applies `capacity_factor`. capacity_factor: None or 0 is
    dropless; c > 0 caps each expert at ceil(c * N * k / E) assignments per source rank.
    """
    if capacity_factor is not None and not capacity_factor >= 0:
        raise ValueError(f"capacity_factor={capacity_factor}: use None or 0 (dropless) or a positive factor")
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts blocks ({FAMILIES}) to spread")
    rank, num_ranks = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    for block in blocks:  # every block checked before any is changed
        _check_divisible(block, num_ranks)
        if _EXPERTS_SWAP.applied(_experts(block)):
            raise ValueError(f"{type(block).__name__}'s experts are expert-parallel already; apply it once")
    for block in blocks:
        ep = _ExpertParallel(group=group, rank=rank, num_ranks=num_ranks, num_experts=_num_experts(block),
                             capacity_factor=capacity_factor or None)  # fmt: skip
        experts = _experts(block)
        if num_ranks > 1:
            _shard_experts(experts, ep)
        experts.__dict__[_EP_ATTR] = ep
        _EXPERTS_SWAP.apply(experts)


def _check_divisible(block: nn.Module, num_ranks: int) -> None:
    num_experts = _num_experts(block)
    if num_experts % num_ranks:
        fits = [e for e in range(1, num_experts + 1) if num_experts % e == 0]
        raise ValueError(
            f"{type(block).__name__} has {num_experts} experts, which do not split evenly over e={num_ranks} "
            f"expert-parallel ranks; choose e among {fits} (actor.backend archon:dXpYeZ)"
        )


def _shard_experts(experts: nn.Module, ep: _ExpertParallel) -> None:
    """Replace each `[E, ...]` parameter with this rank's `[E/e, ...]` rows (copied) and record them."""
    offset = ep.rank * ep.num_local
    shard = ExpertShard(dim=0, offset=offset, size=ep.num_local, full_size=ep.num_experts, group=ep.group)
    for name, full in list(experts.named_parameters(recurse=False)):
        if full.dim() == 0 or full.shape[0] != ep.num_experts:
            continue
        local = nn.Parameter(full.detach()[offset : offset + ep.num_local].clone(), full.requires_grad)
        setattr(local, _SHARD_ATTR, shard)
        setattr(experts, name, local)


def _expert_parallel_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """[N, H] tokens, [N, k] chosen experts and routing weights -> [N, H], the experts spread over ranks."""
    ep: _ExpertParallel = self.__dict__[_EP_ATTR]
    top_k = top_k_index.shape[-1]
    order, sent, received = _dispatch_plan(ep, top_k_index)
    token = order // top_k  # [S] the token of each kept assignment, grouped by expert
    splits_out = _per_rank(sent, ep)
    splits_in = _per_rank(received, ep)
    inputs = _send(hidden_states[token], splits_in, splits_out, ep)  # [R, H]
    outputs = _local_experts(self, inputs, received, ep)  # [R, H]
    returned = _send(outputs, splits_out, splits_in, ep)  # [S, H]
    weighted = returned * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(hidden_states).index_add(0, token, weighted.to(hidden_states.dtype))


def _dispatch_plan(
    ep: _ExpertParallel, top_k_index: torch.Tensor
) -> tuple[torch.Tensor, list[int], list[int]]:
    """(kept assignments [S] as flat `n * k + j` indices grouped by expert, in token order within each;
    assignments sent per expert [E]; assignments received per (source rank, local expert) [e * E/e])."""
    ids = top_k_index.reshape(-1)  # [N*k] the expert of each assignment
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(ep.num_experts, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))  # [E]; no bincount: it syncs on CUDA
    kept = counts
    if ep.capacity_factor:
        capacity = math.ceil(ep.capacity_factor * ids.numel() / ep.num_experts)
        kept = counts.clamp(max=capacity)
        first = torch.cumsum(counts, 0) - counts  # [E] where each expert's run starts in `order`
        position = torch.arange(ids.numel(), device=ids.device) - first[ids[order]]
        order = order[torch.argsort((position >= capacity).to(torch.int32), stable=True)]  # kept first
        ep.tally((counts - kept).sum(), ids.numel())
    received = _exchange(kept, ep)
    # The one host sync of the layer: the all-to-all's split sizes (sent and received together).
    sizes = torch.cat([kept, received]).tolist()
    sent_counts, received_counts = sizes[: ep.num_experts], sizes[ep.num_experts :]
    return order[: sum(sent_counts)], sent_counts, received_counts


def _exchange(counts: torch.Tensor, ep: _ExpertParallel) -> torch.Tensor:
    """[E] assignments this rank sends per expert -> [e * E/e] it receives per source and local expert."""
    if ep.num_ranks == 1:
        return counts
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=ep.group)
    return received


def _per_rank(counts: list[int], ep: _ExpertParallel) -> list[int]:
    n = ep.num_local
    return [sum(counts[r * n : (r + 1) * n]) for r in range(ep.num_ranks)]


def _send(x: torch.Tensor, splits_in: list[int], splits_out: list[int], ep: _ExpertParallel) -> torch.Tensor:
    """Rows `x` [sum(splits_out), ...], `splits_out[r]` of them to rank r -> [sum(splits_in), ...] received."""
    return x if ep.num_ranks == 1 else _AllToAll.apply(x, splits_in, splits_out, ep.group)


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, splits_in: list[int], splits_out: list[int], group: Any
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (splits_in, splits_out), group
        return _all_to_all(x, splits_in, splits_out, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        splits_in, splits_out = ctx.splits
        return _all_to_all(grad, splits_out, splits_in, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, splits_in: list[int], splits_out: list[int], group: Any) -> torch.Tensor:
    out = x.new_empty((sum(splits_in), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), splits_in, splits_out, group=group)
    return out


def _local_experts(
    experts: nn.Module, x: torch.Tensor, counts: list[int], ep: _ExpertParallel
) -> torch.Tensor:
    """Each local expert on the rows every source sent it; rows keep their arrival order (by source,
    then expert). Every expert runs, idle ones on no rows, so each weight gets a gradient (zeros)."""
    chunks = x.split(counts)  # e * E/e pieces, source-major
    out: list[torch.Tensor] = list(chunks)
    for j in range(ep.num_local):
        mine = range(j, len(chunks), ep.num_local)  # expert j's piece from each source
        y = _expert(experts, j, torch.cat([chunks[i] for i in mine]))
        for i, part in zip(mine, y.split([counts[i] for i in mine])):
            out[i] = part
    return torch.cat(out)


def _expert(experts: Any, j: int, x: torch.Tensor) -> torch.Tensor:
    """Local expert `j` on rows `x` [n, H] -> [n, H], computed in x's dtype."""
    transposed = bool(getattr(experts, "is_transposed", False))
    gate_up = _linear(x, experts.gate_up_proj[j], _bias(experts, "gate_up_proj_bias", j), transposed)
    apply_gate = getattr(experts, "_apply_gate", None)
    if apply_gate is not None:
        hidden = apply_gate(gate_up)
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = experts.act_fn(gate) * up
    return _linear(hidden, experts.down_proj[j], _bias(experts, "down_proj_bias", j), transposed)


def _bias(experts: nn.Module, name: str, j: int) -> torch.Tensor | None:
    bias = getattr(experts, name, None)
    return bias[j] if isinstance(bias, torch.Tensor) else None


def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool
) -> torch.Tensor:
    weight = weight.to(x.dtype)
    y = x @ weight if transposed else F.linear(x, weight)  # [in, out] (GPT-OSS) or [out, in]
    return y if bias is None else y + bias.to(x.dtype)


_EXPERTS_SWAP = ClassSwap(
    prefix="ExpertParallel",
    marker="_laden_ep_original_class",
    methods=lambda cls: {"forward": _expert_parallel_forward},
    owner=__name__,
    arg="experts",
)


# ---------------------------------------------------------------------------- router loss


def load_balancing_loss(
    router_logits: torch.Tensor, top_k_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Switch Transformer's `E * sum_i f_i * P_i` (fp32 scalar) of [N, E] logits and [N, k] choices,
    and the assignments per expert ([E] int64; counted without a host sync)."""
    num_experts = router_logits.shape[-1]
    probs = torch.softmax(router_logits.float(), dim=-1)  # [N, E]
    ids = top_k_index.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    fraction = counts.float() / ids.numel()  # f_i
    return num_experts * (fraction * probs.mean(dim=0)).sum(), counts


class RouterStats:
    """The router loss's weights and the routing metrics of a model's MoE blocks (module docstring).

    Set `coef` (at any time), `scale` before each micro-batch's forward, and `num_real_tokens` when
    a forward's trailing rows are padding; `pop()` after a step.
    """

    def __init__(self, blocks: list[nn.Module], coef: float) -> None:
        self.coef = coef
        self.scale = 1.0
        self.num_real_tokens: int | None = None
        self._blocks = blocks
        self._aux_sum: torch.Tensor | None = None
        self._num_aux = 0
        self._loads: dict[int, torch.Tensor] = {}  # per MoE layer: assignments per expert [E]

    @property
    def num_layers(self) -> int:
        """M: the MoE blocks of the whole model; the router term averages over them."""
        return len(self._blocks)

    def routed(
        self, layer: int, logits: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        """A router's output seen by layer `layer`: tallies it, and returns `scores` carrying the aux."""
        n = logits.shape[0] if self.num_real_tokens is None else min(self.num_real_tokens, logits.shape[0])
        weight = self.coef * self.scale / self.num_layers
        differentiate = weight != 0 and torch.is_grad_enabled() and logits.requires_grad
        if n == 0:
            return scores
        with torch.set_grad_enabled(differentiate):
            aux, counts = load_balancing_loss(logits[:n], indices[:n])
        if not _recomputing():
            self._aux_sum = aux.detach() if self._aux_sum is None else self._aux_sum + aux.detach()
            self._num_aux += 1
            self._loads[layer] = counts + self._loads[layer] if layer in self._loads else counts
        return _AuxLossScaler.apply(scores, aux, weight) if differentiate else scores

    def pop(self, group: Any = None) -> dict[str, torch.Tensor]:
        """Since the last pop (then reset), as device tensors: `moe_aux_loss` (the mean aux over layers
        and forwards), `moe_dropped_fraction` (dropped / all assignments, 0 dropless), and
        `moe_expert_load_max` (per layer, the most loaded expert's share of its assignments times E,
        1.0 when balanced; averaged over the layers).

        `group`: the ranks of one model split by stages and data (every rank calls it): the tallies
        are summed over them first, so every rank returns the whole model's figures over the whole
        step, as one process would (each layer's load from its expert counts summed over the data
        ranks; ranks that tally the same tokens, tensor parallel, count them in both terms of each
        ratio, which leaves it unchanged). None: this process's own."""
        dev = self._device()
        zero = torch.zeros((), device=dev)
        dropped, assigned = zero, 0
        for block in self._blocks:
            ep = _experts(block).__dict__.get(_EP_ATTR)
            num, count = ep.take() if ep is not None else (None, 0)
            dropped, assigned = (dropped + num if num is not None else dropped), assigned + count
        if group is not None:
            num_experts = int(_router(self._blocks[0]).weight.shape[0])
            counts = torch.zeros(self.num_layers, num_experts, device=dev)
            for layer, c in self._loads.items():
                counts[layer] += c.to(dev, torch.float32)
            aux_sum = zero if self._aux_sum is None else self._aux_sum.float()
            sums = torch.stack([aux_sum, torch.tensor(float(self._num_aux), device=dev),
                                dropped.float(), torch.tensor(float(assigned), device=dev)])  # fmt: skip
            flat = torch.cat([counts.flatten(), sums])
            dist.all_reduce(flat, group=group)
            counts = flat[: counts.numel()].view_as(counts)
            aux_sum, num_aux, dropped, total = flat[counts.numel() :]
            self._aux_sum, self._num_aux = (aux_sum if num_aux > 0 else None), int(num_aux)
            self._loads = {i: c for i, c in enumerate(counts) if c.sum() > 0}
            assigned = int(total)
        aux = zero if self._aux_sum is None else self._aux_sum / self._num_aux
        loads = [c.numel() * c.max().float() / c.sum() for c in self._loads.values()]
        load = torch.stack(loads).mean() if loads else zero
        self._aux_sum, self._num_aux, self._loads = None, 0, {}
        fraction = dropped.float() / max(assigned, 1)
        return {"moe_aux_loss": aux, "moe_dropped_fraction": fraction, "moe_expert_load_max": load}

    def _device(self) -> torch.device:
        """Where the tallies live: a recorded tensor's device, else a materialised router's (not meta)."""
        for t in (self._aux_sum, *self._loads.values()):
            if t is not None:
                return t.device
        devices: list[torch.device] = [_router(b).weight.device for b in self._blocks]
        return next((d for d in devices if d.type != "meta"), torch.device("cpu"))


def enable_router_aux_loss(model: nn.Module, coef: float) -> RouterStats:
    """Tally every MoE block's routing and add `coef` times the router loss to the gradient (module
    docstring); coef 0 keeps the metrics only. A second call replaces the first's `RouterStats`."""
    if not coef >= 0:
        raise ValueError(f"router aux loss coef={coef}: use 0 (metrics only) or a positive weight")
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts blocks ({FAMILIES})")
    stats = RouterStats(blocks, coef)
    for layer, block in enumerate(blocks):
        router = _router(block)
        assert router is not None
        router.__dict__[_AUX_ATTR] = (stats, layer)
        _ROUTER_SWAP.apply(router)
    return stats


def _router_methods(cls: type[nn.Module]) -> dict[str, Any]:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        logits, scores, indices = cls.forward(self, *args, **kwargs)
        stats, layer = self.__dict__[_AUX_ATTR]
        return logits, stats.routed(layer, logits, scores, indices), indices

    return {"forward": forward}


_ROUTER_SWAP = ClassSwap(
    prefix="RouterAux",
    marker="_laden_aux_original_class",
    methods=_router_methods,
    owner=__name__,
    arg="router",
)


def class_swap(arg: object = None) -> ClassSwap:
    """The swap a pickled swapped module names (`laden.model.patches.swap`): the experts' or the router's."""
    return _EXPERTS_SWAP if arg == "experts" else _ROUTER_SWAP


class _AuxLossScaler(torch.autograd.Function):
    """The identity on `x`; backward also sends `weight` as the gradient of the scalar `aux`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight, ctx.aux_meta = weight, (aux.dtype, aux.device)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        dtype, device = ctx.aux_meta
        return grad, torch.full((), ctx.weight, dtype=dtype, device=device), None


def _recomputing() -> bool:
    """Inside a backward pass: a checkpointed layer's recompute, which must not count twice."""
    return torch._C._current_graph_task_id() != -1
