"""`FSDPEngine`: the `fsdp:dXtYcZ` train engine on PyTorch FSDP2 and `torch.distributed`.

Every rank runs the same program on its part of the data: data-parallel ranks get
different micro-batches, context-parallel ranks slices of the same rows, tensor-parallel
ranks the same rows. One optimizer step:

1. the ranks agree on the micro-batch count (all-reduce MAX: one host sync per step) and
   those with fewer run empty micro-batches (one ignored token per context rank), because
   FSDP's all-gathers and reduce-scatters must match across ranks;
2. each micro-batch's summed token loss is scaled by `shard_size / global_num_loss_tokens`:
   FSDP *averages* gradients over the `dp x cp` shard axis, so the factor turns that mean
   into the global token mean, and d2 == d1 on the same data;
3. the global gradient norm is clipped, then one of three optimizer steps runs:
   `torch.optim` on the sharded parameters (states where the parameters are), the host
   AdamW on the offloaded shards (`offload_params`), or the per-layer streamed step
   (`per_layer_optim_step`: host states, update on the device, layer by layer).

Without a process group (one plain process, `fsdp:d1`) the model is a plain module on the
device and the same code runs with autocast instead of FSDP's mixed-precision policy;
`offload_params` needs FSDP's offload policy and starts a single-process group for it.

`global_num_loss_tokens` is the loss-token count of the whole step over all data-parallel
ranks (every rank passes the same value), as the `TrainEngine` protocol says.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from laden.data.batch import PackedBatch
from laden.engine.fsdp import checkpoint as ckpt
from laden.engine.fsdp import load
from laden.engine.fsdp.launch import SHARD_AXIS, build_device_mesh
from laden.engine.fsdp.loss import PackedLossModule
from laden.engine.fsdp.parallelize import apply_fsdp, apply_tensor_parallel, check_head_rule, decoder_layers
from laden.engine.fsdp.ulysses import shard_packed_row
from laden.engine.local import autocast_context, default_device, enable_gradient_checkpointing
from laden.model.loss import DEFAULT_LOSS_CHUNK_SIZE
from laden.optim import OptimSettings, build_optimizer, clip_grad_norm_, param_groups_with_decay
from laden.optim.sharded_adam import ShardedAdamW

log = logging.getLogger("laden.fsdp")


class FSDPEngine:
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
        if self.optim_settings.type == "adam_bf16":
            optimizer_dtype = torch.bfloat16
        self.compute_dtype, self.storage_dtype = dtype, optimizer_dtype
        self.offload_params = offload_params
        self.device = device or default_device()
        if offload_params and not dist.is_initialized():
            _start_single_process_group()
        self.distributed = dist.is_initialized()
        if not self.distributed and dp * tp * cp > 1:
            raise ValueError(
                f"actor.backend=fsdp:d{dp}t{tp}c{cp} needs {dp * tp * cp} processes; launch with "
                f"torchrun --nproc_per_node {dp * tp * cp} (no process group was started)"
            )
        self.dp, self.tp, self.cp = dp, tp, cp
        self.mesh = build_device_mesh(dp, tp, cp, self.device.type) if self.distributed else None
        self._setup_model(model, gradient_checkpointing, memory_efficient_load, full_state_dict)
        self.root = PackedLossModule(
            self.model, chunked=chunked_loss, chunk_size=loss_chunk_size, tp_group=self._group("tp")
        )
        self._shard(memory_efficient_load)
        self._build_optimizer(per_layer_optim_step, optim_step_prefetch_layers)

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
        load.cast_params_(model, self.storage_dtype)
        if self.cp > 1:
            from laden.engine.fsdp.ulysses import enable_ulysses

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
        if gradient_checkpointing:
            enable_gradient_checkpointing(model)  # FSDP2 re-gathers the weights in the recompute
        model.train()
        if self.tp > 1:
            assert self.mesh is not None
            apply_tensor_parallel(model, self.mesh.axis("tp"))
        self.model = model

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
        named = list(self.model.named_parameters())
        groups = param_groups_with_decay(named, o.weight_decay)
        kahan = o.type == "adam_bf16"
        self.optimizer: torch.optim.Optimizer
        if per_layer_optim_step and o.type == "sgd":
            log.warning("actor.fsdp.per_layer_optim_step is ignored with actor.optimizer.type=sgd")
            per_layer_optim_step = False
        if o.type != "sgd" and (per_layer_optim_step or self.offload_params or (kahan and self.distributed)):
            # Host states (offload / per-layer), or the Kahan update on device-resident local shards.
            self.optimizer = ShardedAdamW(
                groups,
                lr=o.lr,
                betas=o.betas,
                eps=o.eps,
                weight_decay=o.weight_decay,
                kahan_bf16=kahan,
                streamed=per_layer_optim_step or not self.offload_params,
                states_on_host=per_layer_optim_step or self.offload_params,
                device=self.device,
                layer_groups=self._layer_param_groups(),
                prefetch_layers=prefetch_layers,
            )
        else:
            self.optimizer = build_optimizer(groups, o)
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

    # ------------------------------------------------------------------ steps

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: which share of the global batch it trains on."""
        return 0 if self.mesh is None else self.mesh.local_rank("dp")

    @property
    def dp_size(self) -> int:
        return self.dp

    def _autocast(self):
        if self.distributed:  # FSDP's MixedPrecisionPolicy casts the gathered weights
            return contextlib.nullcontext()
        return autocast_context(self.device, self.storage_dtype, self.compute_dtype)

    def _padded(self, micro_batches: Sequence[PackedBatch]) -> list[PackedBatch]:
        """The micro-batches plus empty ones, so every rank runs the same count."""
        mbs = list(micro_batches)
        if not self.distributed:
            if not mbs:
                raise ValueError("train_batch/eval_batch got no micro-batches")
            return mbs
        count = torch.tensor([len(mbs)], dtype=torch.int64, device=self._collective_device())
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        target = int(count.item())  # deliberate host sync: the loop length must be known on the host
        return mbs + [_empty_batch() for _ in range(target - len(mbs))]

    def _collective_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _micro_batch_loss(self, mb: PackedBatch) -> torch.Tensor:
        """This rank's summed token loss of `mb` (its context slice under cp)."""
        mb = mb.to(self.device, non_blocking=True)
        ids, pos, labels, cu, max_len = mb.input_ids, mb.position_ids, mb.labels, mb.cu_seqlens, mb.max_seqlen
        if self.mesh is not None and self.cp > 1:
            cp_rank = self.mesh.local_rank("cp")
            shard = shard_packed_row(ids, pos, labels, cu, max_len, cp_rank=cp_rank, cp_size=self.cp)
            ids, pos, labels, cu, max_len = (
                shard.input_ids,
                shard.position_ids,
                shard.labels,
                shard.cu_seqlens,
                shard.max_seqlen,
            )
        with self._autocast():
            return self.root(ids, pos, labels, cu, max_len).float()

    def _run(self, micro_batches, global_num_loss_tokens: int, *, backward: bool) -> torch.Tensor:
        mbs = self._padded(micro_batches)
        shard_size = self.dp * self.cp
        scale = shard_size / float(max(global_num_loss_tokens, 1))
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for mb in mbs:
            loss_sum = self._micro_batch_loss(mb)
            if backward:
                (loss_sum * scale).backward()
            total = total + loss_sum.detach()
        total = total / float(max(global_num_loss_tokens, 1))
        group = self._group(SHARD_AXIS)
        if group is not None:
            dist.all_reduce(total, group=group)
        return total

    def train_batch(
        self, micro_batches: Sequence[PackedBatch], *, global_num_loss_tokens: int
    ) -> dict[str, torch.Tensor]:
        """Forward/backward every micro-batch, clip, step the optimizer and the LR schedule."""
        loss = self.forward_backward(micro_batches, global_num_loss_tokens=global_num_loss_tokens)
        return {"loss": loss, **self.optimizer_step()}

    def forward_backward(
        self, micro_batches: Sequence[PackedBatch], *, global_num_loss_tokens: int
    ) -> torch.Tensor:
        """Fresh gradients of the step's token-mean loss (returned, all-reduced, on the device)."""
        self.root.train()
        self.optimizer.zero_grad(set_to_none=True)
        return self._run(micro_batches, global_num_loss_tokens, backward=True)

    def optimizer_step(self) -> dict[str, torch.Tensor]:
        """Clip the global gradient norm, step the optimizer and the LR schedule."""
        grad_norm = clip_grad_norm_(list(self.model.parameters()), self.optim_settings.gradient_clipping)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        return {"grad_norm": grad_norm, "lr": torch.tensor(lr)}

    @torch.no_grad()
    def eval_batch(
        self, micro_batches: Sequence[PackedBatch], *, global_num_loss_tokens: int
    ) -> dict[str, torch.Tensor]:
        """Token-mean loss without gradients (all ranks must call it together)."""
        self.root.eval()
        try:
            return {"loss": self._run(micro_batches, global_num_loss_tokens, backward=False)}
        finally:
            self.root.train()

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Sharded (DTensor) model and optimizer state plus the scheduler: save with `save_checkpoint`."""
        return {
            "model": ckpt.model_state_dict(self.model, distributed=self.distributed),
            "optimizer": ckpt.optimizer_state_dict(self.model, self.optimizer, distributed=self.distributed),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ckpt.load_model_state_dict(self.model, state["model"], distributed=self.distributed)
        ckpt.load_optimizer_state_dict(
            self.model, self.optimizer, state["optimizer"], distributed=self.distributed
        )
        self.scheduler.load_state_dict(state["scheduler"])

    def save_checkpoint(self, path: Path) -> None:
        """Write a resharding-capable distributed checkpoint (all ranks call it)."""
        ckpt.save_dcp(self.state_dict(), path)

    def load_checkpoint(self, path: Path) -> None:
        """Load a checkpoint written by `save_checkpoint` at any data-parallel size."""
        state = self.state_dict()
        ckpt.load_dcp(state, path)
        self.load_state_dict(state)

    def export_hf(self, out_dir: Path, *, tokenizer: Any | None = None) -> None:
        """Hugging Face directory in the compute dtype, gathered to rank 0 one tensor at a time."""
        ckpt.export_hf(self.model, Path(out_dir), dtype=self.compute_dtype, tokenizer=tokenizer)

    @property
    def num_params(self) -> int:
        """Parameters of the full (unsharded) model."""
        return sum(p.numel() for p in self.model.parameters())


def _empty_batch() -> PackedBatch:
    """One ignored token: runs forward/backward (matching collectives) and adds zero loss."""
    return PackedBatch(
        input_ids=torch.zeros(1, dtype=torch.long),
        position_ids=torch.zeros(1, dtype=torch.long),
        labels=torch.full((1,), -100, dtype=torch.long),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
        max_seqlen=1,
        num_loss_tokens=0,
        seqlens=[1],
    )


def _start_single_process_group() -> None:
    """A world of one on a private in-memory store, so FSDP's offload policy can run in one process."""
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
