"""The train-engine seam: what every training backend (`actor.backend`) does, and what it is given.

Every engine (`fsdp` in one process or under torchrun, `roundpipe`) implements `TrainEngine`,
so the SFT trainer, the RL trainer, the checkpointer and the weight updates of a rollout
engine are written once against this protocol.

One optimizer step is `forward_backward(micro_batches, objective, normalizer=...)` over all
micro-batches this data-parallel rank trains on, then `optimizer_step()`. The objective is a
callable on the final hidden states, the output-projection weight and the micro-batch (its
labels and per-token `fields`: loss weights, advantages, old and reference log-probs), and
it returns the micro-batch's *summed* loss (`Objective`). The engine never sees logits: an
objective applies the head in token chunks (`laden.model.objective`), so `[T, V]` logits never
exist. The engine divides each micro-batch's sum by `normalizer`, the same number on every
rank (for SFT the loss tokens of the whole global batch), which makes the result the mean
over the global batch however it is split across micro-batches, ranks or calls
(micro-batched == one batch, d2 == d1). SFT cross-entropy is one objective; the PPO-family
objectives of `laden.rl` are others.

`forward` runs the model without gradients and returns per-token tensors (log-probs of the
labels, entropies; a value model's values) for each micro-batch: what RL needs for its old and
reference log-probs and its critic's values.
`named_weights` yields the model one Hugging Face tensor at a time, gathered from shards or
read from a host store, so neither an export nor a weight update ever holds a second copy of
the model. `offload()` / `onload()` release and restore the accelerator memory an engine
holds between uses, so a colocated rollout engine can have it while generation runs.
`version` counts the optimizer steps applied (what a weight update is tagged with).

Checkpoint state (`state_dict` / `load_state_dict`) has one layout for every engine, keyed by
Hugging Face parameter names, so a run resumes under another engine or data-parallel size:
`{"model": {name: master weight of each trainable parameter}, "optimizer": laden.optim.named_state(...), "scheduler":
LambdaLR state, "version": int}`. Sharded engines return DTensors (a distributed checkpoint
reshards them); the tensors are the live ones where possible, so loading writes in place.

Metrics come back as tensors, not floats, so an engine never forces a host sync; the
trainer syncs once per logged step.

`train_batch`, `eval_batch` and `export_hf` are written once over these primitives
(`TrainEngineBase`); an engine gives its gradient-free loss (`_eval_loss`) and says who writes
an export and whether reading the weights is a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from laden.data.batch import PackedBatch

ForwardOutput = Literal["logprobs", "entropy", "values"]
FORWARD_OUTPUTS: tuple[ForwardOutput, ...] = ("logprobs", "entropy")
"""What `forward` returns unless asked: a language model's outputs."""
KNOWN_FORWARD_OUTPUTS: tuple[ForwardOutput, ...] = ("logprobs", "entropy", "values")
"""Everything `forward` can return; `values` is a value model's (`laden.model.value_head`)."""
ExportConvert = Callable[
    [Any, Iterator[tuple[str, torch.Tensor]], Any], tuple[Any, Iterator[tuple[str, torch.Tensor]]]
]
"""`convert(model config, named weights, tokenizer) -> (model, named weights)`: an export written as another
model (`TrainEngine.export_hf`'s `convert`; `laden.align.reward_model.as_classifier`)."""


class Objective(Protocol):
    """A micro-batch's summed loss from the final hidden states, without `[T, V]` logits.

    hidden: `[T, H]` final (normed) hidden states of the packed row, compute dtype.
    head_weight: `[V, H]` output projection (the embedding itself when tied).
    batch: the micro-batch on the device: `labels [T]` (next-token targets, -100 where no
        loss) and `fields` (per-token tensors laid out like the labels).
    Returns a 0-dim fp32 tensor: the *sum* over the micro-batch's tokens (the engine divides by
    the step's normalizer). It must be differentiable wrt `hidden` and `head_weight`.
    """

    def __call__(
        self, hidden: torch.Tensor, head_weight: torch.Tensor, batch: PackedBatch
    ) -> torch.Tensor: ...


