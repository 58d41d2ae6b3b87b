"""Expert parallelism and the router load-balancing loss (`laden.model.moe`) against plain references.

The references are written here: the Switch loss from router logits, a dense mixture-of-experts
block (every expert on every token, capacity drops by a Python count in token order), and stock
Hugging Face for whole models. The expert-parallel cases run on two gloo processes, each feeding
different tokens; one spawn runs every case (`ep_results`), so the tests share its start-up time.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from moe_cases import TOP_K, moe_config, reference_aux, tiny_moe
from torch import nn
from transformers import AutoModelForCausalLM, GptOssConfig
from workers import run_workers

from laden.model import moe

pytestmark = pytest.mark.usefixtures("one_thread")
COEF, SCALE = 0.3, 0.7


def family_block(family: str) -> nn.Module:
    """The first MoE block of a seeded one-layer model of `family`, its router and experts drawn
    with std 0.3 (biases included), so that routing and every weight matter."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig

    common = dict(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=TOP_K, pad_token_id=0)  # fmt: skip
    configs = {
        "qwen3_moe": lambda: moe_config(num_hidden_layers=1),
        "qwen2_moe": lambda: Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=16,
                                            shared_expert_intermediate_size=24, intermediate_size=64),
        "mixtral": lambda: MixtralConfig(**common, num_local_experts=4, intermediate_size=16),
        "olmoe": lambda: OlmoeConfig(**common, num_experts=4, intermediate_size=16),
        "gpt_oss": lambda: GptOssConfig(**common, num_local_experts=4, intermediate_size=16, head_dim=8,
                                        layer_types=["full_attention"]),
    }  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        configs[family](), dtype=torch.float32, attn_implementation="eager"
    )
    block = moe.moe_blocks(model)[0]
    for p in block.parameters():
        nn.init.normal_(p, std=0.3)
    return block


