"""The fsdp engine's tiny model, optimizer settings, steps and reference run, shared by its tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tiny import tiny_qwen3_config

from laden.data.batch import pack_samples
from laden.optim import OptimSettings

VOCAB = 96


# eps 1e-3: Adam's update g / (|g| + eps) has slope up to lr / (4 eps) near |g| = eps, so with the
# default 1e-8 fp32 summation-order noise moves parameters by whole steps; 1e-3 bounds it to ~2.5x.
SETTINGS = OptimSettings(lr=1e-2, eps=1e-3, weight_decay=0.0, gradient_clipping=0.5, total_steps=10)


def tiny_model(seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_qwen3_config(vocab_size=VOCAB, **overrides)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def make_docs(num_docs: int, seed: int, min_len: int = 3, max_len: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num_docs,), generator=g).tolist()
    return [torch.randint(4, VOCAB, (n,), generator=g) for n in lengths]


def packed(docs):
    return pack_samples([(d.tolist(), [1] * len(d)) for d in docs])


def full_params(model, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full (gathered) parameters, or their gradients, by name."""
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = full.detach().clone()
    return out


def reference_steps(model, steps: list[list[torch.Tensor]], settings: OptimSettings):
    """Plain PyTorch: per-document forward, token-mean CE over the step, clip, AdamW."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=settings.lr, eps=settings.eps, weight_decay=0.0, betas=settings.betas
    )
    losses, norms = [], []
    for docs in steps:
        opt.zero_grad()
        num_tokens = sum(len(d) - 1 for d in docs)
        total = 0.0
        for d in docs:
            logits = model(input_ids=d[None]).logits[0, :-1]  # [L - 1, V]
            loss = F.cross_entropy(logits.float(), d[1:], reduction="sum") / num_tokens
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), settings.gradient_clipping).item())
        grads = full_params(model, grads=True)  # clipped, as the engine leaves them
        opt.step()
        losses.append(total)
    return losses, norms, grads, full_params(model)


def run_engine(engine, steps_per_rank: list[list[list]]):
    """Train on this data-parallel rank's micro-batches for every step; metrics, grads and params."""
    metrics = []
    for per_rank in steps_per_rank:
        total = sum(mb.num_loss_tokens for mbs in per_rank for mb in mbs)
        out = engine.train_batch(per_rank[engine.dp_rank], global_num_loss_tokens=total)
        metrics.append({k: float(v) for k, v in out.items()})
    return metrics, full_params(engine.model, grads=True), full_params(engine.model)


def split_steps(steps: list[list[torch.Tensor]], world_size: int):
    """Per step, per rank, a list of micro-batches; rank 0 gets one micro-batch more than the others."""
    out = []
    for docs in steps:
        ranks = [[] for _ in range(world_size)]
        chunks = [docs[i : i + 2] for i in range(0, len(docs), 2)]
        for i, chunk in enumerate(chunks):
            ranks[0 if i == 0 else i % world_size].append(packed(chunk))
        out.append(ranks)
    return out


STEPS = [make_docs(6, seed=1), make_docs(6, seed=2)]


def check_against_reference(results, model_fn=tiny_model, rtol=1e-4, atol=1e-5):
    """Losses, grad norms, last-step grads and updated params against the plain reference."""
    losses, norms, grads, params = reference_steps(model_fn(), STEPS, SETTINGS)
    for metrics, got_grads, got in results:
        torch.testing.assert_close([m["loss"] for m in metrics], losses, rtol=rtol, atol=atol)
        torch.testing.assert_close([m["grad_norm"] for m in metrics], norms, rtol=rtol, atol=atol)
        for name, ref in grads.items():
            torch.testing.assert_close(got_grads[name], ref, rtol=rtol, atol=atol, msg=f"grad {name}")
        for name, ref in params.items():
            torch.testing.assert_close(got[name], ref, rtol=rtol, atol=atol, msg=name)