@runtime_checkable
class TrainEngine(Protocol):
    """One optimizer step at a time over packed micro-batches (see the module docstring)."""

    def forward_backward(
        self, micro_batches: Sequence[PackedBatch], objective: Objective, *, normalizer: float
    ) -> torch.Tensor:
        """Fresh gradients of `sum(objective(mb) for mb in micro_batches) / normalizer`.

        Every data-parallel rank passes its own micro-batches and the same `normalizer`.
        Returns the global value (summed over the ranks), a 0-dim tensor, without a host sync.
        Call `optimizer_step` next: with gradient clipping off an engine may start updating
        parameters whose gradients are complete before this call returns.
        """
        ...

    def optimizer_step(self) -> dict[str, torch.Tensor]:
        """Clip the global gradient norm, step the optimizer and the LR schedule; `version` += 1.

        Returns at least `grad_norm` (before clipping) and `lr` (of this step).
        """
        ...

    def train_batch(
        self,
        micro_batches: Sequence[PackedBatch],
        *,
        global_num_loss_tokens: int,
        objective: Objective | None = None,
    ) -> dict[str, torch.Tensor]:
        """`forward_backward` with `normalizer=global_num_loss_tokens` (default objective: the
        configured cross-entropy), then `optimizer_step`; returns `loss`, `grad_norm` and `lr`."""
        ...

    def eval_batch(
        self,
        micro_batches: Sequence[PackedBatch],
        *,
        global_num_loss_tokens: int,
        objective: Objective | None = None,
    ) -> dict[str, torch.Tensor]:
        """The objective's global mean without gradients: `{"loss": ...}`."""
        ...

    def forward(
        self,
        micro_batches: Sequence[PackedBatch],
        *,
        outputs: Sequence[ForwardOutput] = FORWARD_OUTPUTS,
        temperature: float = 1.0,
    ) -> list[dict[str, torch.Tensor]]:
        """Per micro-batch, each requested output as a `[T]` fp32 host tensor, without gradients.

        `logprobs[j]`: log-probability of `labels[j]` under `softmax(logits[j] / temperature)`
        (0 where the label is -100); `entropy[j]`: entropy of that distribution. `values[j]`: a
        value model's output at token j (every token, whatever its label; needs a one-row head).
        """
        ...

    def named_weights(
        self,
        dtype: torch.dtype | None = None,
        *,
        device: torch.device | str | None = None,
        trained_only: bool = False,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's Hugging Face state, `(name, tensor)` one full tensor at a time.

        Tied weights appear once (under the name a Hugging Face loader reads). `dtype`: default
        the compute dtype; `device`: where the tensor is handed out (default: where the engine
        has it, the host for host-resident engines). Sharded engines gather collectively:
        every rank must iterate to the end. A tensor handed out may be reused for the next one:
        copy it to keep it. A LoRA model (`actor.use_lora`) is handed out merged, under the base
        model's names (`laden.model.lora`); `trained_only`: only the tensors training changes (its
        adapted projections; every tensor of a model trained whole), what a weight update sends.
        """
        ...

    def enable_recompute(self) -> bool:
        """Per-decoder-layer activation recompute from the next step on (the last out-of-memory retry under
        `oom_policy: auto`); False when there is nothing to switch on (it is on already, or the engine
        recomputes by design). The gradients are the same, the step slower."""
        ...

    def offload(self) -> None:
        """Release the accelerator memory the engine holds between steps (weights, gradients,
        optimizer states move to host memory); `onload` restores them. Idempotent."""
        ...

    def onload(self) -> None:
        """Bring back what `offload` released; training after it equals never offloading."""
        ...

    @property
    def version(self) -> int:
        """Optimizer steps applied so far (restored with a checkpoint)."""
        ...

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel index: which share of a global batch it trains on."""
        ...

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas; 1 for a single replica."""
        ...

    @property
    def num_params(self) -> int:
        """Parameters of the full (unsharded) model."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint state in the shared layout (see the module docstring)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def export_hf(
        self, out_dir: Path, *, tokenizer: Any | None = None, convert: ExportConvert | None = None
    ) -> None:
        """Write a Hugging Face model directory (safetensors in the compute dtype), atomically,
        from `named_weights` (every rank calls it; one writes); `convert` writes it as another model."""
        ...