def hidden_of(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # GPT-OSS's block returns (hidden, scores)


FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss"]


# ---- references --------------------------------------------------------------------------


def capacity_keep(index: torch.Tensor, num_experts: int, factor: float | None) -> torch.Tensor:
    """[N, k] bool: the assignments an expert accepts, ceil(factor * N * k / E) each, in token order."""
    keep = torch.ones_like(index, dtype=torch.bool)
    if not factor:
        return keep
    capacity = math.ceil(factor * index.numel() / num_experts)
    taken = [0] * num_experts
    for n in range(index.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[n, j])
            keep[n, j] = taken[e] < capacity
            taken[e] += 1
    return keep


def reference_block(
    params: dict[str, torch.Tensor], x: torch.Tensor, *, factor: float | None = None, norm: bool = False
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A dense Qwen3-MoE block on x [N, H]: (output [N, H], router logits, dropped assignments)."""
    logits = x @ params["gate"].t()
    weights, index = logits.float().softmax(-1).topk(TOP_K)
    if norm:
        weights = weights / weights.sum(-1, keepdim=True)
    keep = capacity_keep(index, params["gate"].shape[0], factor)
    out = torch.zeros_like(x)
    for e in range(params["gate"].shape[0]):
        gate, up = (x @ params["gate_up_proj"][e].t()).chunk(2, -1)
        y = (F.silu(gate) * up) @ params["down_proj"][e].t()  # expert e on every token [N, H]
        share = (weights * ((index == e) & keep)).sum(-1)  # [N]
        out = out + share[:, None].to(x.dtype) * y
    return out, logits, int((~keep).sum())


def block_params(block: nn.Module) -> dict[str, torch.Tensor]:
    """Leaf copies of a Qwen3-MoE block's router and expert weights."""
    named = {
        "gate": block.gate.weight,
        "gate_up_proj": block.experts.gate_up_proj,
        "down_proj": block.experts.down_proj,
    }
    return {k: v.detach().clone().requires_grad_() for k, v in named.items()}


def probe(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---- single process ----------------------------------------------------------------------


def test_moe_blocks_are_the_sparse_layers_in_order():
    model = tiny_moe(num_hidden_layers=3, mlp_only_layers=[1])
    assert moe.moe_blocks(model) == [model.model.layers[0].mlp, model.model.layers[2].mlp]


def test_unsupported_block_is_refused_naming_its_class():
    class ListExperts(nn.Module):  # the transformers 4 layout: one nn.Module per expert, a linear gate
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(8, 4, bias=False)
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    with pytest.raises(ValueError, match="ListExperts .* not a supported mixture-of-experts block"):
        moe.moe_blocks(nn.Sequential(ListExperts()))


def test_load_balancing_loss_equals_switch_reference():
    logits = probe((11, 6), seed=3)
    aux, counts = moe.load_balancing_loss(logits, logits.softmax(-1).topk(TOP_K).indices)
    torch.testing.assert_close(aux, reference_aux(logits))
    assert counts.sum() == 11 * TOP_K
    balanced = torch.zeros(6, 6)  # uniform probabilities, every expert chosen equally often
    assert moe.load_balancing_loss(balanced, torch.arange(6).reshape(3, 2).repeat(2, 1))[0] == 1.0


def test_aux_scaler_keeps_output_bitwise_and_adds_coef_scale_aux_gradient():
    ref, model = tiny_moe(), tiny_moe()
    stats = moe.enable_router_aux_loss(model, COEF)
    stats.scale = SCALE
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids).logits
    want = ref(input_ids=ids, output_router_logits=True)
    assert torch.equal(out, want.logits)
    weight = probe(out.shape, seed=2)
    (out * weight).sum().backward()
    per_layer = torch.stack([reference_aux(logits) for logits in want.router_logits])
    ((want.logits * weight).sum() + COEF * SCALE * per_layer.mean()).backward()
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, msg=name)
    metrics = stats.pop()
    torch.testing.assert_close(metrics["moe_aux_loss"], per_layer.mean().detach())
    loads = [4 * F.one_hot(r.softmax(-1).topk(TOP_K).indices, 4).sum((0, 1)).max() / (18 * TOP_K)
             for r in want.router_logits]  # fmt: skip
    torch.testing.assert_close(metrics["moe_expert_load_max"], torch.stack(loads).mean())
    assert metrics["moe_dropped_fraction"] == 0
    assert stats.pop()["moe_aux_loss"] == 0  # popped: reset


def test_router_grads_without_coef_equal_stock_model():
    ref, model = tiny_moe(), tiny_moe()
    stats = moe.enable_router_aux_loss(model, 0.0)
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(4))
    model(input_ids=ids).logits.sum().backward()
    ref(input_ids=ids).logits.sum().backward()
    torch.testing.assert_close(
        model.model.layers[0].mlp.gate.weight.grad, ref.model.layers[0].mlp.gate.weight.grad
    )
    assert stats.pop()["moe_aux_loss"] > 0  # the metrics are kept


