"""Plain PyTorch references for the `TrainEngine` protocol tests of every engine.

Everything here is written against a Hugging Face model and `torch` alone (no laden engine),
so each engine's `forward`, `forward_backward` with a custom objective and `named_weights`
are compared with what the textbook computation gives:

- `reference_token_outputs`: teacher-forced log-probs of the labels and entropies, one
  document at a time through the model's own forward and full logits;
- `WeightedTokenLoss`: a custom per-token objective (weighted negative log-likelihood, the
  weights in `batch.fields["loss_weights"]`), and `reference_weighted_grads`, its gradients
  through plain autograd on full logits;
- `packed_batches`: a few packed micro-batches with loss weights, fixed by a seed;
- `protocol_engine`: an engine of `actor.backend` built as the trainers build it, plain SGD in fp32.
"""

from __future__ import annotations

import random

import torch
from torch import nn

from laden.data.batch import IGNORE_INDEX, PackedBatch, pack_samples
from laden.model.loss import chunked_token_logprobs


def packed_batches(
    vocab_size: int, *, num_micro_batches: int = 2, docs_per_mb: int = 2, seed: int = 0
) -> list[PackedBatch]:
    """Micro-batches of random documents (lengths 3..9, some prompt tokens without loss) with
    per-token `loss_weights` in [0, 2)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_micro_batches):
        samples, weights = [], []
        for _ in range(docs_per_mb):
            n = rng.randint(3, 9)
            ids = [rng.randrange(4, vocab_size) for _ in range(n)]
            prompt = rng.randint(0, n - 2)
            samples.append((ids, [0] * prompt + [1] * (n - prompt)))
            weights.append([2 * rng.random() for _ in range(n)])
        out.append(pack_samples(samples, fields={"loss_weights": weights}))
    return out


def _documents(batch: PackedBatch):
    bounds = batch.cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        yield slice(start, end)


def reference_token_outputs(
    model: nn.Module, batch: PackedBatch, *, temperature: float = 1.0
) -> dict[str, torch.Tensor]:
    """Teacher-forced `logprobs` of the labels (0 where -100) and `entropy`, `[T]` fp32, per document."""
    logp = torch.zeros(batch.num_tokens)
    entropy = torch.zeros(batch.num_tokens)
    with torch.no_grad():
        for doc in _documents(batch):
            logits = model(input_ids=batch.input_ids[doc][None]).logits[0].float() / temperature  # [L, V]
            log_probs = torch.log_softmax(logits, dim=-1)
            labels = batch.labels[doc]
            valid = labels != IGNORE_INDEX
            picked = log_probs.gather(1, labels.clamp(min=0)[:, None])[:, 0]
            logp[doc] = torch.where(valid, picked, torch.zeros_like(picked))
            entropy[doc] = -(log_probs.exp() * log_probs).sum(-1)
    return {"logprobs": logp, "entropy": entropy}


class WeightedTokenLoss:
    """A custom objective: `sum_j w_j * -log p(label_j)`, `w = batch.fields["loss_weights"]`."""

    def __init__(self, chunk_size: int = 5) -> None:
        self.chunk_size = chunk_size  # small, so several chunks run on tiny batches

    def __call__(self, hidden: torch.Tensor, head_weight: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        logp = chunked_token_logprobs(
            hidden.reshape(-1, hidden.shape[-1]),
            head_weight,
            batch.labels.reshape(-1),
            chunk_size=self.chunk_size,
        )
        return -(logp * batch.fields["loss_weights"].reshape(-1)).sum()


def reference_weighted_loss(model: nn.Module, batches: list[PackedBatch], normalizer: float) -> torch.Tensor:
    """`WeightedTokenLoss` over all micro-batches / normalizer, through full logits, per document."""
    total = torch.zeros(())
    for batch in batches:
        w = batch.fields["loss_weights"]
        for doc in _documents(batch):
            logits = model(input_ids=batch.input_ids[doc][None]).logits[0].float()
            log_probs = torch.log_softmax(logits, dim=-1)
            labels = batch.labels[doc]
            valid = labels != IGNORE_INDEX
            picked = log_probs.gather(1, labels.clamp(min=0)[:, None])[:, 0]
            total = total - (torch.where(valid, picked, torch.zeros_like(picked)) * w[doc]).sum()
    return total / normalizer


def reference_weighted_grads(
    model: nn.Module, batches: list[PackedBatch], normalizer: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, {parameter name: gradient}) of `reference_weighted_loss` by plain autograd."""
    model.zero_grad(set_to_none=True)
    loss = reference_weighted_loss(model, batches, normalizer)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def sgd_step_reference(
    model: nn.Module, grads: dict[str, torch.Tensor], lr: float
) -> dict[str, torch.Tensor]:
    """The weights after one plain SGD step (no momentum, no weight decay): w - lr * grad."""
    return {n: (p.detach() - lr * grads[n]) for n, p in model.named_parameters()}


def protocol_engine(backend: str, model: nn.Module, *, lr: float, total_steps: int = 4):
    """The `TrainEngine` of `actor.backend=backend` on `model` (CPU, fp32, plain SGD at `lr`: no momentum,
    weight decay, clipping or warmup), built from the backend object as the trainers build it."""
    from laden.config import load_config
    from laden.engine.backend import resolve_backend

    cfg = load_config("laden/assets/sft_tiny.yaml", [
        f"actor.backend={backend}", "actor.dtype=float32", "actor.optimizer.type=sgd", f"actor.optimizer.lr={lr}",
        "actor.optimizer.weight_decay=0", "actor.optimizer.gradient_clipping=0",
        "actor.optimizer.lr_scheduler_type=constant", "actor.optimizer.warmup_steps_proportion=0",
        "actor.gradient_checkpointing=false",
    ], job="sft")  # fmt: skip
    return resolve_backend(cfg).build(cfg, model, total_steps=total_steps, device=torch.device("cpu"))
