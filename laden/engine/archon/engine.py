"""`ArchonEngine`: the `archon:dXpYtZcVeW` train engine: pipeline stages; FSDP2, tensor and context parallel
within each; experts over `e`.

Layout. The world is `p x d x c x t` processes on a `("pp", "edp", "ep", "cp", "tp")` device mesh (pipeline
outermost, tensor parallel innermost on the closest GPUs, then expert parallel for its all-to-alls);
the data-parallel axis `dp = edp x ep` is flattened from the middle two. With `t > 1`
the tensor-parallel plans of `laden.engine.parallel.parallelize` split every layer first (`apply_tensor_parallel`: the hidden
states between stages stay replicated, the head is split on the vocabulary and the cross-entropy is
vocab-parallel), and FSDP2 then shards the 2-D parameters over `dp`. Every process builds the whole model, keeps the
steps of its pipeline stage(s) (`laden.engine.archon.pipeline`: cut by parameter bytes plus kept
activations; with `Interleaved1F1B`, `virtual_stages` looped stages per rank) and moves the rest to
the meta device. Within a stage each decoder layer and the stage root are `fully_shard`ed over the
`dp` axis (FSDP2: fp32 masters, compute-dtype gathers, fp32 reduce-scatter). A Mixture-of-Experts
model with `e > 1` keeps `E / e` experts per rank (`laden.model.moe.apply_expert_parallel`): those
parameters are left out of FSDP, their gradients summed over the `edp` replicas here. With `t > 1` a
MoE block (router, experts, shared experts) stays whole and plain on every tensor rank, which all
route the same tokens, and its parameters are left out of FSDP too (reduced here, under autocast
when the compute dtype differs); with `c > 1` each context rank routes its own slice of the tokens
through the `ep` all-to-all of its context index.

Without a process group (`archon:d1` in one plain process) the same stage code runs the whole model
as one stage under autocast, like the fsdp engine's single process.

Scaling. FSDP averages gradients over `dp`, so every micro-batch's objective is multiplied by
`dp / normalizer`; the expert gradients, summed over the ranks whose tokens reached them, are
divided by `dp` after their `edp` sum. The result is `sum(objective) / normalizer` over the global
batch, equal to one process. Every parameter element lives on exactly one rank (the tied head's copy
on the last stage, and expert replicas over `edp`, are discounted), so the clipping norm is one
all-reduce of local squares.

`forward` / `eval_batch` run without the schedule: micro-batch by micro-batch, each stage receives
the hidden states from the previous one and sends its own on (point-to-point), and the last stage's
results are broadcast over the pipeline. `named_weights` walks the Hugging Face names in order:
the owning stage gathers each tensor (FSDP's `full_tensor`, the experts' all-gather) and broadcasts
it to every rank. `checkpoint_items` sends each tensor of the shared checkpoint layout to rank 0,
which writes it, so a checkpoint saved at one layout loads at any other (`laden.engine.checkpoint`).

The module is about 800 lines, past the house's 600: one class carries every `TrainEngine` method for
three kinds of parallelism at once (each needs the mesh, the stage map and the expert shards); the
stage code lives in `pipeline.py` and the experts in `laden.model.moe`.

With `c > 1` each rank of a stage holds a `1/c` slice of every micro-batch and attention runs
Ulysses all-to-alls (`laden.engine.parallel.ulysses`); FSDP shards over `dp x c`, the loss is summed over both,
and `forward` all-gathers the slices into whole rows.

Not here yet: experts split over the tensor ranks (the hybrid form's `ffn:...t`), the host-state optimizers of the
fsdp engine (`offload_params`, `per_layer_optim_step`), `adam_bf16` under a process group, LoRA.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from laden.data.batch import PackedBatch
from laden.engine.archon.pipeline import (
    SCHEDULES,
    StageModule,
    build_schedule,
    pad_to,
    padded_count,
    stage_bounds,
    step_costs,
)
from laden.engine.base import FORWARD_OUTPUTS, ForwardOutput, Objective, OffloadedError
from laden.engine.device import autocast_context, default_device, enable_gradient_checkpointing
from laden.engine.parallel.objective import TokenOutputs
from laden.engine.parallel.offload import StorageOffload
from laden.engine.parallel.padding import padding_batch
from laden.engine.parallel.parallelize import apply_tensor_parallel, check_head_rule
from laden.engine.parallel.params import cast_params_, local_shard, own_slice
from laden.engine.parallel.ulysses import enable_ulysses, gather_row, shard_batch
from laden.model.loss import DEFAULT_LOSS_CHUNK_SIZE
from laden.model.moe import expert_shard
from laden.model.objective import CrossEntropy
from laden.optim import OptimSettings, build_optimizer, param_groups_with_decay

log = logging.getLogger("laden.archon")


class ArchonEngine:
    """Pipeline, data, tensor, context and expert parallel training (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        dp: int = 1,
        pp: int = 1,
        ep: int = 1,
        tp: int = 1,
        cp: int = 1,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.bfloat16,
        optimizer_dtype: torch.dtype = torch.float32,
        optim: OptimSettings | None = None,
        schedule: str = "1F1B",
        virtual_stages: int = 1,
        gradient_checkpointing: bool = False,
        chunked_loss: bool = True,
        loss_chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
        plan_tokens: int = 4096,
        router_aux_loss_coef: float = 0.0,
        capacity_factor: float | None = None,
    ) -> None:
        self._check_layout(dp, pp, ep, tp, cp, schedule, virtual_stages)
        self.optim_settings = optim or OptimSettings()
        self.compute_dtype = dtype
        self.storage_dtype = self.optim_settings.master_dtype(optimizer_dtype)
        self.objective: Objective = CrossEntropy(chunked=chunked_loss, chunk_size=loss_chunk_size)
        self.loss_chunk_size = loss_chunk_size
        self.device = device or default_device()
        self.distributed = dist.is_initialized()
        self.dp, self.pp, self.ep, self.tp, self.cp = dp, pp, ep, tp, cp
        self.schedule_name = schedule
        self.virtual_stages = virtual_stages if schedule == "Interleaved1F1B" and pp > 1 else 1
        self._build_mesh()
        self.model = model
        self.config: Any = model.config
        self._record_names(model)
        self.moe_stats = self._setup_moe(model, router_aux_loss_coef, capacity_factor)
        if tp > 1:
            apply_tensor_parallel(model, self.mesh["tp"], moe_apart=True)
        cast_params_(model, self.storage_dtype, frozen_dtype=self.compute_dtype)
        if gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.recomputes = gradient_checkpointing
        model.train()
        self._build_stages(model, plan_tokens)
        self.experts = self._expert_params()
        """This rank's expert shards (left out of FSDP, so they stay these objects)."""
        self._expert_ids = {id(p) for p in self.experts}
        self.replicated = self._replicated_params()
        """With `t > 1`, the rest of the MoE blocks' parameters here (routers, shared experts, experts
        when `e = 1`): whole, plain and left out of FSDP, like the expert shards."""
        self._replicated_ids = {id(p) for p in self.replicated}
        self._shard()
        self._build_optimizer()
        self._version = 0
        self._built: tuple[int, int] | None = None
        self._schedule: Any = None
        self._offloaded = False
        self._offload_store: Any = None

    # ----------------------------------------------------------------- set-up

    def _check_layout(
        self, dp: int, pp: int, ep: int, tp: int, cp: int, schedule: str, virtual_stages: int
    ) -> None:
        sizes = (("d", dp), ("p", pp), ("e", ep), ("t", tp), ("c", cp), ("virtual_stages", virtual_stages))
        for name, size in sizes:
            if size < 1:
                raise ValueError(f"actor.backend: {name}={size} must be at least 1")
        if dp % ep:
            raise ValueError(
                f"actor.backend=archon:d{dp}p{pp}e{ep}: e={ep} must divide d={dp} (e overlays d)"
            )
        if schedule not in SCHEDULES:
            raise ValueError(f"actor.archon.pp_schedule={schedule!r}: use one of {', '.join(SCHEDULES)}")
        world = dist.get_world_size() if dist.is_initialized() else 1
        if dp * pp * tp * cp != world:
            raise ValueError(
                f"actor.backend=archon:d{dp}p{pp}t{tp}c{cp}e{ep} needs d x p x t x c = {dp * pp * tp * cp} processes but {world} were "
                f"started; launch with torchrun --nproc_per_node {dp * pp * tp * cp}, or change actor.backend"
            )

    def _build_mesh(self) -> None:
        self.mesh: Any = None
        self.pp_rank, self.dp_index, self.coord, self.cp_rank = 0, 0, 0, 0
        if not self.distributed:
            return
        from torch.distributed.device_mesh import init_device_mesh

        kind = self.device.type
        shape = (self.pp, self.dp // self.ep, self.ep, self.cp, self.tp)  # tensor parallel innermost
        mesh = init_device_mesh(kind, shape, mesh_dim_names=("pp", "edp", "ep", "cp", "tp"))
        self.mesh = mesh
        self.dp_mesh = mesh[("edp", "ep")]._flatten("dp")  # which share of the batch
        self.shard_mesh = mesh[("edp", "ep", "cp")]._flatten(
            "dp_cp"
        )  # FSDP's: context ranks are data ranks to it
        self.pp_rank = mesh["pp"].get_local_rank()
        self.dp_index = self.dp_mesh.get_local_rank()
        self.cp_rank = mesh["cp"].get_local_rank()
        self.pp_group = mesh["pp"].get_group()
        self.ranks = mesh.mesh.reshape(self.pp, -1).tolist()  # global rank of (pp rank, place in the stage)
        self.coord = self.ranks[self.pp_rank].index(dist.get_rank())  # this rank's place in its stage
        self.host_group = dist.new_group(backend="gloo")  # checkpoint transfers to rank 0

    def _record_names(self, model: nn.Module) -> None:
        """Hugging Face names and full shapes, before anything is sliced, sharded or moved."""
        from laden.model.hf.export import hf_state_names

        self.hf_names = hf_state_names(model)
        self.full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.num_params_full = sum(p.numel() for p in model.parameters())

    def _setup_moe(self, model: nn.Module, coef: float, capacity_factor: float | None) -> Any:
        from laden.model import moe

        self._moe_blocks = moe.moe_blocks(model)
        if not self._moe_blocks:
            return None
        if self.tp > 1 and self.compute_dtype != self.storage_dtype:
            for block in self._moe_blocks:  # left out of FSDP (whose gathers cast): autocast casts instead
                _run_under_autocast(block, self.device.type, self.compute_dtype)
        if self.ep > 1:
            moe.apply_expert_parallel(model, self.mesh["ep"].get_group(), capacity_factor=capacity_factor)
        elif capacity_factor:
            moe.apply_expert_parallel(model, None, capacity_factor=capacity_factor)
        return moe.enable_router_aux_loss(model, coef)

    def _build_stages(self, model: nn.Module, plan_tokens: int) -> None:
        from laden.model.attention import set_attention
        from laden.model.split import split_causal_lm

        if self.cp > 1:
            check_head_rule(model, self.cp, axis_name="context parallel")
            enable_ulysses(model, self.mesh["cp"].get_group())
        else:
            set_attention(model, "auto")  # packed rows: the varlen kernel keeps the documents apart
        steps = list(split_causal_lm(model).layers)
        self.num_stages = self.pp * self.virtual_stages
        costs = step_costs(steps, plan_tokens, dtype=self.compute_dtype, loss_chunk_size=self.loss_chunk_size)
        self.bounds = stage_bounds(costs, self.num_stages)
        self.stage_ids = [self.pp_rank + self.pp * v for v in range(self.virtual_stages)]  # looped placement
        names = {id(p): n for n, p in model.named_parameters()}
        self.stages: list[StageModule] = []
        self.stage_names: list[dict[str, str]] = []  # per stage: its own parameter name -> HF name
        for s in self.stage_ids:
            r = self.bounds[s]
            stage = StageModule([steps[i] for i in r], first=r.start == 0, last=r.stop == len(steps))
            self.stage_names.append({rel: names[id(p)] for rel, p in stage.named_parameters()})
            self.stages.append(stage)
        self.owner = self._owners(steps, names)
        kept = {id(p) for stage in self.stages for p in stage.parameters()}
        _release_others(model, kept)
        for stage in self.stages:
            stage.to(self.device)
            if self.moe_stats is not None:
                stage.before_micro_batch = self._weigh_router_loss
            stage.tp_group = self.mesh["tp"].get_group() if self.tp > 1 else None
            if not self.distributed and self.storage_dtype != self.compute_dtype != torch.float32:
                stage.head_dtype = self.compute_dtype  # autocast leaves the loss's in-place GEMMs in fp32
        self.first = self.stage_ids[0] == 0
        self.last = self.stage_ids[-1] == self.num_stages - 1
        tie = bool(getattr(self.config, "tie_word_embeddings", False))
        self.tied = tie and self.num_stages > 1 and self.distributed
        if self.tied:
            self._tied_groups = [dist.new_group([row[i] for row in (self.ranks[0], self.ranks[-1])])
                                 for i in range(self.dp * self.tp * self.cp)]  # fmt: skip

    def _owners(self, steps: list[nn.Module], names: dict[int, str]) -> dict[str, int]:
        """Each Hugging Face name -> the pipeline rank that holds it (the first stage for a tied weight)."""
        owner: dict[str, int] = {}
        for s, r in enumerate(self.bounds):
            for i in r:
                for p in steps[i].parameters():
                    owner.setdefault(names[id(p)], s % self.pp)
        missing = [n for n in self.hf_names if n not in owner]
        if missing:
            raise RuntimeError(f"archon: {missing[:3]} are on no pipeline stage; the split left them out")
        return owner

    def _shard(self) -> None:
        if not self.distributed:
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from laden.model.split import DecoderStep

        mp = MixedPrecisionPolicy(
            param_dtype=None if self.compute_dtype == self.storage_dtype else self.compute_dtype,
            reduce_dtype=torch.float32,
        )
        experts = set(self.experts) | set(self.replicated)
        for stage in self.stages:
            for step in stage.steps:
                if isinstance(step, DecoderStep):
                    own = {p for p in step.layer.parameters() if p in experts}
                    fully_shard(step.layer, mesh=self.shard_mesh, mp_policy=mp, ignored_params=own or None)
            fully_shard(stage, mesh=self.shard_mesh, mp_policy=mp, ignored_params=experts or None)

    def _expert_params(self) -> list[nn.Parameter]:
        return [p for stage in self.stages for p in stage.parameters() if expert_shard(p) is not None]

    def _replicated_params(self) -> list[nn.Parameter]:
        if self.tp == 1 or self.moe_stats is None:
            return []
        here = {id(p) for stage in self.stages for p in stage.parameters()}
        block_params = {id(p): p for block in self._moe_blocks for p in block.parameters()}
        return [p for i, p in block_params.items() if i in here and i not in self._expert_ids]

    def _named(self) -> list[tuple[str, nn.Parameter]]:
        """(HF name, live parameter) of this rank's stages; the tied weight twice on a rank with both ends."""
        out = []
        for stage, names in zip(self.stages, self.stage_names):
            out += [(names[rel], p) for rel, p in stage.named_parameters()]
        return out

    def _build_optimizer(self) -> None:
        o = self.optim_settings
        if o.type == "adam_bf16" and self.distributed:
            raise ValueError(
                "actor.optimizer.type='adam_bf16' is not supported by the archon engine under torchrun yet; "
                "use adam (fp32 states), or the fsdp engine"
            )
        named = self._named()
        plain = self._expert_ids | self._replicated_ids
        dense = [(n, p) for n, p in named if id(p) not in plain]
        sparse = [(n, p) for n, p in named if id(p) in plain]
        groups = param_groups_with_decay(dense, o.weight_decay) + param_groups_with_decay(
            sparse, o.weight_decay
        )
        self.optimizer = build_optimizer(groups, o)  # experts apart: DTensors and plain tensors never mix
        self.scheduler = o.build_scheduler(self.optimizer)

    # ------------------------------------------------------------- properties

    @property
    def version(self) -> int:
        return self._version

    @property
    def dp_rank(self) -> int:
        return self.dp_index

    @property
    def dp_size(self) -> int:
        return self.dp

    @property
    def num_params(self) -> int:
        return self.num_params_full

    def enable_recompute(self) -> bool:
        """Per-decoder-layer recompute from the next step on (an OOM retry); False when it is on already.

        Under a pipeline the schedule's stages are rebuilt with it."""
        if self.recomputes:
            return False
        enable_gradient_checkpointing(self.model)
        self.recomputes, self._built = True, None
        return True

    # ----------------------------------------------------------------- steps

    def _check_onloaded(self, what: str) -> None:
        if self._offloaded:
            raise OffloadedError(f"ArchonEngine.{what}")

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.distributed:  # FSDP's MixedPrecisionPolicy casts the gathered weights
            return contextlib.nullcontext()
        return autocast_context(self.device, self.storage_dtype, self.compute_dtype)

    def _prepared(self, micro_batches: Sequence[PackedBatch]) -> list[PackedBatch]:
        """On the device, padded to the count every data-parallel rank runs (and the schedule takes),
        and, under a pipeline, to one length (padding micro-batches: one padding document)."""
        mbs = [mb.to(self.device, non_blocking=True) for mb in micro_batches]
        if not self.distributed:
            if not mbs:
                raise ValueError("the engine got no micro-batches; pass at least one PackedBatch")
            return mbs
        count = torch.tensor([len(mbs)], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.host_group)
        target = padded_count(int(count.item()), name=self.schedule_name, num_ranks=self.pp)  # host values
        mbs += [padding_batch().to(self.device) for _ in range(target - len(mbs))]
        if self.pp > 1:
            length = max(mb.num_tokens for mb in mbs)
            mbs = [pad_to(mb, length) for mb in mbs]
        if self.cp > 1:  # this rank's slice of every row (`laden.engine.parallel.ulysses`)
            mbs = [shard_batch(mb, cp_rank=self.cp_rank, cp_size=self.cp) for mb in mbs]
        return mbs

    def _weigh_router_loss(self, mb: PackedBatch) -> None:
        """The router loss of the micro-batch about to run enters the gradient like its loss tokens."""
        self.moe_stats.scale = mb.num_loss_tokens * self._loss_scale
        real = sum(mb.seqlens)  # `pad_to`'s padding document, at the end, is left out
        if self.cp > 1:  # this rank holds tokens [r * piece, (r + 1) * piece) of the padded row
            piece = mb.input_ids.numel()
            real = min(max(real - self.cp_rank * piece, 0), piece)
        self.moe_stats.num_real_tokens = real

    def forward_backward(
        self, micro_batches: Sequence[PackedBatch], objective: Objective, *, normalizer: float
    ) -> torch.Tensor:
        """Fresh gradients of `sum(objective(mb)) / normalizer`; the global value on every rank."""
        self._check_onloaded("forward_backward")
        if not normalizer > 0:
            raise ValueError(f"normalizer={normalizer} must be positive (e.g. the global loss-token count)")
        self.optimizer.zero_grad(set_to_none=True)
        mbs = self._prepared(micro_batches)
        self._loss_scale = self.dp * self.cp / float(normalizer)  # FSDP averages over dp x cp
        for stage in self.stages:
            stage.start(mbs, objective, self._loss_scale)
        total = self._run_schedule(mbs) if self.pp > 1 else self._run_plain(mbs)
        self._sync_sparse_gradients()
        if self.tied:
            self._sum_tied_gradients()
        return self._global_loss(total / (self.dp * self.cp))

    def _run_plain(self, mbs: list[PackedBatch]) -> torch.Tensor:
        (stage,) = self.stages
        total = torch.zeros((), device=self.device)
        for mb in mbs:
            with self._autocast():
                loss = stage(mb.input_ids[None]).sum()
            loss.backward()
            total = total + loss.detach()
        return total

    def _run_schedule(self, mbs: list[PackedBatch]) -> torch.Tensor:
        self._build(mbs[0].num_tokens, len(mbs))
        losses: list[torch.Tensor] = []
        ids = torch.stack([mb.input_ids for mb in mbs])  # [M, T]: the schedule cuts [1, T] chunks
        if self.first and self.last:  # both ends on this rank (interleaved)
            self._schedule.step(ids, target=torch.zeros(len(mbs), 1, device=self.device), losses=losses)
        elif self.first:
            self._schedule.step(ids)
        elif self.last:
            self._schedule.step(target=torch.zeros(len(mbs), 1, device=self.device), losses=losses)
        else:
            self._schedule.step()
        if not self.last:
            return torch.zeros((), device=self.device)
        return torch.stack(losses).sum().detach()

    def _build(self, num_tokens: int, num_mbs: int) -> None:
        """The `PipelineStage`s (shapes given, not inferred) and the schedule, for this step's shape."""
        from torch.distributed.pipelining import PipelineStage

        if self._built == (num_tokens, num_mbs):
            return
        width = int(self.config.hidden_size)
        hidden = torch.zeros(
            1, num_tokens, width, dtype=self.compute_dtype, device=self.device, requires_grad=True
        )
        stages = []
        for s, module in zip(self.stage_ids, self.stages):
            inputs = (
                torch.zeros(1, num_tokens, dtype=torch.long, device=self.device) if module.first else hidden
            )
            outputs = torch.zeros(1, device=self.device, requires_grad=True) if module.last else hidden
            stages.append(PipelineStage(module, s, self.num_stages, self.device, input_args=(inputs,),
                                        output_args=(outputs,), group=self.pp_group))  # fmt: skip
        self._schedule = build_schedule(stages, name=self.schedule_name, num_micro_batches=num_mbs)
        self._built = (num_tokens, num_mbs)

    def _global_loss(self, local: torch.Tensor) -> torch.Tensor:
        """The last stage's loss, broadcast over the pipeline, summed over data-parallel ranks."""
        if not self.distributed:
            return local
        if self.pp > 1:
            dist.broadcast(local, src=self.ranks[self.pp - 1][self.coord], group=self.pp_group)
        dist.all_reduce(local, group=self.shard_mesh.get_group())  # data ranks and context slices
        return local

    def _sync_sparse_gradients(self) -> None:
        """The gradients FSDP does not reduce, as FSDP would (docstring): expert shards summed over their
        `edp` replicas and the context ranks (whose tokens differ), the MoE blocks' replicated parameters
        (`t > 1`) over every data and context rank; both divided by `dp x c`. The tensor ranks computed
        the same values from the same tokens."""
        if not self.distributed:
            return
        experts = [p.grad for p in self.experts if p.grad is not None]
        sums = [self.mesh[axis].get_group() for axis in ("edp", "cp") if self.mesh[axis].size() > 1]
        for grad in experts:
            for group in sums:
                dist.all_reduce(grad, group=group)
            grad.div_(self.dp * self.cp)
        for p in self.replicated:
            if p.grad is not None:
                if self.dp * self.cp > 1:
                    dist.all_reduce(p.grad, group=self.shard_mesh.get_group())
                p.grad.div_(self.dp * self.cp)

    def _tied_params(self) -> list[torch.Tensor]:
        out = []
        for stage in self.stages:
            steps: list[Any] = list(stage.steps)
            if stage.first:
                out.append(steps[0].embed_tokens.weight)
            if stage.last:
                out.append(steps[-1].lm_head.weight)
        return out

    def _sum_tied_gradients(self) -> None:
        """The first and the last stage of each data-parallel index add their copies' gradients."""
        if self.first and self.last:  # one rank holds both copies (interleaved with p=1 is refused)
            return
        for p in self._tied_params():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad: Any = p.grad
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            dist.all_reduce(local, group=self._tied_groups[self.coord])

    def optimizer_step(self) -> dict[str, torch.Tensor]:
        """Clip the global gradient norm over every stage and shard, step; `version` += 1."""
        self._check_onloaded("optimizer_step")
        grads = [p.grad for _, p in self._named() if p.grad is not None]
        norm = self._grad_norm()
        clip = self.optim_settings.gradient_clipping
        if clip > 0:
            scale = torch.clamp(clip / (norm + 1e-6), max=1.0)
            for g in grads:
                (g.to_local() if isinstance(g, DTensor) else g).mul_(scale)
        lr = torch.tensor(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        self._version += 1
        out = {"grad_norm": norm, "lr": lr}
        if self.moe_stats is not None:  # the whole model's over every stage and data rank (rank 0 logs)
            out.update(self.moe_stats.pop(group=dist.group.WORLD if self.distributed else None))
        return out

    def _grad_norm(self) -> torch.Tensor:
        edp = self.mesh["edp"].size() if self.distributed else 1
        copies = {"expert": edp * self.cp * self.tp, "replicated": self.dp * self.cp * self.tp}
        square = torch.zeros((), device=self.device)
        seen: set[int] = set()
        for _, p in self._named():
            if p.grad is None or id(p) in seen:
                continue
            seen.add(id(p))
            g: Any = p.grad
            local = (g.to_local() if isinstance(g, DTensor) else g).float()
            if id(p) in self._expert_ids:
                weight = 1.0 / copies["expert"]
            elif id(p) in self._replicated_ids:
                weight = 1.0 / copies["replicated"]
            else:
                weight = 1.0 / self._tp_copies(g)
            square = square + local.pow(2).sum() * weight
        if self.tied and self.last and not self.first:  # the tied weight counts once, on the first stage
            for t in self._tied_params()[-1:]:
                g = t.grad
                square = square - (g.to_local() if isinstance(g, DTensor) else g).float().pow(2).sum()
        if self.distributed:
            dist.all_reduce(square)
        return square.sqrt()

    def _tp_copies(self, t: Any) -> int:
        """How many tensor-parallel ranks hold the same values of `t` (those replicated over `tp`)."""
        if self.tp == 1 or not isinstance(t, DTensor):
            return 1
        names = t.device_mesh.mesh_dim_names or ()
        if "tp" not in names:
            return 1
        return self.tp if t.placements[names.index("tp")].is_replicate() else 1

    def train_batch(
        self,
        micro_batches: Sequence[PackedBatch],
        *,
        global_num_loss_tokens: int,
        objective: Objective | None = None,
    ) -> dict[str, torch.Tensor]:
        normalizer = float(max(global_num_loss_tokens, 1))
        loss = self.forward_backward(micro_batches, objective or self.objective, normalizer=normalizer)
        return {"loss": loss, **self.optimizer_step()}

    # --------------------------------------------------------- without gradients

    @torch.no_grad()
    def eval_batch(
        self,
        micro_batches: Sequence[PackedBatch],
        *,
        global_num_loss_tokens: int,
        objective: Objective | None = None,
    ) -> dict[str, torch.Tensor]:
        """The objective's global mean without gradients (every rank calls it)."""
        self._check_onloaded("eval_batch")
        mbs = self._prepared(micro_batches)
        scale = 1.0 / float(max(global_num_loss_tokens, 1))
        total = torch.zeros((), device=self.device)
        for values in self._forward_only(mbs, objective or self.objective, scale, ("loss",)):
            total = total + values["loss"].sum()
        return {"loss": self._global_loss(total)}

    @torch.no_grad()
    def forward(
        self,
        micro_batches: Sequence[PackedBatch],
        *,
        outputs: Sequence[ForwardOutput] = FORWARD_OUTPUTS,
        temperature: float = 1.0,
    ) -> list[dict[str, torch.Tensor]]:
        """Per micro-batch, each requested output as a `[T]` fp32 host tensor (every rank gets them)."""
        self._check_onloaded("forward")
        if not temperature > 0:
            raise ValueError(f"temperature={temperature} must be positive")
        keys = tuple(outputs)
        fn = TokenOutputs(outputs=keys, temperature=temperature, chunk_size=self.loss_chunk_size)
        mbs = self._prepared(micro_batches)
        results = list(self._forward_only(mbs, fn, 1.0, keys))
        return [{k: self._whole_row(v, mb.num_tokens).float().cpu() for k, v in r.items()}
                for r, mb in zip(results[: len(micro_batches)], micro_batches)]  # fmt: skip

    def _whole_row(self, values: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """A micro-batch's per-token values without padding: the context slices all-gathered first."""
        if self.cp == 1:
            return values[:num_tokens]
        return gather_row(values, self.mesh["cp"].get_group(), num_tokens)

    def _forward_only(
        self, mbs: list[PackedBatch], fn: Any, scale: float, keys: tuple[str, ...]
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Each micro-batch through every stage in turn (no schedule); the last stage's values (`loss`:
        the scaled objective, `[1]`; a per-token output, `[T]`) broadcast over the pipeline."""
        for stage in self.stages:
            stage.eval()
            stage.start(mbs, fn, scale)
        try:
            for mb in mbs:
                yield self._forward_one(mb, keys)
        finally:
            for stage in self.stages:
                stage.train()
            self._reshard()

    def _forward_one(self, mb: PackedBatch, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        x: Any = mb.input_ids[None]
        width = int(self.config.hidden_size)
        out: Any = None
        piped = self.distributed and self.pp > 1
        for s in range(self.num_stages):
            r = s % self.pp
            if r != self.pp_rank:
                continue
            if s > 0 and piped and (s - 1) % self.pp != r:
                x = torch.empty(1, mb.num_tokens, width, dtype=self.compute_dtype, device=self.device)
                dist.recv(x, src=self.ranks[(s - 1) % self.pp][self.coord], group=self.pp_group)
            with self._autocast():
                out = x = self.stages[self.stage_ids.index(s)](x)
            if s < self.num_stages - 1 and piped and (s + 1) % self.pp != r:
                dist.send(out.to(self.compute_dtype).contiguous(),
                          dst=self.ranks[(s + 1) % self.pp][self.coord], group=self.pp_group)  # fmt: skip
        values = (out if isinstance(out, dict) else {"loss": out}) if self.last else {}
        if not piped:
            return values
        src = self.ranks[self.pp - 1][self.coord]
        for k in keys:
            shape = (1,) if k == "loss" else (mb.num_tokens,)
            buf = values[k].float().reshape(shape) if self.last else torch.empty(shape, device=self.device)
            dist.broadcast(buf, src=src, group=self.pp_group)
            values[k] = buf
        return values

    def _reshard(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        for stage in self.stages:
            for module in stage.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    # ----------------------------------------------------------------- weights

    def named_weights(
        self,
        dtype: torch.dtype | None = None,
        *,
        device: torch.device | str | None = None,
        trained_only: bool = False,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The Hugging Face state one full tensor at a time, on every rank (every rank must iterate to the
        end): the owning stage gathers it, then broadcasts it. `trained_only` changes nothing (no LoRA)."""
        self._check_onloaded("named_weights")
        self._reshard()
        return self._iter_weights(dtype or self.compute_dtype, device)

    def _iter_weights(
        self, dtype: torch.dtype, device: torch.device | str | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        local = dict(self._named())
        for name in self.hf_names:
            with torch.no_grad():
                full = self._gather(
                    local.get(name) if self.owner[name] == self.pp_rank else None, name, dtype
                )
            yield name, full.to(device or full.device)
            del full

    def _gather(self, param: torch.Tensor | None, name: str, dtype: torch.dtype) -> torch.Tensor:
        """`name` whole on every rank: gathered on its pipeline rank, broadcast from there."""
        if param is not None:
            full = self._full_local(param).to(dtype)
        else:
            full = torch.empty(self.full_shapes[name], dtype=dtype, device=self.device)
        if self.distributed and self.pp > 1:
            dist.broadcast(full, src=self.ranks[self.owner[name]][0])
        return full

    def _full_local(self, t: torch.Tensor) -> torch.Tensor:
        """A parameter (or a state laid out like one) whole, within its stage (a collective of the stage)."""
        t = self._as_dtensor(t)
        return t.full_tensor() if isinstance(t, DTensor) else t.detach()

    def _as_dtensor(self, t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
        """An expert shard (or its optimizer state) as a DTensor over the `ep` axis; anything else as is."""
        from torch.distributed.tensor import Shard

        shard = expert_shard(like if like is not None else t)
        if shard is None or not self.distributed or self.ep == 1 or isinstance(t, DTensor):
            return t
        return DTensor.from_local(t, self.mesh["ep"], [Shard(shard.dim)], run_check=False)

    def export_hf(self, out_dir: Path, *, tokenizer: Any | None = None) -> None:
        """A Hugging Face directory in the compute dtype from `named_weights` (rank 0 writes)."""
        from laden.model.hf.export import export_hf

        write = not self.distributed or dist.get_rank() == 0
        export_hf(self.model, out_dir, dtype=self.compute_dtype, tokenizer=tokenizer,
                  weights=self.named_weights(self.compute_dtype), write=write)  # fmt: skip
        if self.distributed:
            dist.barrier()

    # ----------------------------------------------------------------- offload

    def offload(self) -> None:
        """Parameters (local shards), gradients and optimizer states to host buffers. Idempotent."""
        if self._offloaded:
            return
        self._reshard()
        self._offload_store = self._offload_store or StorageOffload(self.device)
        self._offload_store.offload(self._state_tensors())
        self._offloaded = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self) -> None:
        if self._offload_store is not None:
            self._offload_store.onload()
        self._offloaded = False

    def _state_tensors(self) -> Iterator[torch.Tensor]:
        seen: set[int] = set()
        for _, p in self._named():
            if id(p) in seen:
                continue
            seen.add(id(p))
            yield local_shard(p)
            if p.grad is not None:
                yield local_shard(p.grad)
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield local_shard(value)

    # ------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the shared layout: its stages' parameters (DTensors; expert shards as
        DTensors over `ep`) and their optimizer states, live."""
        from laden.optim import named_state

        self._check_onloaded("state_dict")
        self._reshard()
        named = dict(self._named())
        params = {n: self._as_dtensor(p) for n, p in named.items()}
        names = {id(p): n for n, p in named.items()}
        optim = named_state(self.optimizer, names, wrap=lambda value, p: self._as_dtensor(value, like=p))
        return {"model": params, "optimizer": optim, "scheduler": self.scheduler.state_dict(),
                "version": self._version}  # fmt: skip

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load the shared layout (this rank's part, or full plain tensors), in place where it already is."""
        from laden.optim import load_named_state

        self._check_onloaded("load_state_dict")
        named = dict(self._named())
        missing = sorted(set(named) - set(state["model"]))
        if missing:
            raise KeyError(
                f"the checkpoint holds no weights for {missing[:5]}; resume with the model it was written for"
            )
        for name, p in named.items():
            target = self._as_dtensor(p)
            src = own_slice(state["model"][name], target)
            src, dst = local_shard(src), local_shard(target)
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(self._expert_slice(src, dst, p))
        names = {id(p): n for n, p in named.items()}
        saved = state["optimizer"]
        local_states = {n: {k: self._expert_slice(local_shard(own_slice(v, self._as_dtensor(named[n]))), None, named[n])
                            for k, v in entry.items()} for n, entry in saved["state"].items() if n in named}  # fmt: skip
        # The param groups differ between stages and layouts (a stage without norms has no no-decay group):
        # their hyper-parameters come from this run's settings, the schedule's position from the checkpoint.
        load_named_state(self.optimizer, names, {**saved, "state": local_states, "param_groups": []})
        self._load_schedule_position(state["scheduler"])
        self._version = int(state["version"])

    def _load_schedule_position(self, saved: dict[str, Any]) -> None:
        """This run's LR schedule at the checkpoint's step (every group follows the same schedule)."""
        sched: Any = self.scheduler
        fresh = {**sched.state_dict(), "last_epoch": saved["last_epoch"], "_step_count": saved["_step_count"]}
        sched.load_state_dict(fresh)
        lrs = [base * f(sched.last_epoch) for f, base in zip(sched.lr_lambdas, sched.base_lrs)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        sched._last_lr = lrs

    def _expert_slice(
        self, value: torch.Tensor, dst: torch.Tensor | None, param: torch.Tensor
    ) -> torch.Tensor:
        """A full expert tensor (from a layout without expert parallel) cut to this rank's shard."""
        shard = expert_shard(param)
        local = local_shard(param)
        if shard is None or value.dim() == 0 or value.shape[shard.dim] == local.shape[shard.dim]:
            return value
        return value.narrow(shard.dim, shard.offset, local.shape[shard.dim])

    def checkpoint_items(self, state: dict[str, Any]) -> Iterator[tuple[str, str, torch.Tensor | None]]:
        """(file stem, key, whole host tensor on rank 0 / None elsewhere) of `state` (this engine's
        `state_dict()`) and of every other stage's, in one order; every rank iterates to the end
        (`laden.engine.checkpoint.save_engine`)."""
        from laden.engine.checkpoint import flat_tensors
        from laden.model.hf.export import host_copy

        local = {(stem, key): t for stem, key, t in flat_tensors(state)}
        order = self._global_items(local)
        rank = dist.get_rank() if self.distributed else 0
        for stem, key, owner in order:
            full = host_copy(local[(stem, key)]) if owner == self.pp_rank else None  # a stage collective
            if self.distributed:
                src = self.ranks[owner][0]
                if src != 0 and rank == src:
                    assert full is not None
                    dist.send(full, dst=0, group=self.host_group)
                elif src != 0 and rank == 0:
                    shape, dtype = self._item_meta[(stem, key)]
                    full = torch.empty(shape, dtype=dtype)
                    dist.recv(full, src=src, group=self.host_group)
            yield stem, key, full if rank == 0 else None

    def _global_items(self, local: dict[tuple[str, str], torch.Tensor]) -> list[tuple[str, str, int]]:
        """Every (stem, key) of every pipeline rank with its owner (the lowest pipeline rank holding it)."""
        mine = [
            (stem, key, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for (stem, key), t in local.items()
        ]
        self._item_meta: dict[tuple[str, str], tuple[tuple[int, ...], torch.dtype]] = {}
        if not self.distributed:
            return [(stem, key, 0) for stem, key, _, _ in mine]
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine, group=self.host_group)
        order, seen = [], set()
        for r in range(self.pp):
            for stem, key, shape, dtype in every[self.ranks[r][0]]:
                if (stem, key) not in seen:
                    seen.add((stem, key))
                    order.append((stem, key, r))
                    self._item_meta[(stem, key)] = (shape, getattr(torch, dtype))
        return sorted(order, key=lambda item: item[0] != "model")  # weights first, as written elsewhere


def _run_under_autocast(module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """`module`'s forward (this instance's) under autocast to `dtype`."""
    forward = module.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    module.forward = run  # type: ignore[method-assign]


def _release_others(model: nn.Module, kept: set[int]) -> None:
    """Every parameter not on this rank's stages moves to the meta device (its memory is freed)."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) not in kept and not p.is_meta:
                meta = torch.empty_like(
                    local_shard(p), device="meta"
                )  # a DTensor (tensor parallel): its shard's shape
                module._parameters[name] = nn.Parameter(meta, p.requires_grad)