def test_non_reentrant_recompute_keeps_the_forward_scale_and_counts_once():
    """Per-layer activation checkpointing (as laden's engines enable it) with the scale changed
    between forward and backward (1F1B runs later forwards first): the gradient and the metrics
    of a plain forward at the forward's scale."""
    from laden.engine.device import enable_gradient_checkpointing

    plain, recomputed = tiny_moe(), tiny_moe()
    enable_gradient_checkpointing(recomputed)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(12))
    metrics = []
    for model in (plain, recomputed):
        model.train()
        stats = moe.enable_router_aux_loss(model, COEF)
        stats.scale = SCALE
        out = model(input_ids=ids).logits
        stats.scale = 100.0  # the next micro-batch's, set before this one's backward
        (out * probe(out.shape, seed=13)).sum().backward()
        metrics.append(stats.pop())
    for (name, p_ref), (_, p) in zip(plain.named_parameters(), recomputed.named_parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, msg=name)
    torch.testing.assert_close(metrics[1], metrics[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_local_experts_without_group_equal_hf_block(family):
    """No group: the swapped experts (every expert here) compute what Hugging Face's block does:
    Qwen2-MoE's shared expert, Mixtral's renormalised top-k, GPT-OSS's transposed, biased,
    interleaved experts included."""
    ref_block = family_block(family)
    block = copy.deepcopy(ref_block)
    moe.apply_expert_parallel(block, None)
    assert type(block.experts).__name__.startswith("ExpertParallel")
    x = probe((1, 10, 32), seed=5).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    out, want = hidden_of(block(x)), hidden_of(ref_block(x_ref))
    torch.testing.assert_close(out, want)
    weight = probe(out.shape, seed=6)
    (out * weight).sum().backward()
    (want * weight).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for (name, p_ref), (_, p) in zip(ref_block.named_parameters(), block.named_parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, msg=name)


def test_fp32_experts_run_bf16_activations_in_bf16():
    block = tiny_moe().model.layers[0].mlp
    ref = copy.deepcopy(block.experts).to(torch.bfloat16)  # Hugging Face's experts on bf16 weights
    ref.config._experts_implementation = "eager"  # its own copy of the config
    moe.apply_expert_parallel(block, None)
    x = probe((6, 32), seed=7).to(torch.bfloat16)
    index = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    weights = torch.full((6, 2), 0.5, dtype=torch.bfloat16)
    out = block.experts(x, index, weights)
    assert out.dtype == torch.bfloat16 and block.experts.gate_up_proj.dtype == torch.float32
    torch.testing.assert_close(out, ref(x, index, weights))


def test_reference_block_equals_hf_block():
    """The dense reference of the expert-parallel tests is Hugging Face's block."""
    block = tiny_moe().model.layers[0].mlp
    x = probe((9, 32), seed=8)
    torch.testing.assert_close(reference_block(block_params(block), x)[0], block(x[None])[0])


def test_capacity_drops_overflow_in_token_order_as_reference():
    block = tiny_moe().model.layers[0].mlp
    params = block_params(block)
    moe.apply_expert_parallel(block, None, capacity_factor=0.75)
    stats = moe.enable_router_aux_loss(block, 0.0)
    x = probe((10, 32), seed=9).requires_grad_()
    out = block(x[None])[0]
    want, _, dropped = reference_block(params, x, factor=0.75)
    assert dropped > 0
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(stats.pop()["moe_dropped_fraction"], torch.tensor(dropped / (10 * TOP_K)))


def test_bad_settings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="capacity_factor=-1"):
        moe.apply_expert_parallel(tiny_moe(), None, capacity_factor=-1)
    with pytest.raises(ValueError, match="coef=-0.1"):
        moe.enable_router_aux_loss(tiny_moe(), -0.1)
    with pytest.raises(ValueError, match="no mixture-of-experts blocks"):
        moe.enable_router_aux_loss(nn.Linear(2, 2), 0.1)


# ---- expert parallel over two gloo processes ---------------------------------------------

MODEL_TOKENS = (7, 5)  # rank 0, rank 1: different counts
CAPACITY_TOKENS, CAPACITY_FACTOR = (6, 9), 1.0


def model_inputs(rank: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, MODEL_TOKENS[rank]), generator=torch.Generator().manual_seed(10 + rank))


def skewed_case() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Router [8, H] and per-rank tokens: rank 0's go to experts {0, 1} (its own), rank 1's to {2, 5}
    (one of each rank's), so experts 3, 4, 6 and 7 get no token and rank 0 sends nothing to rank 1."""
    gen = torch.Generator().manual_seed(11)
    u, v = torch.eye(32)[0], torch.eye(32)[1]
    router = 0.05 * torch.randn(8, 32, generator=gen)
    for e, direction in ((0, u), (1, u), (2, v), (5, v)):
        router[e] += 2 * direction
    xs = [3 * d + 0.1 * torch.randn(n, 32, generator=gen) for d, n in ((u, 6), (v, 5))]
    return router, xs


def _model_case(rank: int, group) -> dict:
    model = tiny_moe()
    full = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    moe.apply_expert_parallel(model, group)
    stats = moe.enable_router_aux_loss(model, COEF)
    stats.scale = SCALE
    embeds = model.model.embed_tokens(model_inputs(rank)).detach().requires_grad_()
    logits = model(inputs_embeds=embeds).logits
    (logits * probe(logits.shape, seed=rank)).sum().backward()
    experts = model.model.layers[0].mlp.experts
    shards = moe.expert_shards(model)
    return {
        "logits": logits.detach(), "embeds_grad": embeds.grad,
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "shards": {n: (s.offset, s.size, s.full_size) for n, s in shards.items()},
        "gathered": moe.gather_expert_shard(experts.gate_up_proj, moe.expert_shard(experts.gate_up_proj)),
        "full": full, "metrics": stats.pop(),
    }  # fmt: skip


def _block_case(rank: int, group, x: torch.Tensor, num_experts: int, router=None, factor=None) -> dict:
    block = tiny_moe(num_experts).model.layers[0].mlp
    if router is not None:
        block.gate.weight.data.copy_(router)
    moe.apply_expert_parallel(block, group, capacity_factor=factor)
    stats = moe.enable_router_aux_loss(block, 0.0)
    x = x.clone().requires_grad_()
    out = block(x[None])[0]
    (out * probe(out.shape, seed=20 + rank)).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "grads": {n: p.grad for n, p in block.named_parameters()},
            "metrics": stats.pop()}  # fmt: skip


