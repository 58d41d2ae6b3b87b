"""The pair objectives through every training engine (fsdp, roundpipe, archon, one process on the CPU), built
as `laden dpo` / `laden rw` build them: the loss of one step and the weights after one SGD step equal plain
PyTorch written here (each sequence on its own, full fp32 logits), and `forward`'s log-probs are the ones
DPO's reference takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_qwen3_config

from laden.align.data import Pair, pack_pairs
from laden.align.objectives import DPOObjective, DPOSettings, PairwiseRewardObjective
from laden.config import load_config
from laden.data import unpack
from laden.engine.backend import resolve_backend
from laden.model.value_head import to_value_model

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, LR, BETA = 96, 0.5, 0.5
BACKENDS = ["fsdp:d1", "roundpipe:d1", "archon:d1"]


def _pairs() -> list[Pair]:
    g = torch.Generator().manual_seed(7)
    pairs = []
    for _ in range(3):
        sides = []
        for _ in range(2):
            n_prompt, n_completion = (int(x) for x in torch.randint(2, 6, (2,), generator=g))
            ids = torch.randint(0, VOCAB, (n_prompt + n_completion,), generator=g).tolist()
            sides.append((ids, [0] * n_prompt + [1] * n_completion))
        ref = tuple(torch.randn(len(s[0]), generator=g).mul(0.1).sub(4.0).tolist() for s in sides)
        pairs.append(Pair(chosen=sides[0], rejected=sides[1], ref=ref))  # type: ignore[arg-type]
    return pairs


def _model(value: bool):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=VOCAB), dtype=torch.float32)
    if value:
        to_value_model(model)
        with torch.no_grad():
            model.lm_head.weight.normal_(
                0, 0.1
            )  # a head that is not zero, so its gradient is not all that moves
    return model


def _engine(backend: str, value: bool):
    cfg = load_config("laden/assets/sft_tiny.yaml", [
        f"actor.backend={backend}", "actor.dtype=float32", "actor.optimizer.type=sgd", f"actor.optimizer.lr={LR}",
        "actor.optimizer.weight_decay=0", "actor.optimizer.gradient_clipping=0",
        "actor.optimizer.lr_scheduler_type=constant", "actor.optimizer.warmup_steps_proportion=0",
    ], job="sft")  # fmt: skip
    return resolve_backend(cfg).build(cfg, _model(value), total_steps=2, device=torch.device("cpu"))


def _reference(pairs: list[Pair], job: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(mean pair loss, weights after one SGD step) by plain autograd, one sequence at a time."""
    model = _model(job == "rw")
    model.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    for p in pairs:
        out = []
        for (ids, mask), ref in zip((p.chosen, p.rejected), p.ref):
            x = torch.tensor(ids)[None]
            if job == "rw":
                hidden = model.model(input_ids=x).last_hidden_state[0]
                out.append((hidden[-1] @ model.lm_head.weight[0]).double())
                continue
            logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), dim=-1)
            token = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            keep = torch.tensor(mask[1:], dtype=torch.bool)
            out.append(token[keep].double().sum() - torch.tensor(ref[1:], dtype=torch.float64)[keep].sum())
        total = total - F.logsigmoid((1.0 if job == "rw" else BETA) * (out[0] - out[1]))
    loss = total / len(pairs)
    loss.backward()
    return loss.detach(), {n: (w.detach() - LR * w.grad) for n, w in model.named_parameters()}


@pytest.mark.parametrize("job", ["dpo", "rw"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_pair_objectives_through_every_engine_match_plain_pytorch(backend, job):
    pairs = _pairs()
    engine = _engine(backend, job == "rw")
    objective = (
        DPOObjective(DPOSettings(beta=BETA), chunk_size=5) if job == "dpo" else PairwiseRewardObjective()
    )
    mbs = [pack_pairs(pairs[:2], with_ref=True), pack_pairs(pairs[2:], with_ref=True)]
    loss = engine.forward_backward(mbs, objective, normalizer=len(pairs))
    engine.optimizer_step()
    ref_loss, ref_weights = _reference(pairs, job)
    torch.testing.assert_close(float(loss), float(ref_loss), rtol=1e-4, atol=1e-5)
    weights = dict(engine.named_weights(torch.float32))
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert float(objective.sums.pop()["pairs"]) == len(pairs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_gives_the_log_probs_dpo_sums(backend):
    """The reference's per-token log-probs from `forward`, as DPO's setup reads them, sum to a plain model's."""
    pairs = _pairs()
    engine = _engine(backend, False)
    mb = pack_pairs(pairs)
    (out,) = engine.forward([mb], outputs=("logprobs",))
    model = _model(False)
    for doc, (ids, mask) in zip(
        unpack(mb, out["logprobs"]), [s for p in pairs for s in (p.chosen, p.rejected)]
    ):
        logp = torch.log_softmax(model(input_ids=torch.tensor(ids)[None]).logits[0, :-1].float(), dim=-1)
        token = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        keep = torch.tensor(mask[1:], dtype=torch.bool)
        torch.testing.assert_close(doc[:-1][keep].sum(), token[keep].sum().detach(), rtol=1e-4, atol=1e-4)
