"""The roundpipe engine's tiny models, steps, settings and resident references, and the library API's small models."""

from __future__ import annotations

import copy

import torch
from tiny import tiny_qwen3_config
from torch import nn
from transformers import AutoModelForCausalLM

from laden.data.batch import pack_samples
from laden.engine.roundpipe import ModelExecutePlan, RoundPipeEngine
from laden.model.loss import chunked_linear_cross_entropy
from laden.model.split import shift_labels
from laden.optim import AdamWBF16, OptimSettings, param_groups_with_decay


def tied_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = tiny_qwen3_config(vocab_size=64, num_hidden_layers=3)
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def make_steps(num_steps: int, seed: int = 0, *, docs_per_row: int = 2) -> list[list]:
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(num_steps):
        docs = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (6, 4, 7, 3, 5)]
        samples = [(d, [1] * len(d)) for d in docs]
        steps.append(
            [pack_samples(samples[i : i + docs_per_row]) for i in range(0, len(samples), docs_per_row)]
        )
    return steps


def reference_loss(model: nn.Module, micro_batches: list, num_tokens: int) -> torch.Tensor:
    """Per-document HF forward, summed token cross-entropy over the global count; backward included.

    The head uses the same chunked linear + cross-entropy kernel as the engine (tested against
    F.cross_entropy in test_loss), so that bf16 runs round identically.
    """
    total = torch.zeros(())
    for mb in micro_batches:
        for doc in mb.input_ids.split(mb.seqlens):
            hidden = model.model(input_ids=doc[None]).last_hidden_state[0]  # [T, H]
            loss = chunked_linear_cross_entropy(hidden, model.lm_head.weight, shift_labels(doc[None])[0])
            (loss / num_tokens).backward()
            total = total + loss.detach() / num_tokens
    return total


def assert_same_step(got: dict, want: dict) -> None:
    """Two engines' metrics of one step: the same loss and gradient norm."""
    torch.testing.assert_close(got["loss"], want["loss"])
    torch.testing.assert_close(got["grad_norm"], want["grad_norm"])


def assert_same_masters(got: RoundPipeEngine, want: RoundPipeEngine) -> None:
    """Two engines hold the same master weights (each engine's state dict read once)."""
    got_masters = got.state_dict()["model"]
    for name, t in want.state_dict()["model"].items():
        torch.testing.assert_close(got_masters[name], t, msg=name)


def settings(**overrides) -> OptimSettings:
    # eps well above the tiny model's smallest gradients: Adam's m / (sqrt(v) + eps) amplifies the
    # last-bit differences of packed vs per-document attention on entries with |g| ~ eps.
    base = dict(type="adam", lr=1e-2, eps=1e-4, weight_decay=0.1, gradient_clipping=0.0, total_steps=10)
    return OptimSettings(**{**base, **overrides})


def reference_optimizer(model: nn.Module, o: OptimSettings) -> torch.optim.Optimizer:
    groups = param_groups_with_decay(model.named_parameters(), o.weight_decay)
    if o.type == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum)
    if o.type == "adam_bf16":
        return AdamWBF16(groups, lr=o.lr, eps=o.eps)
    return torch.optim.AdamW(groups, lr=o.lr, eps=o.eps)


SMALL_STAGES = 0.0004  # GiB: about one layer per stage for the tiny model


# Embedding + 3 decoder layers + head in three backward stages: the whole model would fit one stage
# (the automatic plan then), and these tests are about stages that hand over to each other.
STAGED = ModelExecutePlan.uniform(5, stage_layers=2, fused_layers=1)


def mixed_precision_grads(master: nn.Module, micro_batches: list, num_tokens: int, device: str = "cpu"):
    """Loss and fp32 host gradients of a bf16 working copy of `master` (its parameters; buffers keep
    their dtype) on `device`, summed over micro-batches in fp32."""
    work = copy.deepcopy(master).to(device)
    for p in work.parameters():
        p.data = p.data.to(torch.bfloat16)
    grads = [torch.zeros_like(p) for p in master.parameters()]
    loss = torch.zeros(())
    for mb in micro_batches:
        loss = loss + reference_loss(work, [mb.to(device)], num_tokens).cpu()
        for g, p in zip(grads, work.parameters()):
            g.add_(p.grad.cpu())
            p.grad = None
    return loss, grads


def check_tracks_mixed_precision_reference(
    engine,
    current: nn.Module,
    opt,
    o,
    optim_step: str,
    *,
    device: str,
    rtol_loss: float,
    rtol_norm: float,
    master_ratio: float,
) -> None:
    """Three steps of `engine` against a resident mixed-precision step of `current` (one step stale in
    async mode): finite loss and norm within the tolerances, and every master within `master_ratio`
    of the distance the reference moved it (a sign flip of an update would break that)."""
    initial = copy.deepcopy(current)
    stale = copy.deepcopy(current)  # what the next step computes on in async mode
    for mbs in make_steps(3, docs_per_row=1):
        num_tokens = sum(mb.num_loss_tokens for mb in mbs)
        source = stale if optim_step == "async" else current
        ref_loss, grads = mixed_precision_grads(source, mbs, num_tokens, device=device)
        previous = copy.deepcopy(current)
        for p, g in zip(current.parameters(), grads):
            p.grad = g
        ref_norm = torch.nn.utils.clip_grad_norm_(current.parameters(), o.gradient_clipping)
        opt.step()
        opt.zero_grad()
        stale = previous
        out = engine.train_batch(mbs, global_num_loss_tokens=num_tokens)
        assert torch.isfinite(out["loss"]) and torch.isfinite(out["grad_norm"])
        torch.testing.assert_close(out["loss"], ref_loss, rtol=rtol_loss, atol=0)
        torch.testing.assert_close(out["grad_norm"], ref_norm, rtol=rtol_norm, atol=0)
    masters = engine.state_dict()["model"]
    for (name, p), p0 in zip(current.named_parameters(), initial.parameters()):
        assert torch.isfinite(masters[name]).all(), name
        moved = (p - p0).norm()
        assert moved > 0 and (masters[name] - p).norm() <= master_ratio * moved, name


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.GELU(),
        nn.Linear(16, 4),
    )


def mse_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum()


def tied_tiny_qwen3() -> nn.Module:
    cfg = tiny_qwen3_config(vocab_size=64, num_hidden_layers=3)
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
