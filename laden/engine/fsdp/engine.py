"""`FSDPEngine`: the `fsdp:dXtYcZ` train engine on PyTorch FSDP2 and `torch.distributed`.

Every rank runs the same program on its part of the data: data-parallel ranks get
different micro-batches, context-parallel ranks slices of the same rows, tensor-parallel
ranks the same rows. One optimizer step (`forward_backward`, then `optimizer_step`):

1. the ranks agree on the micro-batch count (all-reduce MAX: one host sync per call) and
   those with fewer run padding micro-batches (one ignored token per context rank, fields
   read as zeros), because FSDP's all-gathers and reduce-scatters must match across ranks;
2. the root module (`ObjectiveRoot`) runs the decoder and hands the final hidden states, the
   head weight and the micro-batch (labels and per-token `fields`, this rank's slice under
   context parallel) to the objective, whose summed loss is scaled by
   `shard_size / normalizer`: FSDP *averages* gradients over the `dp x cp` shard axis, so the
   factor turns that mean into the global `sum / normalizer`, and d2 == d1 on the same data;
3. the global gradient norm is clipped, then one of three optimizer steps runs:
   `torch.optim` on the sharded parameters (states where the parameters are), the host
   AdamW on the offloaded shards (`offload_params`), or the per-layer streamed step
   (`per_layer_optim_step`: host states, update on the device, layer by layer).

This is also laden's one single-process engine: without a process group (one plain process,
`fsdp:d1`) the model is a plain module on the device and the same code runs, with autocast
instead of FSDP's mixed-precision policy (parameters stored in the optimizer dtype, the
forward in the compute dtype: weights are cast per matmul, the price of one fp32 copy).
`offload_params` needs FSDP's offload policy and starts a single-process group for it.

`forward` (log-probs, entropies without gradients), `named_weights` (one gathered tensor at a
time), `offload` / `onload` and the checkpoint layout are those of `laden.engine.base`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from laden.data.batch import PackedBatch
from laden.engine.base import FORWARD_OUTPUTS, ForwardOutput, Objective, OffloadedError, TrainEngineBase
from laden.engine.device import autocast_context, default_device, enable_gradient_checkpointing
from laden.engine.fsdp import load
from laden.engine.fsdp.checkpoint import engine_state, load_engine_state
from laden.engine.fsdp.loss import ObjectiveRoot
from laden.engine.parallel.launch import SHARD_AXIS, build_device_mesh, start_single_process_group
from laden.engine.parallel.objective import TokenOutputs
from laden.engine.parallel.offload import StorageOffload, state_tensors
from laden.engine.parallel.padding import ZeroFields, padding_batch
from laden.engine.parallel.parallelize import (
    apply_fsdp,
    apply_tensor_parallel,
    check_head_rule,
    decoder_layers,
)
from laden.engine.parallel.params import cast_params_
from laden.engine.parallel.ulysses import enable_ulysses, gather_row, shard_batch
from laden.model.lora import adapted_modules, merged_weights
from laden.model.loss import DEFAULT_LOSS_CHUNK_SIZE
from laden.model.objective import CrossEntropy
from laden.optim import OptimSettings, ShardedStep, build_optimizer, clip_grad_norm_, param_groups_with_decay

log = logging.getLogger("laden.fsdp")


class FSDPEngine(TrainEngineBase):
    """FSDP2 data, tensor and Ulysses context parallel training; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        *,
        dp: int = 1,
        tp: int = 1,
        cp: int = 1,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.bfloat16,
        optimizer_dtype: torch.dtype = torch.float32,
        optim: OptimSettings | None = None,
        gradient_checkpointing: bool = False,
        offload_params: bool = False,
        per_layer_optim_step: bool = False,
        optim_step_prefetch_layers: int = 1,
        memory_efficient_load: bool = False,
        full_state_dict: dict[str, torch.Tensor] | None = None,
        chunked_loss: bool = True,
        loss_chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
    ) -> None:
        for name, size in (("dp", dp), ("tp", tp), ("cp", cp), ("loss_chunk_size", loss_chunk_size)):
            if size < 1:
                raise ValueError(f"{name}={size} must be at least 1")
        self.optim_settings = optim or OptimSettings()
        optimizer_dtype = self.optim_settings.master_dtype(optimizer_dtype)
        self.compute_dtype, self.storage_dtype = dtype, optimizer_dtype
        self.objective: Objective = CrossEntropy(chunked=chunked_loss, chunk_size=loss_chunk_size)
        """The default objective (`actor.chunked_loss`, `actor.loss_chunk_size`)."""
        self.loss_chunk_size = loss_chunk_size
        self.offload_params = offload_params
        self.device = device or default_device()
        if offload_params and not dist.is_initialized():
            start_single_process_group()
        self.distributed = dist.is_initialized()
        if not self.distributed and dp * tp * cp > 1:
            raise ValueError(
                f"actor.backend=fsdp:d{dp}t{tp}c{cp} needs {dp * tp * cp} processes; launch with "
                f"torchrun --nproc_per_node {dp * tp * cp} (no process group was started)"
            )
        self.dp, self.tp, self.cp = dp, tp, cp
        self.mesh = build_device_mesh(dp, tp, cp, self.device.type) if self.distributed else None
        self._setup_model(model, gradient_checkpointing, memory_efficient_load, full_state_dict)
        autocast = not self.distributed and self.storage_dtype != self.compute_dtype != torch.float32
        self.root = ObjectiveRoot(
            self.model, tp_group=self._group("tp"), head_dtype=self.compute_dtype if autocast else None
        )
        self._shard(memory_efficient_load)
        self._build_optimizer(per_layer_optim_step, optim_step_prefetch_layers)
        self._version = 0
        self._offload = StorageOffload(self.device)
        self._offloaded = False

    # ----------------------------------------------------------------- set-up

    def _group(self, axis: str) -> dist.ProcessGroup | None:
        if self.mesh is None or self.mesh.size(axis) == 1:
            return None
        return self.mesh.group(axis)

    def _setup_model(self, model, gradient_checkpointing, memory_efficient_load, full_state_dict) -> None:
        from laden.model.attention import LADEN_VARLEN, LADEN_VARLEN_KERNEL, set_attention

        self._full_state_dict: dict[str, torch.Tensor] | None = None
        if memory_efficient_load and not self.distributed:
            log.warning(
                "actor.fsdp.memory_efficient_load is ignored in a single process (nothing to broadcast)"
            )
        if memory_efficient_load and self.distributed:
            if dist.get_rank() == 0 and full_state_dict is None:
                full_state_dict = {k: v.detach() for k, v in model.state_dict().items()}
            self._full_state_dict = full_state_dict if dist.get_rank() == 0 else None
            load.release_params_to_meta(model)
        elif full_state_dict is not None:
            raise ValueError("full_state_dict is only used with memory_efficient_load=True under torchrun")
        if self.tp > 1 and adapted_modules(model):
            raise ValueError(
                f"a LoRA model (actor.use_lora) cannot train with tensor parallelism (t={self.tp}): its plans "
                "shard plain nn.Linear projections; use t=1"
            )
        cast_params_(model, self.storage_dtype, frozen_dtype=self.compute_dtype)
        if self.cp > 1:
            check_head_rule(model, self.cp, axis_name="context parallel")
            assert self.mesh is not None  # cp > 1 needs a process group (checked in __init__)
            enable_ulysses(model, self.mesh.group("cp"))
        elif getattr(model.config, "_attn_implementation", None) not in (
            LADEN_VARLEN,
            LADEN_VARLEN_KERNEL,
            "sdpa",
            "eager",
        ):
            set_attention(model, "auto")
        self.recomputes = gradient_checkpointing
        if gradient_checkpointing:
            enable_gradient_checkpointing(model)  # FSDP2 re-gathers the weights in the recompute
        model.train()
        if self.tp > 1:
            assert self.mesh is not None
            apply_tensor_parallel(model, self.mesh.axis("tp"))
        self.model = model

    def enable_recompute(self) -> bool:
        """Per-decoder-layer activation recompute from the next forward on (an out-of-memory retry under
        `oom_policy: auto`); False when it is on already. The gradients are the same, the step slower."""
        if self.recomputes:
            return False
        enable_gradient_checkpointing(self.model)
        self.recomputes = True
        return True

    def _shard(self, memory_efficient_load: bool) -> None:
        if self.mesh is None:
            self.root.to(self.device)
            return
        buffers = load.real_buffers(self.model)
        apply_fsdp(
            self.root,
            decoder_layers(self.model),
            self.mesh.shard,
            param_dtype=self.compute_dtype,
            storage_dtype=self.storage_dtype,
            offload_params=self.offload_params,
            pin_memory=self.device.type == "cuda",
        )
        if memory_efficient_load:
            param_device = torch.device("cpu") if self.offload_params else self.device
            load.materialize_and_broadcast(
                self.model, self._full_state_dict, buffers, param_device, self.device
            )
            self._full_state_dict = None  # rank 0's host copy is released here

    def _build_optimizer(self, per_layer_optim_step: bool, prefetch_layers: int) -> None:
        o = self.optim_settings
        groups = param_groups_with_decay(list(self.model.named_parameters()), o.weight_decay)
        if per_layer_optim_step and o.type == "sgd":
            log.warning("actor.fsdp.per_layer_optim_step is ignored with actor.optimizer.type=sgd")
            per_layer_optim_step = False
        kahan = o.type == "adam_bf16"
        sharded = None
        if o.type != "sgd" and (per_layer_optim_step or self.offload_params or (kahan and self.distributed)):
            # Host states (offload / per-layer), or the Kahan update on device-resident local shards
            # (its foreach kernels need plain tensors, not DTensors).
            sharded = ShardedStep(
                device=self.device,
                layer_groups=self._layer_param_groups(),
                streamed=per_layer_optim_step or not self.offload_params,
                states_on_host=per_layer_optim_step or self.offload_params,
                prefetch_layers=prefetch_layers,
            )
        self.optimizer = build_optimizer(groups, o, sharded=sharded)
        if sharded is not None and not hasattr(self.optimizer, "fqn_state_dict"):
            # build_optimizer keeps plain bf16 AdamW for `adam` on bf16 masters, as asked.
            log.warning(
                "actor.fsdp.per_layer_optim_step / offload_params: the host-state AdamW is not used with "
                "actor.optimizer.type=adam on %s master weights (states stay where the parameters are); "
                "set actor.optimizer.type=adam_bf16 or actor.optimizer_dtype=float32",
                self.storage_dtype,
            )
        self.scheduler = o.build_scheduler(self.optimizer)

    def _layer_param_groups(self) -> list[list[nn.Parameter]]:
        """Parameters in streaming order: one list per decoder layer, then the rest."""
        layers = decoder_layers(self.model)
        seen: set[int] = set()
        out = []
        for layer in layers:
            params = [p for p in layer.parameters() if p.requires_grad]
            seen.update(id(p) for p in params)
            out.append(params)
        rest = [p for p in self.model.parameters() if p.requires_grad and id(p) not in seen]
        return out + ([rest] if rest else [])

    # ------------------------------------------------------------- properties

    @property
    def version(self) -> int:
        """Optimizer steps applied so far (restored with a checkpoint)."""
        return self._version

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: which share of the global batch it trains on."""
        return 0 if self.mesh is None else self.mesh.local_rank("dp")

    @property
    def dp_size(self) -> int:
        return self.dp

    @property
    def num_params(self) -> int:
        """Parameters of the full (unsharded) model."""
        return sum(p.numel() for p in self.model.parameters())

    # ----------------------------------------------------------------- batches

    def _autocast(self) -> AbstractContextManager:
        if self.distributed:  # FSDP's MixedPrecisionPolicy casts the gathered weights
            return contextlib.nullcontext()
        return autocast_context(self.device, self.storage_dtype, self.compute_dtype)

    def _padded(self, micro_batches: Sequence[PackedBatch]) -> list[PackedBatch | None]:
        """The micro-batches plus padding ones (`None`), so every rank runs the same count."""
        mbs: list[PackedBatch | None] = list(micro_batches)
        if not self.distributed:
            if not mbs:
                raise ValueError("the engine got no micro-batches; pass at least one PackedBatch")
            return mbs
        count = torch.tensor([len(mbs)], dtype=torch.int64, device=self._collective_device())
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        target = int(count.item())  # deliberate host sync: the loop length must be known on the host
        return mbs + [None] * (target - len(mbs))

    def _collective_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _local_batch(self, mb: PackedBatch | None) -> PackedBatch:
        """This rank's part of `mb` on the device (its context slice under cp); `None`: padding."""
        batch = padding_batch() if mb is None else mb
        batch = batch.to(self.device, non_blocking=True)
        if self.mesh is not None and self.cp > 1:
            batch = shard_batch(batch, cp_rank=self.mesh.local_rank("cp"), cp_size=self.cp)
        if mb is None:  # an objective reading a field gets zeros (no loss token reads them anyway)
            batch = replace(batch, fields=ZeroFields(batch.labels))
        return batch

    def _check_onloaded(self, what: str) -> None:
        if self._offloaded:
            raise OffloadedError(f"FSDPEngine.{what}")

    def _reshard(self) -> None:
        """Free FSDP's gathered weights: the root keeps them after a forward without backward, and
        while gathered its modules hold the unsharded parameters, not the optimizer's."""
        for module in self.root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    # ------------------------------------------------------------------ steps

    def forward_backward(
        self, micro_batches: Sequence[PackedBatch], objective: Objective, *, normalizer: float
    ) -> torch.Tensor:
        """Fresh gradients of `sum(objective(mb)) / normalizer` (the global value is returned, all-reduced,
        on the device)."""
        self._check_onloaded("forward_backward")
        self.root.train()
        self.optimizer.zero_grad(set_to_none=True)
        return self._run(micro_batches, objective, normalizer, backward=True)

    def _run(
        self, micro_batches: Sequence[PackedBatch], objective: Objective, normalizer: float, *, backward: bool
    ) -> torch.Tensor:
        if not normalizer > 0:
            raise ValueError(f"normalizer={normalizer} must be positive (e.g. the global loss-token count)")
        scale = self.dp * self.cp / float(normalizer)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for mb in self._padded(micro_batches):
            batch = self._local_batch(mb)
            with self._autocast():
                loss_sum = self.root(batch, objective).float()
            if backward:
                (loss_sum * scale).backward()
            total = total + loss_sum.detach()
        total = total / float(normalizer)
        group = self._group(SHARD_AXIS)
        if group is not None:
            dist.all_reduce(total, group=group)
        return total

    def optimizer_step(self) -> dict[str, torch.Tensor]:
        """Clip the global gradient norm, step the optimizer and the LR schedule; `version` += 1."""
        self._check_onloaded("optimizer_step")
        grad_norm = clip_grad_norm_(list(self.model.parameters()), self.optim_settings.gradient_clipping)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self._version += 1
        return {"grad_norm": grad_norm, "lr": torch.tensor(lr)}

    def _eval_loss(
        self, micro_batches: Sequence[PackedBatch], objective: Objective, normalizer: float
    ) -> torch.Tensor:
        self._check_onloaded("eval_batch")
        self.root.eval()
        try:
            return self._run(micro_batches, objective, normalizer, backward=False)
        finally:
            self.root.train()
            self._reshard()

    @torch.no_grad()
    def forward(
        self,
        micro_batches: Sequence[PackedBatch],
        *,
        outputs: Sequence[ForwardOutput] = FORWARD_OUTPUTS,
        temperature: float = 1.0,
    ) -> list[dict[str, torch.Tensor]]:
        """Per micro-batch, each requested output as a `[T]` fp32 host tensor, without gradients.

        Chunked like the loss (`loss_chunk_size` tokens at a time, never `[T, V]` logits). Under
        context parallel each rank computes its slice and the slices are all-gathered over the
        context group, so every rank returns whole rows. One host copy (a sync) per micro-batch.
        """
        self._check_onloaded("forward")
        if not temperature > 0:
            raise ValueError(f"temperature={temperature} must be positive")
        fn = TokenOutputs(outputs=tuple(outputs), temperature=temperature, chunk_size=self.loss_chunk_size)
        results = []
        self.root.eval()
        try:
            for mb in self._padded(micro_batches):
                with self._autocast():
                    values = self.root(self._local_batch(mb), fn)
                if mb is not None:
                    results.append(
                        {k: self._whole_row(v, mb.num_tokens).float().cpu() for k, v in values.items()}
                    )
        finally:
            self.root.train()
            self._reshard()
        return results

    def _whole_row(self, values: torch.Tensor, num_tokens: int) -> torch.Tensor:
        group = self._group("cp")
        return values if group is None else gather_row(values, group, num_tokens)

    # ----------------------------------------------------------------- weights

    def named_weights(
        self,
        dtype: torch.dtype | None = None,
        *,
        device: torch.device | str | None = None,
        trained_only: bool = False,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's Hugging Face state one full tensor at a time (`hf_state_names` order); a LoRA
        model's merged (`laden.model.lora.merged_weights`; `trained_only`: its adapted projections alone).

        DTensors are gathered with `full_tensor()` (an all-gather every rank joins: all ranks must
        iterate to the end), then cast to `dtype` (default: the compute dtype) and moved to
        `device` (default: where the engine keeps the weights). The previous tensor is dropped
        before the next is gathered, so beyond the model at most one full tensor is held (plus
        whatever the caller keeps). In one process an fp32 weight asked for in fp32 is the live
        parameter itself (detached), not a copy: copy it to keep or modify it.
        """
        self._check_onloaded("named_weights")
        self._reshard()
        return self._iter_weights(dtype or self.compute_dtype, device, trained_only)

    def _iter_weights(
        self, dtype: torch.dtype, device: torch.device | str | None, trained_only: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        from laden.model.hf.export import hf_state_names

        state = self.model.state_dict()

        def fetch(name: str, dt: torch.dtype, dev: torch.device | str | None) -> torch.Tensor:
            with torch.no_grad():  # not across the yield: the caller's grad mode is its own
                return _full_tensor(state[name], dt, dev)

        names = hf_state_names(self.model)
        for name, out in merged_weights(self.model, names, fetch, dtype, device, trained_only=trained_only):
            yield name, out
            del out  # before the next gather

    # ----------------------------------------------------------------- offload

    def offload(self) -> None:
        """Copy parameters (local shards), gradients and optimizer states to host buffers and release
        their device storage (`laden.engine.parallel.offload`). Idempotent."""
        if self._offloaded:
            return
        self._reshard()
        self._offload.offload(state_tensors(self.model.parameters(), self.optimizer))
        self._offloaded = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Restore what `offload` released, bitwise. Idempotent."""
        self._offload.onload()
        self._offloaded = False

    # ------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The shared checkpoint layout (`laden.engine.fsdp.checkpoint`): live tensors, DTensors under FSDP."""
        self._check_onloaded("state_dict")
        self._reshard()
        return engine_state(self.model, self.optimizer, self.scheduler, self._version)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load the shared layout (DTensors, or plain full tensors), in place where it already is."""
        self._check_onloaded("load_state_dict")
        self._reshard()
        self._version = load_engine_state(self.model, self.optimizer, self.scheduler, state)


def _full_tensor(t: torch.Tensor, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    full = t.full_tensor() if isinstance(t, DTensor) else t.detach()  # a collective for DTensors
    cast = dtype if full.is_floating_point() else full.dtype
    return full.to(device=device or full.device, dtype=cast)  # one copy at most: cast and move together