def _gpt_oss_case(rank: int, group) -> dict:
    block = family_block("gpt_oss")
    moe.apply_expert_parallel(block, group)
    x = probe((1, MODEL_TOKENS[rank], 32), seed=40 + rank).requires_grad_()
    out = hidden_of(block(x))
    (out * probe(out.shape, seed=41 + rank)).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "grads": {n: p.grad for n, p in block.named_parameters()},
            "shards": sorted(moe.expert_shards(block))}  # fmt: skip


def _ep_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    group = dist.group.WORLD
    router, xs = skewed_case()
    results = {
        "model": _model_case(rank, group),
        "skewed": _block_case(rank, group, xs[rank], 8, router=router),
        "capacity": _block_case(
            rank, group, probe((CAPACITY_TOKENS[rank], 32), seed=30 + rank), 4, factor=CAPACITY_FACTOR
        ),
        "gpt_oss": _gpt_oss_case(rank, group),
    }
    try:
        moe.apply_expert_parallel(tiny_moe(3), group)
    except ValueError as err:
        results["indivisible"] = str(err)
    return results


@pytest.fixture(scope="module")
def ep_results() -> list[dict]:
    return run_workers(_ep_worker, 2)


def reference_block_grads(num_experts: int, xs: list[torch.Tensor], router=None, factor=None) -> list[dict]:
    """Per rank: the dense reference's output, input and router gradients, dropped count; and the
    expert gradients of the loss summed over both ranks' tokens (what each shard must hold)."""
    block = tiny_moe(num_experts).model.layers[0].mlp
    if router is not None:
        block.gate.weight.data.copy_(router)
    params = block_params(block)
    expert_grads = {k: torch.zeros_like(v) for k, v in params.items()}
    per_rank = []
    for rank, x in enumerate(xs):
        x = x.clone().requires_grad_()
        out, logits, dropped = reference_block(params, x, factor=factor)
        (out * probe(out.shape, seed=20 + rank)).sum().backward()
        for k, p in params.items():
            expert_grads[k] += p.grad
        per_rank.append({"out": out.detach(), "x_grad": x.grad, "gate": params["gate"].grad.clone(),
                         "index": logits.softmax(-1).topk(TOP_K).indices, "dropped": dropped})  # fmt: skip
        for p in params.values():
            p.grad = None
    for entry in per_rank:
        entry["experts"] = expert_grads
    return per_rank


