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

This class holds the state (mesh, stages, expert shards, optimizer) and the `TrainEngine` methods;
the parts that act on it live beside it, each taking the engine: `layout` (the layout check, the
mesh, weight owners, FSDP over the stages), `experts` (MoE set-up), `passes` (micro-batch
preparation, the schedule, gradient-free passes), `grads` (the gradients FSDP does not reduce,
the global norm) and `state` (weights gathered whole, the checkpoint layout); the stage modules
are `pipeline`'s.

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
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from laden.data.batch import PackedBatch
from laden.engine.archon.experts import expert_params, replicated_params, setup_moe
from laden.engine.archon.grads import grad_norm, sum_tied_gradients, sync_sparse_gradients
from laden.engine.archon.layout import (
    StageMesh,
    build_mesh,
    check_layout,
    release_others,
    shard_stages,
    stage_owners,
)
from laden.engine.archon.passes import StepSchedule, forward_only, prepared
from laden.engine.archon.pipeline import (
    StageModule,
    stage_bounds,
    step_costs,
)
from laden.engine.archon.state import checkpoint_items, engine_state, iter_weights, load_engine_state
from laden.engine.base import FORWARD_OUTPUTS, ForwardOutput, Objective, OffloadedError, TrainEngineBase
from laden.engine.device import autocast_context, default_device, enable_gradient_checkpointing
from laden.engine.parallel.objective import TokenOutputs
from laden.engine.parallel.offload import StorageOffload, state_tensors
from laden.engine.parallel.parallelize import apply_tensor_parallel, check_head_rule
from laden.engine.parallel.params import cast_params_
from laden.engine.parallel.ulysses import enable_ulysses, gather_row
from laden.model.loss import DEFAULT_LOSS_CHUNK_SIZE
from laden.model.objective import CrossEntropy
from laden.optim import OptimSettings, build_optimizer, param_groups_with_decay

log = logging.getLogger("laden.archon")


