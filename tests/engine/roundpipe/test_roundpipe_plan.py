"""ModelExecutePlan: validation of hand-written plans and the byte-balanced automatic plan."""

from __future__ import annotations

import pytest
import torch

from laden.engine.roundpipe import ModelExecutePlan
from laden.engine.roundpipe.plan import GIB, balanced_partition


class FakeModel:
    """Layer sizes as `ModelExecutePlan.auto` sees them (weights; weights + fp32 grads for bf16)."""

    def __init__(self, weight_bytes: list[int], num_devices: int = 1) -> None:
        self.weights = weight_bytes
        self.num_layers = len(weight_bytes)
        self._devices = num_devices

    def layer_bytes(self, *, with_grads: bool) -> list[int]:
        return [3 * w if with_grads else w for w in self.weights]

    @property
    def num_devices(self) -> int:
        return self._devices

    def default_memory_limit_gib(self) -> float:
        return 1000.0


@pytest.mark.parametrize(
    ("plan", "run_type", "message"),
    [
        (
            ModelExecutePlan([range(0, 2), range(3, 4)], [range(4, 6), range(0, 4)]),
            "fused",
            "starts at layer 3",
        ),
        (ModelExecutePlan([range(0, 2)], [range(3, 6), range(0, 3)]), "fused", "fused stage"),
        (ModelExecutePlan([range(0, 4)], [range(4, 6), range(0, 3)]), "fused", "expected layer 3"),
        (ModelExecutePlan([range(0, 4)], []), "fused", "bwd_plan is empty"),
        (ModelExecutePlan([range(0, 0), range(0, 6)]), "infer", "non-empty"),
        (ModelExecutePlan([range(0, 5)]), "infer", "all 6 layers"),
        (ModelExecutePlan([range(0, 6)], [range(0, 6)]), "lol", "run_type"),
    ],
)
def test_invalid_plans_are_explained(plan, run_type, message):
    with pytest.raises(ValueError, match=message):
        plan.check_valid(6, run_type)


def test_valid_hand_written_plans():
    fused = ModelExecutePlan(
        fwd_plan=[range(0, 2), range(2, 4)], bwd_plan=[range(4, 6), range(1, 4), range(0, 1)]
    )
    fused.check_valid(6, "fused")
    assert fused.forward_stages(6) == [range(0, 2), range(2, 4), range(4, 6)]
    ModelExecutePlan(fwd_plan=[range(0, 6)], bwd_plan=[range(3, 6), range(0, 3)]).check_valid(6, "train")
    ModelExecutePlan(fwd_plan=[], bwd_plan=[range(0, 6)]).check_valid(6, "fused")


