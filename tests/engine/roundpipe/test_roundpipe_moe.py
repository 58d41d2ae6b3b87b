"""The router load-balancing loss (`laden.model.moe`) through the roundpipe engine.

RoundPipe runs each stage's forward without a graph and recomputes it in backward, stage by stage,
so the router loss must enter the gradient through the recomputed graph without touching the
outputs. The reference runs stock Hugging Face per document, adds `coef * scale` times the layer
mean of the Switch loss over each micro-batch's tokens (all its documents: the engine routes a
packed row at once), and steps torch's AdamW.

Plain roundpipe training of the MoE families (no router loss) is tested in
`tests/roundpipe/compat/test_families_and_lora_mmap.py`.
"""

from __future__ import annotations

import pytest
import torch
from moe_cases import reference_aux, tiny_moe

from laden.data.batch import pack_samples
from laden.engine.roundpipe import RoundPipeEngine
from laden.model import moe
from laden.model.loss import chunked_linear_cross_entropy
from laden.model.split import shift_labels
from laden.optim import OptimSettings, param_groups_with_decay

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:the largest layer needs .* activations of:UserWarning"),
]
COEF, SCALE = 0.5, 0.25


def packed_steps(num_steps: int) -> list[list]:
    gen = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(num_steps):
        docs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (6, 4, 7, 3)]
        samples = [(d, [1] * len(d)) for d in docs]
        steps.append([pack_samples(samples[:2]), pack_samples(samples[2:])])
    return steps


def reference_step(model, micro_batches: list, num_tokens: int) -> torch.Tensor:
    """Per-document cross-entropy over the global count, plus COEF * SCALE * the layer-mean aux of
    each micro-batch's router logits (its documents together); backward included."""
    total = torch.zeros(())
    for mb in micro_batches:
        loss, router_logits = torch.zeros(()), []
        for doc in mb.input_ids.split(mb.seqlens):
            out = model.model(input_ids=doc[None], output_router_logits=True)
            ce = chunked_linear_cross_entropy(
                out.last_hidden_state[0], model.lm_head.weight, shift_labels(doc[None])[0]
            )
            loss = loss + ce / num_tokens
            router_logits.append(out.router_logits)
        layers = [torch.cat(per_doc) for per_doc in zip(*router_logits)]  # [T, E] per MoE layer
        aux = torch.stack([reference_aux(logits) for logits in layers]).mean()
        (loss + COEF * SCALE * aux).backward()
        total = total + loss.detach()
    return total


def test_router_loss_through_recomputed_stages_equals_resident_reference():
    o = OptimSettings(type="adam", lr=1e-2, eps=1e-4, weight_decay=0.1, gradient_clipping=1.0, total_steps=10)
    ref, model = tiny_moe(), tiny_moe()
    opt = torch.optim.AdamW(
        param_groups_with_decay(ref.named_parameters(), o.weight_decay), lr=o.lr, eps=o.eps
    )
    stats = moe.enable_router_aux_loss(model, COEF)
    stats.scale = SCALE  # every micro-batch alike: no per-micro-batch wiring needed here
    engine = RoundPipeEngine(model, optim=o, compute_dtype=torch.float32, recompute_grain="layer",
                             model_memory_limit=0.0004)  # fmt: skip
    assert len(engine.plan.bwd_plan) > 1  # several stages, recomputed in backward
    for mbs in packed_steps(2):
        num_tokens = sum(mb.num_loss_tokens for mb in mbs)
        ref_loss = reference_step(ref, mbs, num_tokens)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), o.gradient_clipping)
        opt.step()
        opt.zero_grad()
        out = engine.train_batch(mbs, global_num_loss_tokens=num_tokens)
        torch.testing.assert_close(out["loss"], ref_loss)
        torch.testing.assert_close(out["grad_norm"], ref_norm)
        assert stats.pop()["moe_aux_loss"] > 0
    masters = engine.state_dict()["model"]
    for name, p in ref.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), msg=name)