class ArchonEngine(TrainEngineBase):
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
        check_layout(dp, pp, ep, tp, cp, schedule, virtual_stages)
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
        self._use_mesh(build_mesh(pp, dp, ep, cp, tp, self.device.type) if self.distributed else None)
        self.model = model
        self.config: Any = model.config
        self._record_names(model)
        self._loss_scale = 1.0  # set per step by forward_backward; a pass without gradients (an evaluation
        # before the first step) weighs the router loss it does not use by this
        self._moe_blocks, self.moe_stats = setup_moe(
            model, ep_group=self.mesh["ep"].get_group() if ep > 1 else None, tp=tp, compute_dtype=dtype,
            storage_dtype=self.storage_dtype, device_type=self.device.type, router_aux_loss_coef=router_aux_loss_coef,
            capacity_factor=capacity_factor,
        )  # fmt: skip
        if tp > 1:
            apply_tensor_parallel(model, self.mesh["tp"], moe_apart=True)
        cast_params_(model, self.storage_dtype, frozen_dtype=self.compute_dtype)
        if gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.recomputes = gradient_checkpointing
        model.train()
        self._build_stages(model, plan_tokens)
        self.experts = expert_params(self.stages)
        """This rank's expert shards (left out of FSDP, so they stay these objects)."""
        self._expert_ids = {id(p) for p in self.experts}
        self.replicated = (
            replicated_params(self.stages, self._moe_blocks, self.experts)
            if tp > 1 and self.moe_stats is not None
            else []
        )
        """With `t > 1`, the rest of the MoE blocks' parameters here (routers, shared experts, experts
        when `e = 1`): whole, plain and left out of FSDP, like the expert shards."""
        self._replicated_ids = {id(p) for p in self.replicated}
        if self.distributed:
            shard_stages(self.stages, self.shard_mesh, compute_dtype=self.compute_dtype,
                         storage_dtype=self.storage_dtype, ignored=set(self.experts) | set(self.replicated))  # fmt: skip
        self._build_optimizer()
        self._version = 0
        self._schedule = StepSchedule()
        self._offloaded = False
        self._offload_store: Any = None

    # ----------------------------------------------------------------- set-up

    def _use_mesh(self, m: StageMesh | None) -> None:
        """The mesh's parts as attributes; without a process group, this one process's place (0 on every axis)."""
        self.mesh: Any = None
        self.pp_rank, self.dp_index, self.coord, self.cp_rank = 0, 0, 0, 0
        if m is None:
            return
        self.mesh, self.dp_mesh, self.shard_mesh, self.host_group = (
            m.mesh,
            m.dp_mesh,
            m.shard_mesh,
            m.host_group,
        )
        self.ranks, self.coord = m.ranks, m.coord
        self.pp_rank, self.cp_rank = m.mesh["pp"].get_local_rank(), m.mesh["cp"].get_local_rank()
        self.dp_index = m.dp_mesh.get_local_rank()
        self.pp_group = m.mesh["pp"].get_group()

    def _record_names(self, model: nn.Module) -> None:
        """Hugging Face names and full shapes, before anything is sliced, sharded or moved."""
        from laden.model.hf.export import hf_state_names

        self.hf_names = hf_state_names(model)
        self.full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.num_params_full = sum(p.numel() for p in model.parameters())

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
        self.owner = stage_owners(self.bounds, steps, names, self.hf_names, self.pp)
        kept = {id(p) for stage in self.stages for p in stage.parameters()}
        release_others(model, kept)
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
            self.tied_groups = [dist.new_group([row[i] for row in (self.ranks[0], self.ranks[-1])])
                                 for i in range(self.dp * self.tp * self.cp)]  # fmt: skip

    def named_params(self) -> list[tuple[str, nn.Parameter]]:
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
        named = self.named_params()
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
        self.recomputes = True
        self._schedule.reset()
        return True

    # ----------------------------------------------------------------- steps

    def _check_onloaded(self, what: str) -> None:
        if self._offloaded:
            raise OffloadedError(f"ArchonEngine.{what}")

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.distributed:  # FSDP's MixedPrecisionPolicy casts the gathered weights
            return contextlib.nullcontext()
        return autocast_context(self.device, self.storage_dtype, self.compute_dtype)

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
        mbs = prepared(self, micro_batches)
        self._loss_scale = self.dp * self.cp / float(normalizer)  # FSDP averages over dp x cp
        for stage in self.stages:
            stage.start(mbs, objective, self._loss_scale)
        total = self._schedule.run(self, mbs) if self.pp > 1 else self._run_plain(mbs)
        sync_sparse_gradients(self)
        if self.tied:
            sum_tied_gradients(self)
        return self._global_loss(total / (self.dp * self.cp))

    def _run_plain(self, mbs: list[PackedBatch]) -> torch.Tensor:
        (stage,) = self.stages
        total = torch.zeros((), device=self.device)
        for mb in mbs:
            with self.autocast():
                loss = stage(mb.input_ids[None]).sum()
            loss.backward()
            total = total + loss.detach()
        return total

    def _global_loss(self, local: torch.Tensor) -> torch.Tensor:
        """The last stage's loss, broadcast over the pipeline, summed over data-parallel ranks."""
        if not self.distributed:
            return local
        if self.pp > 1:
            dist.broadcast(local, src=self.ranks[self.pp - 1][self.coord], group=self.pp_group)
        dist.all_reduce(local, group=self.shard_mesh.get_group())  # data ranks and context slices
        return local

    def optimizer_step(self) -> dict[str, torch.Tensor]:
        """Clip the global gradient norm over every stage and shard, step; `version` += 1."""
        self._check_onloaded("optimizer_step")
        grads = [p.grad for _, p in self.named_params() if p.grad is not None]
        norm = grad_norm(self)
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

    # --------------------------------------------------------- without gradients

    def _eval_loss(
        self, micro_batches: Sequence[PackedBatch], objective: Objective, normalizer: float
    ) -> torch.Tensor:
        self._check_onloaded("eval_batch")
        mbs = prepared(self, micro_batches)
        total = torch.zeros((), device=self.device)
        for values in forward_only(self, mbs, objective, 1.0 / normalizer, ("loss",)):
            total = total + values["loss"].sum()
        return self._global_loss(total)

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
        mbs = prepared(self, micro_batches)
        results = list(forward_only(self, mbs, fn, 1.0, keys))
        return [{k: self._whole_row(v, mb.num_tokens).float().cpu() for k, v in r.items()}
                for r, mb in zip(results[: len(micro_batches)], micro_batches)]  # fmt: skip

    def _whole_row(self, values: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """A micro-batch's per-token values without padding: the context slices all-gathered first."""
        if self.cp == 1:
            return values[:num_tokens]
        return gather_row(values, self.mesh["cp"].get_group(), num_tokens)

    def reshard(self) -> None:
        """Free FSDP's gathered weights (kept after a forward without backward)."""
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
        self.reshard()
        return iter_weights(self, dtype or self.compute_dtype, device)

    # ----------------------------------------------------------------- offload

    def offload(self) -> None:
        """Parameters (local shards), gradients and optimizer states to host buffers. Idempotent."""
        if self._offloaded:
            return
        self.reshard()
        self._offload_store = self._offload_store or StorageOffload(self.device)
        self._offload_store.offload(state_tensors((p for _, p in self.named_params()), self.optimizer))
        self._offloaded = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self) -> None:
        if self._offload_store is not None:
            self._offload_store.onload()
        self._offloaded = False

    # ------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the shared layout, live (`laden.engine.archon.state.engine_state`)."""
        self._check_onloaded("state_dict")
        self.reshard()
        return engine_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load the shared layout (this rank's part, or full plain tensors), in place where it already is."""
        self._check_onloaded("load_state_dict")
        self._version = load_engine_state(self, state)

    def checkpoint_items(self, state: dict[str, Any]) -> Iterator[tuple[str, str, torch.Tensor | None]]:
        """(file stem, key, whole host tensor on rank 0 / None elsewhere) of `state` (this engine's
        `state_dict()`) and of every other stage's, in one order; every rank iterates to the end
        (`laden.engine.checkpoint.save_engine`)."""
        return checkpoint_items(self, state)
