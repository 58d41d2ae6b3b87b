"""Tensor parallel for the native engine (`rollout.backend: native:d1t2`): Megatron's layout on
`torch.distributed`, nothing but PyTorch.

Layout. Rank r of an engine's t ranks holds the query heads `[r*Hq/t, (r+1)*Hq/t)` and the KV
heads they read: the q/k/v projections are cut by rows (column parallel), the output projection
by columns (row parallel: each rank's product is a partial sum, all-reduced before the residual
add, its bias added once after); the MLP's gate and up projections by rows, the down projection
by columns (all-reduced). With fewer KV heads than ranks (t a multiple of them) a KV head is held
by the t/Hkv ranks whose query heads read it. Each rank's KV cache holds its own KV heads only:
t=2 halves the KV bytes per rank (with Hkv >= t). Norms, the embedding and the LM head are
replicated: a vocabulary-parallel head would save 2 x V x H per rank (2.3 GiB for Qwen3-8B in
bf16) at the price of a logits gather or a sharded sampler. Cost per decode step: two
all-reduces of `[B, H]` per layer and one broadcast of the B sampled token ids.

Scheduling. Rank 0 of the group (the leader) alone schedules, computes logits and samples.
Before each device phase it broadcasts what it is about to run (a `Message`: the packed prompt
tokens and cache slots of a prefill; the block tables, last tokens, positions and sampling
settings of a decode window) over a gloo group, and the other ranks (followers) run exactly
that; inside a window each step's token ids are broadcast on the device, so every rank feeds
the same tokens to the next step by construction. The alternative, every rank running the same
scheduler in lockstep, breaks as soon as a request reaches two ranks at different moments
relative to a window (the asyncio driver's timing): the ranks would disagree on the batch and
hang in a collective or silently mix sequences. Leading costs one small object broadcast per
device phase (two per window at most) and keeps the host work on one rank.

The engine's methods are collective calls: every rank of the group calls them in the same order
with the same arguments (as a torchrun program calls collectives), and each rank slices its
shard out of the full tensors an update gives (`ShardLayout`). `laden.rollout.native.follower`
is the followers' side.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from laden.config.alloc import valid_head_sizes

MESSAGE_KINDS = ("prefill", "decode", "idle", "error", "pause", "resume", "update", "sleep", "wake", "close")
"""What the leader sends: the two device phases of a window; `idle` (its driver stopped: nothing
queued) and `error` (a window failed, the text in `payload`); one per collective method call."""


@dataclass(slots=True)
class Message:
    """One leader-to-followers message: its kind, the phase's inputs (or the call's argument),
    and the completions that finished since the previous message (the followers' results)."""

    kind: str
    payload: Any = None
    results: list = field(default_factory=list)


@dataclass(eq=False, slots=True)
class TensorParallel:
    """The ranks of one engine: `group` for the device collectives (NCCL on GPUs, gloo on the CPU),
    `control` (gloo) for the leader's messages. `rank` is this rank's index in the group, `leader`
    the global rank of index 0."""

    group: Any
    control: Any
    rank: int
    size: int
    leader: int

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place (a row-parallel product's partial sums)."""
        dist.all_reduce(t, group=self.group)

    def broadcast(self, t: torch.Tensor) -> None:
        """The leader's `t` into every rank's `t` (the sampled token ids)."""
        dist.broadcast(t, src=self.leader, group=self.group)

    def send(self, message: Message) -> None:
        """Leader: `message` to every follower (pickled, on the CPU)."""
        dist.broadcast_object_list([message], src=self.leader, group=self.control)

    def receive(self) -> Message:
        """Follower: the leader's next message (blocks until it is sent)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=self.leader, group=self.control)
        return box[0]

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (KV blocks each rank's memory allows)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())


def tensor_parallel_groups(size: int) -> TensorParallel:
    """This rank's engine group: the world cut into consecutive blocks of `size` ranks
    (`native:dNtM`: N engines of M ranks each). Collective over the default process group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"tensor parallel generation (t={size}) needs torch.distributed started: launch with torchrun "
            f"--nproc-per-node {size} (or call torch.distributed.init_process_group first)"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 1 or world % size:
        raise ValueError(
            f"tensor parallel size {size} does not divide the {world} processes of the run; launch d*t processes"
        )
    mine = None
    for first in range(0, world, size):  # every rank creates every group, in the same order
        ranks = list(range(first, first + size))
        group = dist.new_group(ranks)
        control = dist.new_group(ranks, backend="gloo")
        if first <= rank < first + size:
            mine = TensorParallel(group=group, control=control, rank=rank - first, size=size, leader=first)
    assert mine is not None
    return mine


def local_heads(num_heads: int, num_kv_heads: int, size: int) -> tuple[int, int]:
    """(query heads, KV heads) of one rank: KV heads are split, or one per rank when t > Hkv."""
    return num_heads // size, max(1, num_kv_heads // size)


_COLUMN = re.compile(r"\.(self_attn\.(?:q|k|v)_proj|mlp\.(?:gate|up)_proj)\.(?:weight|bias)$")
_ROW = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.weight$")
_PART = {
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "kv",
    "self_attn.v_proj": "kv",
    "self_attn.o_proj": "q",
    "mlp.gate_proj": "mlp",
    "mlp.up_proj": "mlp",
    "mlp.down_proj": "mlp",
}


class ShardLayout:
    """Which slice of each Hugging Face tensor rank `rank` of `size` holds (see the module docstring).

    Raises `ValueError` for a model the layout cannot split `size` ways, naming the sizes that work."""

    def __init__(self, config: Any, *, rank: int, size: int) -> None:
        nh = int(config.num_attention_heads)
        nkv = int(getattr(config, "num_key_value_heads", None) or nh)
        hd = int(getattr(config, "head_dim", None) or config.hidden_size // nh)
        inter = int(config.intermediate_size)
        _check_splits(nh, nkv, inter, size)
        self.rank, self.size = rank, size
        self.num_heads, self.num_kv_heads = local_heads(nh, nkv, size)
        kv_first = rank * self.num_kv_heads if nkv % size == 0 else rank // (size // nkv)
        # part -> (first row or column, count, full size) of this rank's slice
        self._ranges = {
            "q": (rank * self.num_heads * hd, self.num_heads * hd, nh * hd),
            "kv": (kv_first * hd, self.num_kv_heads * hd, nkv * hd),
            "mlp": (rank * (inter // size), inter // size, inter),
        }

    def split(self, name: str) -> tuple[int, int, int, int] | None:
        """(dim, start, length, full length) of `name`'s slice; None for a replicated tensor."""
        for pattern, dim in ((_COLUMN, 0), (_ROW, 1)):
            m = pattern.search(name)
            if m:
                return (dim, *self._ranges[_PART[m.group(1)]])
        return None

    def full_shape(self, name: str, local: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the whole tensor whose shard has shape `local`."""
        split = self.split(name)
        shape = list(local)
        if split is not None:
            shape[split[0]] = split[3]
        return tuple(shape)

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the whole tensor `full` (a view)."""
        split = self.split(name)
        if split is None:
            return full
        dim, start, length, total = split
        if full.dim() <= dim or full.shape[dim] != total:
            raise ValueError(
                f"weight {name!r} is {list(full.shape)}; tensor parallel rank {self.rank} of {self.size} "
                f"expects dim {dim} of size {total} (the whole tensor): update from the same architecture"
            )
        return full.narrow(dim, start, length)

    @torch.no_grad()
    def shard_model(self, model: nn.Module) -> None:
        """Replace each split parameter of `model` by its own copy of this rank's slice (the whole
        tensor is freed); parameters already of the shard's shape are kept."""
        for name, p in model.named_parameters():
            split = self.split(name)
            if split is None:
                continue
            dim, _, length, total = split
            if p.shape[dim] == length and length != total:
                continue
            p.data = self.shard(name, p.data).clone()

    def slices(
        self, named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`(name, whole tensor)` pairs as `(name, this rank's slice)`, one at a time."""
        pairs = named.items() if isinstance(named, Mapping) else named
        for name, full in pairs:
            yield name, self.shard(name, full)
            del full

    def full_specs(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Meta tensors of the whole shapes and dtypes of `params` (what an update must send)."""
        return {
            name: torch.empty(self.full_shape(name, t.shape), dtype=t.dtype, device="meta")
            for name, t in params.items()
        }


def _check_splits(nh: int, nkv: int, inter: int, size: int) -> None:
    problems = []
    if nh % size or (nkv % size and size % nkv):
        valid = ", ".join(map(str, valid_head_sizes(nh, nkv)))
        problems.append(
            f"t={size} must divide num_attention_heads={nh} and either divide or be a multiple of "
            f"num_key_value_heads={nkv}; valid t for this model: {valid}"
        )
    if inter % size:
        problems.append(f"t={size} must divide the MLP's intermediate_size={inter}")
    if problems:
        raise ValueError(
            "the native engine cannot split this model for tensor parallel generation: "
            + "; ".join(problems)
            + ". Set rollout.backend: native:d<N>t<valid t>"
        )