def assert_block_matches(got: dict, want: dict, rank: int, num_experts: int) -> None:
    torch.testing.assert_close(got["out"], want["out"])
    torch.testing.assert_close(got["x_grad"], want["x_grad"])
    torch.testing.assert_close(got["grads"]["gate.weight"], want["gate"])
    rows = slice(rank * num_experts // 2, (rank + 1) * num_experts // 2)
    for name in ("gate_up_proj", "down_proj"):
        torch.testing.assert_close(got["grads"][f"experts.{name}"], want["experts"][name][rows], msg=name)


def test_expert_parallel_model_equals_one_process_on_each_ranks_tokens(ep_results):
    """Whole Hugging Face model, e=2, 7 and 5 tokens, router loss on: logits, input, router and
    attention gradients as one process on the rank's tokens; expert shards hold the gradient of
    both ranks' tokens; the shards gather back to the full weights."""
    ref = tiny_moe()
    want, full_grads = [], None
    for rank in range(2):
        ref.zero_grad(set_to_none=True)
        embeds = ref.model.embed_tokens(model_inputs(rank)).detach().requires_grad_()
        out = ref(inputs_embeds=embeds, output_router_logits=True)
        aux = torch.stack([reference_aux(r) for r in out.router_logits]).mean()
        ((out.logits * probe(out.logits.shape, seed=rank)).sum() + COEF * SCALE * aux).backward()
        grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
        full_grads = grads if full_grads is None else {n: g + full_grads[n] for n, g in grads.items()}
        want.append((out.logits.detach(), embeds.grad, grads, aux.detach()))
    for rank, (got, (logits, embeds_grad, grads, aux)) in enumerate(zip(ep_results, want)):
        got = got["model"]
        torch.testing.assert_close(got["logits"], logits)
        torch.testing.assert_close(got["embeds_grad"], embeds_grad)
        assert set(got["shards"]) == {f"model.layers.{i}.mlp.experts.{n}" for i in (0, 1)
                                      for n in ("gate_up_proj", "down_proj")}  # fmt: skip
        assert {n for n, g in got["grads"].items() if g is not None} == set(grads)  # not the embedding
        for name, g in got["grads"].items():
            if g is None:
                continue
            if name in got["shards"]:
                offset, size, full_size = got["shards"][name]
                assert (offset, size, full_size) == (2 * rank, 2, 4)
                torch.testing.assert_close(g, full_grads[name][offset : offset + size], msg=name)
            else:
                torch.testing.assert_close(g, grads[name], msg=name)
        torch.testing.assert_close(got["gathered"], got["full"])
        torch.testing.assert_close(got["metrics"]["moe_aux_loss"], aux)


def test_expert_parallel_with_local_only_routing_and_idle_experts_equals_reference(ep_results):
    router, xs = skewed_case()
    want = reference_block_grads(8, xs, router=router)
    assert set(want[0]["index"].unique().tolist()) == {0, 1}  # rank 0 keeps its tokens home
    assert set(want[1]["index"].unique().tolist()) == {2, 5}  # experts 3, 4, 6, 7 idle
    for rank in range(2):
        got = ep_results[rank]["skewed"]
        assert_block_matches(got, want[rank], rank, 8)
        idle = [[3], [0, 2, 3]][rank]  # experts 3 and 4, 6, 7 by local index
        assert got["grads"]["experts.gate_up_proj"][idle].abs().sum() == 0


def test_capacity_factor_drops_as_reference_on_each_source_rank(ep_results):
    xs = [probe((n, 32), seed=30 + r) for r, n in enumerate(CAPACITY_TOKENS)]
    want = reference_block_grads(4, xs, factor=CAPACITY_FACTOR)
    assert all(w["dropped"] > 0 for w in want)
    for rank in range(2):
        got = ep_results[rank]["capacity"]
        assert_block_matches(got, want[rank], rank, 4)
        dropped = got["metrics"]["moe_dropped_fraction"] * CAPACITY_TOKENS[rank] * TOP_K
        torch.testing.assert_close(dropped, torch.tensor(float(want[rank]["dropped"])))


def test_experts_not_divisible_by_ranks_are_refused_with_the_fix(ep_results):
    for result in ep_results:
        assert "3 experts, which do not split evenly over e=2" in result["indivisible"]
        assert "choose e among [1, 3]" in result["indivisible"]


def test_expert_parallel_gpt_oss_block_shards_its_biases_and_equals_one_process(ep_results):
    """GPT-OSS (transposed experts with biases): every [E, ...] parameter is sharded, and the block
    on each rank's tokens equals Hugging Face's; the shards hold the gradient of both ranks' tokens."""
    ref = family_block("gpt_oss")
    want = []
    for rank in range(2):
        ref.zero_grad(set_to_none=True)
        x = probe((1, MODEL_TOKENS[rank], 32), seed=40 + rank).requires_grad_()
        out = hidden_of(ref(x))
        (out * probe(out.shape, seed=41 + rank)).sum().backward()
        want.append((out.detach(), x.grad, {n: p.grad.clone() for n, p in ref.named_parameters()}))
    summed = {n: want[0][2][n] + want[1][2][n] for n in want[0][2]}
    names = [
        "experts.down_proj",
        "experts.down_proj_bias",
        "experts.gate_up_proj",
        "experts.gate_up_proj_bias",
    ]
    for rank, (out, x_grad, grads) in enumerate(want):
        got = ep_results[rank]["gpt_oss"]
        assert got["shards"] == names
        torch.testing.assert_close(got["out"], out)
        torch.testing.assert_close(got["x_grad"], x_grad)
        for name, g in got["grads"].items():
            expected = summed[name][2 * rank : 2 * rank + 2] if name in names else grads[name]
            torch.testing.assert_close(g, expected, msg=name)