class OffloadedError(RuntimeError):
    """A step was asked of an engine whose state is offloaded."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} called while the engine is offloaded; call engine.onload() first")


class TrainEngineBase:
    """`train_batch`, `eval_batch` and `export_hf` over an engine's primitives, the same for every engine.

    An engine sets `model`, `compute_dtype` and `objective` (the configured default), implements the
    `TrainEngine` primitives and `_eval_loss`, and may change who writes an export (`_writes_export`)
    and whether every rank reads the weights for it (`collective_export`).
    """

    collective_export: ClassVar[bool] = True
    """Every rank iterates `named_weights` for an export (its gathers are collectives) and waits at a
    barrier until it is on disk; False: only the writer reads the weights and nobody waits."""

    model: Any
    compute_dtype: torch.dtype
    objective: Objective

    if TYPE_CHECKING:

        def forward_backward(
            self, micro_batches: Sequence[PackedBatch], objective: Objective, *, normalizer: float
        ) -> torch.Tensor: ...

        def optimizer_step(self) -> dict[str, torch.Tensor]: ...

        def named_weights(
            self,
            dtype: torch.dtype | None = None,
            *,
            device: torch.device | str | None = None,
            trained_only: bool = False,
        ) -> Iterator[tuple[str, torch.Tensor]]: ...

        def state_dict(self) -> dict[str, Any]: ...

    def _eval_loss(
        self, micro_batches: Sequence[PackedBatch], objective: Objective, normalizer: float
    ) -> torch.Tensor:
        """`sum(objective(mb)) / normalizer` over the global batch, without gradients (every rank calls it)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _eval_loss")

    def _writes_export(self) -> bool:
        """Whether this process writes the export: rank 0 of the process group (or the only process)."""
        return not dist.is_initialized() or dist.get_rank() == 0

    def train_batch(
        self,
        micro_batches: Sequence[PackedBatch],
        *,
        global_num_loss_tokens: int,
        objective: Objective | None = None,
    ) -> dict[str, torch.Tensor]:
        """`forward_backward` over the step's loss-token count (default objective: the configured
        cross-entropy), then `optimizer_step`; returns `loss`, `grad_norm` and `lr`."""
        normalizer = float(max(global_num_loss_tokens, 1))
        loss = self.forward_backward(
            micro_batches, self.objective if objective is None else objective, normalizer=normalizer
        )
        return {"loss": loss, **self.optimizer_step()}

    @torch.no_grad()
    def eval_batch(
        self,
        micro_batches: Sequence[PackedBatch],
        *,
        global_num_loss_tokens: int,
        objective: Objective | None = None,
    ) -> dict[str, torch.Tensor]:
        """The objective's global mean without gradients (dropout off): `{"loss": ...}`."""
        normalizer = float(max(global_num_loss_tokens, 1))
        return {
            "loss": self._eval_loss(
                micro_batches, self.objective if objective is None else objective, normalizer
            )
        }

    def export_hf(
        self, out_dir: Path, *, tokenizer: Any | None = None, convert: ExportConvert | None = None
    ) -> None:
        """A Hugging Face directory in the compute dtype from `named_weights`, written atomically by one
        process; a LoRA model merged, with its adapters in `adapter/` (`laden.model.hf.export.export_hf`).
        `convert(config, weights, tokenizer) -> (model, weights)` writes it as another model (what
        `export_hf` reads of `model` is its config: `laden dpo`'s reward model as a sequence classifier)."""
        from laden.model.hf.export import export_hf
        from laden.model.lora import adapted_modules, peft_adapter_state

        write = self._writes_export()
        reads = write or self.collective_export
        weights = self.named_weights(self.compute_dtype) if reads else iter(())
        adapter = (
            peft_adapter_state(self.state_dict()["model"]) if reads and adapted_modules(self.model) else None
        )
        model = self.model
        if convert is not None:
            model, weights = convert(self.model.config, weights, tokenizer)
        export_hf(
            model, out_dir, dtype=self.compute_dtype, tokenizer=tokenizer, weights=weights, write=write,
            adapter=adapter,
        )  # fmt: skip
        if self.collective_export and dist.is_initialized():
            dist.barrier()  # the export is complete on disk when any rank returns
