"""Plain PyTorch, as BENCHMARKS.md defines it: stock Hugging Face transformers, no laden code.

`train_throughput.py --system hf` runs this. The model is the Hugging Face class as built from
its config (SDPA attention, Hugging Face's own modules and loss), fp32 master weights with
bf16 autocast, `torch.optim.AdamW(fused=True)`, and Hugging Face's gradient checkpointing when
asked (`gradient_checkpointing_enable`, `activation_checkpointing_enable` from transformers 5.2x,
non-reentrant: every decoder layer recomputed).

Trade-off: rows are not packed. Each micro-batch is `[rows, seq_len]` token ids with the
causal mask SDPA applies itself (no attention mask, no position ids: the flash kernel), which is
how stock transformers trains fixed-length sequences; packing several sequences into one row
would need laden's varlen attention or a dense block mask. The work is the same as the packed
runs': the same tokens per step, attention within each `seq_len`-token sequence. The loss is
Hugging Face's (full `[tokens, vocab]` logits, upcast to fp32), each micro-batch's mean
weighted by its share of the step's loss tokens, so the gradient is the token mean over the step.

Imports torch, transformers and the standard library only; `train_throughput.py` checks
that no `laden` module was loaded by the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class Rows:
    """One micro-batch: `[rows, seq_len]` token ids; the labels are the inputs (the model shifts them)."""

    input_ids: torch.Tensor
    """Token ids, `[rows, seq_len]`."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_loss_tokens(self) -> int:
        rows, seq_len = self.input_ids.shape
        return rows * (seq_len - 1)

    def to(self, device: torch.device) -> Rows:
        return Rows(self.input_ids.to(device))


def make_steps(
    *, vocab_size: int, seq_len: int, num_seqs: int, num_microbatch: int, num_steps: int, seed: int
) -> list[list[Rows]]:
    """Random token ids: `num_seqs` rows per step, split into `num_microbatch` equal micro-batches."""
    if num_seqs % num_microbatch:
        raise ValueError(
            f"--num-seqs={num_seqs} is not a multiple of --num-microbatch={num_microbatch}: "
            "unpacked rows split evenly; pick a divisor"
        )
    gen = torch.Generator().manual_seed(seed)
    per_mb = num_seqs // num_microbatch
    return [
        [Rows(torch.randint(0, vocab_size, (per_mb, seq_len), generator=gen)) for _ in range(num_microbatch)]
        for _ in range(num_steps)
    ]


def build_model(config: Any, *, device: torch.device, seed: int) -> nn.Module:
    """The stock causal LM in fp32 (the master weights), random init on `device`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config.use_cache = False
    where = torch.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with where:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.to(device).train()


def enable_checkpointing(model: nn.Module) -> None:
    """Hugging Face's own per-decoder-layer checkpointing, non-reentrant (renamed in transformers 5.2x)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class PlainHF:
    """One optimizer step of stock Hugging Face training (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        device: torch.device,
        compute_dtype: torch.dtype,
        lr: float,
        weight_decay: float,
        clip: float,
        gradient_checkpointing: bool,
    ) -> None:
        self.model, self.device, self.compute_dtype, self.clip = model, device, compute_dtype, clip
        if gradient_checkpointing:
            enable_checkpointing(model)
        params = [p for p in model.parameters() if p.requires_grad]
        self.params = params
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def train_batch(
        self, micro_batches: Sequence[Rows], *, global_num_loss_tokens: int
    ) -> dict[str, torch.Tensor]:
        """Forward and backward every micro-batch, clip (if `clip`), step; metrics stay on the device."""
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for mb in micro_batches:
            with self._autocast():
                out = self.model(input_ids=mb.input_ids, labels=mb.input_ids)
            loss = out.loss.float() * (mb.num_loss_tokens / global_num_loss_tokens)
            loss.backward()
            total += loss.detach()
        metrics = {"loss": total}
        if self.clip > 0:
            metrics["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        return metrics
