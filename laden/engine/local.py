"""Single-device train engine: the model resident on one device, no sharding.

This is what `actor.backend: fsdp:d1` runs when laden is not launched under a
distributed launcher. It owns the micro-batch loop that every engine shares
(`accumulate_microbatches`): each micro-batch's *summed* token loss is divided by the
global number of loss tokens before `backward`, so gradients are the token mean over the
whole optimizer step however the step is split.

Precision: parameters (the "master" copy) are stored in `optimizer_dtype`; compute runs in
`dtype`. With fp32 masters and a bf16/fp16 compute dtype the forward runs under autocast
(weights are cast per matmul: the price of keeping a single fp32 copy). With bf16 masters
(`adam_bf16`) parameters are already in the compute dtype and no autocast is needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from laden.data.batch import PackedBatch
from laden.model.attention import packed_causal_lm_loss
from laden.model.loss import DEFAULT_LOSS_CHUNK_SIZE
from laden.optim import OptimSettings, build_optimizer, clip_grad_norm_, param_groups_with_decay

LossFn = Callable[[nn.Module, PackedBatch], torch.Tensor]


def default_device() -> torch.device:
    """The current CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def packed_loss_fn(*, chunked: bool, chunk_size: int) -> LossFn:
    """The SFT loss: summed next-token cross-entropy of a packed micro-batch."""

    def loss_fn(model: nn.Module, mb: PackedBatch) -> torch.Tensor:
        return packed_causal_lm_loss(
            model,
            mb.input_ids,
            mb.position_ids,
            mb.labels,
            mb.cu_seqlens,
            mb.max_seqlen,
            chunked=chunked,
            chunk_size=chunk_size,
        )

    return loss_fn


def autocast_context(device: torch.device, param_dtype: torch.dtype, compute_dtype: torch.dtype):
    """Autocast only when the stored parameters are wider than the compute dtype."""
    if param_dtype == compute_dtype or compute_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute_dtype)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Per-decoder-layer activation recompute (non-reentrant), across transformers 5.x names."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def accumulate_microbatches(
    model: nn.Module,
    micro_batches: Sequence[PackedBatch],
    *,
    global_num_loss_tokens: int,
    loss_fn: LossFn,
    autocast: Callable[[], Any],
    backward: bool = True,
) -> torch.Tensor:
    """Run every micro-batch, backprop `loss_sum / global_num_loss_tokens`; return the mean loss.

    The returned tensor stays on the device (no host sync).
    """
    denom = float(max(global_num_loss_tokens, 1))
    total: torch.Tensor | None = None
    for mb in micro_batches:
        with autocast():
            loss_sum = loss_fn(model, mb)
        scaled = loss_sum.float() / denom
        if backward:
            scaled.backward()
        total = scaled.detach() if total is None else total + scaled.detach()
    assert total is not None, "at least one micro-batch per step"
    return total


class LocalEngine:
    """The whole model on one device; see the module docstring for the precision policy."""

    def __init__(
        self,
        model: nn.Module,
        *,
        device: torch.device,
        dtype: torch.dtype,
        optimizer_dtype: torch.dtype,
        optim: OptimSettings,
        gradient_checkpointing: bool = False,
        loss_fn: LossFn | None = None,
    ) -> None:
        self.device = device
        self.compute_dtype = dtype
        if optim.type == "adam_bf16":
            optimizer_dtype = torch.bfloat16
        self.param_dtype = optimizer_dtype
        self.model = model.to(device=device, dtype=optimizer_dtype)
        if gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        self.model.train()
        self.loss_fn = loss_fn or packed_loss_fn(chunked=True, chunk_size=DEFAULT_LOSS_CHUNK_SIZE)
        self.optim_settings = optim
        groups = param_groups_with_decay(list(self.model.named_parameters()), optim.weight_decay)
        self.optimizer = build_optimizer(groups, optim)
        self.scheduler = optim.build_scheduler(self.optimizer)

    def _autocast(self):
        return autocast_context(self.device, self.param_dtype, self.compute_dtype)

    def train_batch(
        self, micro_batches: Sequence[PackedBatch], *, global_num_loss_tokens: int
    ) -> dict[str, torch.Tensor]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = accumulate_microbatches(
            self.model,
            micro_batches,
            global_num_loss_tokens=global_num_loss_tokens,
            loss_fn=self.loss_fn,
            autocast=self._autocast,
        )
        grad_norm = clip_grad_norm_(list(self.model.parameters()), self.optim_settings.gradient_clipping)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        return {"loss": loss, "grad_norm": grad_norm, "lr": torch.tensor(lr)}

    @torch.no_grad()
    def eval_batch(
        self, micro_batches: Sequence[PackedBatch], *, global_num_loss_tokens: int
    ) -> dict[str, torch.Tensor]:
        self.model.eval()
        loss = accumulate_microbatches(
            self.model,
            micro_batches,
            global_num_loss_tokens=global_num_loss_tokens,
            loss_fn=self.loss_fn,
            autocast=self._autocast,
            backward=False,
        )
        self.model.train()
        return {"loss": loss}

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def export_hf(self, out_dir: Path, *, tokenizer: Any | None = None) -> None:
        from laden.model.hf.export import export_hf

        export_hf(self.model, out_dir, dtype=self.compute_dtype, tokenizer=tokenizer)

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())
