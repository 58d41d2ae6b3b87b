"""Tensor-parallel plans (DTensor) and FSDP2 sharding of a Hugging Face decoder-only LM.

Tensor parallel (`t`), per decoder layer: q/k/v and MLP gate/up are column-parallel
(each rank owns whole heads / a slice of the intermediate size), o and MLP down are
row-parallel (one all-reduce each after attention and after the MLP). Per-head norms
(Qwen3's `q_norm`/`k_norm`) see only the local heads, so they are treated as sharded on
the head dimension and their replicated weight gets its gradient summed across ranks by
DTensor. The embedding is vocab-parallel and the LM head is split on the vocabulary
(consumed by `vocab_parallel_cross_entropy`, never by a full-logit forward); a value model's one-row
head (`laden.model.value_head`) has no vocabulary to split and is replicated, each rank computing
the same values from the replicated hidden states. Every other
parameter (layer norms) becomes a replicated DTensor, so all parameters live on the same
2-D (shard x tp) mesh once FSDP shards them, which keeps the optimizer's foreach kernels
and the gradient norm on one mesh.

KV heads: with `kv % t == 0` k/v are split like q. With `t % kv == 0` (more ranks than KV
heads) the k/v projections stay replicated and each rank keeps the one KV head its query
heads use; the backward sums the KV-head gradients across ranks (one all-reduce of the
`[T, kv * D]` k and v gradients per layer). The cost is computing all KV heads on every
rank, which is small next to q and the MLP.

FSDP2: one `fully_shard` unit per decoder layer plus the root (embedding, final norm, LM
head, tied weights stay in one unit). Parameters are stored in the optimizer dtype and
gathered in the compute dtype (`MixedPrecisionPolicy`), gradients reduced in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from laden.config.alloc import head_rule_errors

# Hugging Face models are typed `nn.Module` here; their config and submodules are read as `Any`.


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a Hugging Face causal LM (`model.model.layers`)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no `model.layers` list of decoder blocks; the fsdp and archon "
            "engines support Hugging Face decoder-only causal LMs (Llama, Qwen2/3, Mistral layouts)"
        )
    return layers


def check_head_rule(model: nn.Module, size: int, *, axis_name: str) -> None:
    """ValueError unless `size` divides the heads and divides or is a multiple of the KV heads."""
    cfg: Any = model.config
    errors = head_rule_errors(
        size,
        cfg.num_attention_heads,
        getattr(cfg, "num_key_value_heads", None),
        field="actor.backend",
        axis_name=axis_name,
    )
    if errors:
        raise ValueError(errors[0])


class ReplicateParallel(ParallelStyle):
    """Parameters become replicated DTensors; plain-tensor inputs and outputs on both sides."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(_mod, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                if isinstance(x, torch.Tensor)
                else x
                for x in inputs
            )

        def to_local(_mod, output, _mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, None, to_dtensor, to_local)


class _SelectKVHead(torch.autograd.Function):
    """Keep one KV head of a replicated k/v projection; backward sums the head gradients over ranks."""

    @staticmethod
    def forward(ctx, full, head, head_dim, group):
        ctx.meta = (full.shape, head, head_dim, group)
        return full[..., head * head_dim : (head + 1) * head_dim].clone()  # [B, T, D]

    @staticmethod
    def backward(ctx, grad):
        shape, head, head_dim, group = ctx.meta
        full = grad.new_zeros(shape)  # [B, T, kv * D]
        full[..., head * head_dim : (head + 1) * head_dim] = grad
        # Ranks sharing a KV head each hold the gradient through their own query heads.
        dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group)
        return full, None, None, None


def _select_kv_head_hook(head: int, head_dim: int, group):
    def hook(_mod, _inputs, output):
        return _SelectKVHead.apply(output, head, head_dim, group)

    return hook


def _layer_plan(layer: Any, split_kv: bool, *, moe_apart: bool = False) -> dict[str, ParallelStyle]:
    apart: set[int] = set()
    if moe_apart:
        from laden.model.moe import moe_blocks

        apart = {id(m) for block in moe_blocks(layer) for m in block.modules()}
    plan: dict[str, ParallelStyle] = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
    }
    if not apart:
        plan |= {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                 "mlp.down_proj": RowwiseParallel()}  # fmt: skip
    kv_style: ParallelStyle = ColwiseParallel() if split_kv else ReplicateParallel()
    plan["self_attn.k_proj"] = kv_style
    plan["self_attn.v_proj"] = kv_style
    for norm in ("q_norm", "k_norm"):
        if hasattr(layer.self_attn, norm):
            # [B, T, heads_local, D]: the local heads are a shard of dim 2.
            plan[f"self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    for name, mod in layer.named_modules():
        owns = any(True for _ in mod.parameters(recurse=False))
        if name and name not in plan and id(mod) not in apart and owns:
            plan[name] = ReplicateParallel()
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, moe_apart: bool = False) -> None:
    """Split `model` over `tp_mesh` in place (see the module docstring). `moe_apart`: the
    mixture-of-experts blocks (router, experts, shared experts) are left whole, as plain modules and
    parameters: they run replicated on every tensor rank, and the engine reduces their gradients."""
    tp = tp_mesh.size()
    check_head_rule(model, tp, axis_name="tensor parallel")
    cfg: Any = model.config
    num_heads, num_kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    split_kv = num_kv % tp == 0
    tp_rank, group = tp_mesh.get_local_rank(), tp_mesh.get_group()
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, _layer_plan(layer, split_kv, moe_apart=moe_apart))
        attn: Any = layer.self_attn
        local_kv = num_kv // tp if split_kv else 1
        attn.num_key_value_groups = (num_heads // tp) // local_kv
        if not split_kv:
            head = tp_rank // (tp // num_kv)
            for proj in (attn.k_proj, attn.v_proj):
                proj.register_forward_hook(_select_kv_head_hook(head, attn.head_dim, group))
    _parallelize_root(model, tp_mesh)


def _parallelize_root(model: Any, tp_mesh: DeviceMesh) -> None:
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    parallelize_module(embed, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
    if tied:
        head.weight = embed.weight
    elif head is not None and head.weight.shape[0] == 1:  # a value head: nothing to split (module docstring)
        parallelize_module(head, tp_mesh, ReplicateParallel())
    elif head is not None:
        parallelize_module(head, tp_mesh, ColwiseParallel())
    layer_ids = {id(m) for layer in decoder_layers(model) for m in layer.modules()}
    skip = layer_ids | {id(embed), id(head)}
    for mod in model.modules():
        if id(mod) not in skip and any(True for _ in mod.parameters(recurse=False)):
            parallelize_module(mod, tp_mesh, ReplicateParallel())


def apply_fsdp(
    root: nn.Module,
    layers: nn.ModuleList,
    shard_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    storage_dtype: torch.dtype,
    offload_params: bool,
    pin_memory: bool,
) -> None:
    """`fully_shard` each decoder layer, then `root` (which takes every remaining parameter)."""
    mp = MixedPrecisionPolicy(
        param_dtype=None if param_dtype == storage_dtype else param_dtype, reduce_dtype=torch.float32
    )
    offload = CPUOffloadPolicy(pin_memory=pin_memory) if offload_params else OffloadPolicy()
    for layer in layers:
        fully_shard(layer, mesh=shard_mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(root, mesh=shard_mesh, mp_policy=mp, offload_policy=offload)