@pytest.mark.parametrize("run_type", ["fused", "train", "infer"])
@pytest.mark.parametrize("limit_gib", [3.0, 6.0, 100.0])
@pytest.mark.parametrize("min_stages", [1, 3])
def test_auto_plan_fits_the_limit_and_covers_every_layer(run_type, limit_gib, min_stages):
    weights = [GIB // 2] + [GIB // 4] * 10 + [GIB // 2]  # embedding, ten layers, head
    model = FakeModel(weights)
    plan = ModelExecutePlan.auto(run_type, model, model_memory_limit=limit_gib, min_stages=min_stages)
    plan.check_valid(len(weights), run_type)
    cap = limit_gib * GIB / 2
    for stage in plan.fwd_plan:
        assert sum(weights[i] for i in stage) <= cap
    # The fused stage may take the whole limit beside the stage prefetched while it computes.
    capped = plan.bwd_plan[1:] if run_type == "fused" else plan.bwd_plan
    for stage in capped:
        assert sum(3 * weights[i] for i in stage) <= cap
    stages = plan.bwd_plan if run_type != "infer" else plan.fwd_plan
    assert len(stages) >= min_stages
    if run_type == "fused":
        assert plan.bwd_plan[0].stop == len(weights)
        beside = max((sum(3 * weights[i] for i in s) for s in plan.bwd_plan[1:2]), default=0)
        assert sum(3 * weights[i] for i in plan.bwd_plan[0]) + beside <= limit_gib * GIB


def test_auto_plan_uses_few_balanced_stages():
    model = FakeModel([100] * 12)
    plan = ModelExecutePlan.auto("train", model, model_memory_limit=12 * 300 / GIB, min_stages=1)
    assert [len(s) for s in plan.bwd_plan] == [6, 6]  # needs 2 stages of 1800 B; split evenly
    assert [len(s) for s in plan.fwd_plan] == [12]


def test_auto_plan_grows_the_fused_stage_to_skip_recompute():
    """The fused stage's layers are the only ones not recomputed: it grows while it fits the whole
    limit beside the stage prefetched with it; the other stages keep half the limit."""
    model = FakeModel([100] * 12)  # 300 B per layer with gradients
    whole = ModelExecutePlan.auto("fused", model, model_memory_limit=12 * 300 / GIB, min_stages=1)
    assert whole == ModelExecutePlan(fwd_plan=[], bwd_plan=[range(0, 12)])  # fits whole: no recompute
    # 3000 B: 9 fused layers (2700 B) beside one prefetched layer (300 B), so the layers before them
    # get stages of one layer in backward; in forward, 3 layers (300 B) beside the fused weights
    plan = ModelExecutePlan.auto("fused", model, model_memory_limit=10 * 300 / GIB, min_stages=1)
    expected = [range(3, 12), range(2, 3), range(1, 2), range(0, 1)]
    assert plan == ModelExecutePlan(fwd_plan=[range(0, 3)], bwd_plan=expected)
    balanced = ModelExecutePlan.auto("train", model, model_memory_limit=10 * 300 / GIB, min_stages=1)
    assert max(len(s) for s in balanced.bwd_plan) == 4  # what half the limit allows any stage
    # two devices: at least two stages, still the largest fused stage that fits beside the other
    two = ModelExecutePlan.auto("fused", model, model_memory_limit=12 * 300 / GIB, min_stages=2)
    assert two.bwd_plan == [range(1, 12), range(0, 1)] and two.fwd_plan == [range(0, 1)]


def test_layer_grain_does_not_grow_the_fused_stage():
    """Layer grain recomputes the fused stage layer by layer too: growing it would only keep more
    layer inputs on the device."""
    model = FakeModel([100] * 12)
    limit = 12 * 300 / GIB
    layer = ModelExecutePlan.auto(
        "fused", model, model_memory_limit=limit, min_stages=1, recompute_grain="layer"
    )
    balanced = ModelExecutePlan.auto(
        "train", model, model_memory_limit=limit, min_stages=1, recompute_grain="layer"
    )
    assert layer.bwd_plan == balanced.bwd_plan and len(layer.bwd_plan) == 2


class TiedModel(FakeModel):
    """FakeModel whose first and last layer share one weight, counted in both by layer_bytes."""

    def shared_bytes(self, *, with_grads: bool) -> list[tuple[frozenset[int], int]]:
        return [(frozenset({0, self.num_layers - 1}), 3 * 100 if with_grads else 100)]


def test_auto_plan_counts_a_tied_weight_once_in_the_fused_stage():
    weights = [100] * 6  # layer 0 and layer 5 share their 100 B (300 B with gradients)
    limit = 5 * 300 / GIB  # 1800 B counted layer by layer, 1500 B held
    assert ModelExecutePlan.auto("fused", TiedModel(weights), model_memory_limit=limit, min_stages=1) == (
        ModelExecutePlan(fwd_plan=[], bwd_plan=[range(0, 6)])
    )
    untied = ModelExecutePlan.auto("fused", FakeModel(weights), model_memory_limit=limit, min_stages=1)
    assert untied.bwd_plan[0].start > 0  # counted twice, the whole model does not fit


def test_auto_plan_leaves_room_for_the_tied_gradient_kept_on_the_device():
    """The head's gradient of a tied weight stays on the device until the first layer's stage:
    the two backward stages in flight after the fused one share the limit with it."""
    weights = [100] * 12  # 300 B per layer with gradients; the tied weight's gradient is 200 B
    limit, grain = 2400, "layer"  # layer grain: no grown fused stage, every stage at the cap
    tied = ModelExecutePlan.auto("fused", TiedModel(weights), model_memory_limit=limit / GIB, min_stages=1,
                                 recompute_grain=grain)  # fmt: skip
    untied = ModelExecutePlan.auto("fused", FakeModel(weights), model_memory_limit=limit / GIB, min_stages=1,
                                   recompute_grain=grain)  # fmt: skip
    assert [len(s) for s in untied.bwd_plan] == [4, 4, 4]  # 1200 B: half the limit each
    assert [len(s) for s in tied.bwd_plan] == [3, 3, 3, 3]  # 2 x 900 + 200 <= 2400 < 2 x 1200 + 200
    # a grown fused stage: the stages after it are small anyway
    grown = ModelExecutePlan.auto("fused", TiedModel(weights), model_memory_limit=limit / GIB, min_stages=1)
    assert all(2 * 300 * len(s) + 200 <= limit for s in grown.bwd_plan[1:]) and len(grown.bwd_plan[0]) == 7


def test_auto_plan_warns_when_a_layer_exceeds_half_the_limit():
    model = FakeModel([GIB, GIB // 8, GIB // 8])
    with pytest.warns(UserWarning, match="largest layer") as caught:
        plan = ModelExecutePlan.auto("fused", model, model_memory_limit=1.0)
    plan.check_valid(3, "fused")
    message = str(caught[0].message)
    assert "To fix: raise model_memory_limit to >= 6 GiB; split that layer" in message  # 2 x its 3 GiB
    assert "tiled_mlp_tokens" not in message and "num_microbatch" not in message


@pytest.mark.parametrize(
    ("sizes", "cap", "parts", "expected"),
    [
        ([1, 1, 1, 1], 10, 2, [range(0, 2), range(2, 4)]),
        ([5, 1, 1, 1, 1, 1], 5, 1, [range(0, 1), range(1, 6)]),
        ([1, 2, 3], 100, 5, [range(0, 1), range(1, 2), range(2, 3)]),
        ([4, 4, 4, 4, 4, 4], 8, 1, [range(0, 2), range(2, 4), range(4, 6)]),
    ],
)
def test_balanced_partition(sizes, cap, parts, expected):
    assert balanced_partition(sizes, cap, parts) == expected


def test_uniform_plan_counts_layers():
    plan = ModelExecutePlan.uniform(30, stage_layers=4, fused_layers=6, fwd_stage_layers=12)
    plan.check_valid(30, "fused")
    assert plan.bwd_plan[0] == range(24, 30)
    assert [len(s) for s in plan.bwd_plan[1:]] == [4, 4, 4, 4, 4, 4]
    assert plan.fwd_plan == [range(0, 12), range(12, 24)]
    small = ModelExecutePlan.uniform(3, stage_layers=4)
    assert small == ModelExecutePlan(fwd_plan=[], bwd_plan=[range(0, 3)])
    with pytest.raises(ValueError, match="stage_layers"):
        ModelExecutePlan.uniform(8, stage_layers=0)


class FakeLM(FakeModel):
    """FakeModel plus an activation estimate: per layer (kept, transient) bytes per token."""

    def __init__(self, weight_bytes: list[int], kept_per_token: list[int], transient_per_token: list[int]):
        super().__init__(weight_bytes)
        self.kept, self.transient = kept_per_token, transient_per_token

    def layer_activation_bytes(self, num_tokens: int) -> list[tuple[int, int]]:
        return [(k * num_tokens, t * num_tokens) for k, t in zip(self.kept, self.transient)]


def stage_cost(model: FakeLM, stage: range, num_tokens: int, grain: str) -> int:
    """What a backward stage holds at its peak (the reference for the planner's accounting)."""
    acts = model.layer_activation_bytes(num_tokens)
    weights = sum(3 * model.weights[i] for i in stage)
    if grain == "stage":  # every layer's kept activations, one layer's backward transient
        return weights + sum(acts[i][0] for i in stage) + max(acts[i][1] for i in stage)
    return weights + max(acts[i][0] + acts[i][1] for i in stage)  # one layer recomputed at a time


def assert_fits(model: FakeLM, plan: ModelExecutePlan, num_tokens: int, grain: str, limit_gib: float) -> None:
    """Backward stages fit half the limit; the fused stage fits it beside the next stage's weights."""
    for stage in plan.bwd_plan[1:]:
        assert stage_cost(model, stage, num_tokens, grain) <= limit_gib * GIB / 2
    beside = sum(3 * model.weights[i] for i in plan.bwd_plan[1]) if len(plan.bwd_plan) > 1 else 0
    assert stage_cost(model, plan.bwd_plan[0], num_tokens, grain) + beside <= limit_gib * GIB


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("num_tokens", [None, 1024, 8192])
def test_auto_plan_counts_the_activations_of_a_microbatch(grain, num_tokens):
    model = FakeLM([GIB // 16] * 12, kept_per_token=[64 << 10] * 12, transient_per_token=[96 << 10] * 12)
    limit_gib = 4.0
    plan = ModelExecutePlan.auto(
        "fused", model, model_memory_limit=limit_gib, tokens_per_microbatch=num_tokens, recompute_grain=grain
    )
    plan.check_valid(12, "fused")
    assert_fits(model, plan, num_tokens or 0, grain, limit_gib)
    weights_only = ModelExecutePlan.auto("fused", model, model_memory_limit=limit_gib, recompute_grain=grain)
    if num_tokens is None:
        assert plan == weights_only
    elif num_tokens == 8192 and grain == "stage":  # 0.5 GiB kept per layer: weights only blows the limit
        assert len(plan.bwd_plan) > len(weights_only.bwd_plan)
        assert max(stage_cost(model, s, num_tokens, grain) for s in weights_only.bwd_plan) > limit_gib * GIB


def test_auto_plan_fits_a_qwen3_1_7b_shape_with_long_microbatches():
    """The H200 run's out-of-memory case: 4 x 4096 tokens per micro-batch, an 8 GiB limit. Planned
    by weights only, the fused stage holds 8 decoder layers and ~30 GiB of activations; planned with
    them, every multi-layer stage fits half the limit (single layers past it get their own stage)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from laden import RoundPipe

    shape = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)  # fmt: skip
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=torch.bfloat16)
    rp = RoundPipe(model, optim_dtype=torch.float32, pin_model="off", devices=[torch.device("cpu")])
    num_tokens, limit_gib = 4 * 4096, 8.0
    bwd, acts = rp.layer_bytes(with_grads=True), rp.layer_activation_bytes(num_tokens)

    def cost(stage: range) -> int:
        return sum(bwd[i] + acts[i][0] for i in stage) + max(acts[i][1] for i in stage)

    with pytest.warns(UserWarning, match="activations of 16384 tokens") as caught:
        plan = ModelExecutePlan.auto(
            "fused", rp, model_memory_limit=limit_gib, tokens_per_microbatch=num_tokens
        )
    assert "set actor.tiled_mlp_tokens" in str(caught[0].message)  # the long-sequence knob is named
    plan.check_valid(rp.num_layers, "fused")
    assert all(cost(stage) <= limit_gib * GIB / 2 for stage in plan.bwd_plan if len(stage) > 1)
    assert all(cost(stage) <= limit_gib * GIB for stage in plan.bwd_plan)
    weights_only = ModelExecutePlan.auto("fused", rp, model_memory_limit=limit_gib)
    assert max(cost(stage) for stage in weights_only.bwd_plan) > 3 * limit_gib * GIB
