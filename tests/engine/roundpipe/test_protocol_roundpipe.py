"""The `TrainEngine` protocol on the roundpipe engine: a tiny Qwen3 streamed in several stages.

Against the plain references of `protocol_reference` (fp32 compute and masters, the CPU as the
device): `forward`'s log-probs and entropies, the gradients of a custom per-token objective
(weights in `batch.fields`, which travel to the head's device with the labels) through one SGD
step with and without clipping, `named_weights` reassembling the model with at most one full
tensor held beyond it, offload then onload equal to never offloading (the pooled buffers really
released meanwhile, a step refused), `version` counting steps, and a checkpoint round trip in
the shared layout that resumes exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
from memtrack import LiveBytes
from protocol_reference import (
    WeightedTokenLoss,
    reference_token_outputs,
    reference_weighted_grads,
    reference_weighted_loss,
    sgd_step_reference,
)
from roundpipe_protocol_cases import ADAM, BATCHES, NORMALIZER, SGD, STAGED, TEMPERATURE, tiny_model, tokens

from laden.engine.base import OffloadedError, TrainEngine
from laden.engine.roundpipe import RoundPipeEngine
from laden.model.hf.export import hf_state_names
from laden.optim import OptimSettings

pytestmark = pytest.mark.usefixtures("one_thread")

SLACK_BYTES = 1024  # a few scalars' storages, far below any weight


def make_engine(optim: OptimSettings = SGD, *, tied: bool = True, **kwargs) -> RoundPipeEngine:
    kwargs = {"execute_plan": STAGED, **kwargs}
    return RoundPipeEngine(
        tiny_model(tied=tied),
        optim=optim,
        compute_dtype=torch.float32,
        optimizer_dtype=torch.float32,
        **kwargs,
    )


@pytest.mark.parametrize("tied", [True, False])
def test_forward_equals_teacher_forced_reference(tied):
    engine = make_engine(tied=tied)
    assert len(engine.plan.bwd_plan) > 2
    ref = tiny_model(tied=tied)
    outs = engine.forward(BATCHES, temperature=TEMPERATURE)
    assert len(outs) == len(BATCHES)
    for out, batch in zip(outs, BATCHES):
        want = reference_token_outputs(ref, batch, temperature=TEMPERATURE)
        assert list(out) == ["logprobs", "entropy"]
        for key in ("logprobs", "entropy"):
            assert out[key].dtype == torch.float32 and out[key].device.type == "cpu"
            assert out[key].shape == (batch.num_tokens,)
            torch.testing.assert_close(out[key], want[key], msg=key)
    only = engine.forward(BATCHES[:1], outputs=("entropy",))[0]
    assert list(only) == ["entropy"]
    torch.testing.assert_close(only["entropy"], reference_token_outputs(ref, BATCHES[0])["entropy"])
    assert engine.forward(BATCHES, outputs=()) == [{}, {}, {}]
    with pytest.raises(ValueError, match="logits"):
        engine.forward(BATCHES, outputs=("logits",))  # type: ignore[arg-type]
    assert engine.version == 0


def clipped(grads: dict[str, torch.Tensor], max_norm: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the global norm, the gradients as torch's clip_grad_norm_ scales them)."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    coef = min(1.0, max_norm / (float(norm) + 1e-6)) if max_norm > 0 else 1.0
    return norm, {n: g * coef for n, g in grads.items()}


@pytest.mark.parametrize("clip", [0.0, 0.05])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_custom_objective_step_equals_reference(clip, grain):
    """One SGD step on `WeightedTokenLoss` / normalizer: the loss, the norm and the weights of the
    plain autograd reference. Without clipping the updates start during `forward_backward`."""
    o = OptimSettings(type="sgd", lr=SGD.lr, weight_decay=0.0, gradient_clipping=clip, total_steps=4)
    engine = make_engine(o, recompute_grain=grain)
    assert isinstance(engine, TrainEngine)
    model = tiny_model()
    ref_loss, grads = reference_weighted_grads(model, BATCHES, NORMALIZER)
    norm, step_grads = clipped(grads, clip)
    if clip:
        assert norm > clip  # the clipping is active
    loss = engine.forward_backward(BATCHES, WeightedTokenLoss(), normalizer=NORMALIZER)
    torch.testing.assert_close(loss, ref_loss)
    out = engine.optimizer_step()
    torch.testing.assert_close(out["grad_norm"], norm)
    torch.testing.assert_close(out["lr"], torch.tensor(SGD.lr))
    assert engine.version == 1
    want = sgd_step_reference(model, step_grads, SGD.lr)
    got = {n: t.clone() for n, t in engine.named_weights(torch.float32)}
    assert list(got) == hf_state_names(model)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, msg=name)


def test_eval_and_train_batch_take_an_objective():
    engine = make_engine()
    model = tiny_model()
    evaluated = engine.eval_batch(BATCHES, global_num_loss_tokens=7, objective=WeightedTokenLoss())["loss"]
    torch.testing.assert_close(evaluated, reference_weighted_loss(model, BATCHES, 7.0).detach())
    ref_loss, grads = reference_weighted_grads(model, BATCHES, 7.0)
    out = engine.train_batch(BATCHES, global_num_loss_tokens=7, objective=WeightedTokenLoss())
    torch.testing.assert_close(out["loss"], ref_loss)
    want = sgd_step_reference(model, grads, SGD.lr)
    for name, t in engine.named_weights(torch.float32):
        torch.testing.assert_close(t, want[name], msg=name)
    assert engine.version == 1


def weights_holding(engine: RoundPipeEngine, dtype: torch.dtype, want: dict[str, torch.Tensor]):
    """(names, all equal to `want`, peak bytes held beyond the model) of one `named_weights` pass."""
    names, equal = [], True
    with LiveBytes() as live:
        for name, t in engine.named_weights(dtype):
            names.append(name)
            equal = equal and t.dtype == dtype and torch.equal(t, want[name])
            del t  # the loop's reference would otherwise outlive the next tensor's conversion
    return names, equal, live.peak_bytes


@pytest.mark.parametrize("tied", [True, False])
def test_named_weights_reassemble_the_model_holding_one_tensor(tied):
    """bf16 asked of fp32 masters: every floating tensor is a converted copy, one at a time; the
    masters' own dtype: the live tensors themselves, nothing copied."""
    engine = make_engine(tied=tied)
    model = tiny_model(tied=tied)
    state = model.state_dict()
    want = {n: state[n].to(torch.bfloat16) for n in hf_state_names(model)}
    names, equal, peak = weights_holding(engine, torch.bfloat16, want)
    assert names == hf_state_names(model) == list(want)
    assert ("lm_head.weight" in names) is not tied
    assert equal
    largest = max(t.nbytes for t in want.values())
    assert largest <= peak <= largest + SLACK_BYTES, (peak, largest)
    names, equal, peak = weights_holding(engine, torch.float32, {n: state[n] for n in names})
    assert equal and peak <= SLACK_BYTES, peak
    masters = engine.state_dict()["model"]
    for name, t in engine.named_weights():  # the compute dtype: fp32 here
        if name in masters:
            assert t.data_ptr() == masters[name].data_ptr(), name


def test_named_weights_of_bf16_compute_are_the_upload_copies():
    """fp32 masters, bf16 compute: the default dtype is bf16, and each weight is the rounded master,
    bit for bit what the devices upload (the wrapped model's parameters)."""
    engine = RoundPipeEngine(tiny_model(), optim=ADAM, compute_dtype=torch.bfloat16, execute_plan=STAGED)
    engine.train_batch(BATCHES, global_num_loss_tokens=tokens(BATCHES))
    uploads = dict(engine.model.state_dict())
    for name, t in engine.named_weights():
        assert t.dtype == torch.bfloat16 or not t.is_floating_point(), name
        assert torch.equal(t, uploads[name]), name


def train_twice(engine: RoundPipeEngine, *, offload_between: bool):
    """Two steps; optionally offloaded and onloaded (twice each: idempotent) between them, with every
    step call refused meanwhile and the pooled activation buffers released."""
    steps = [BATCHES, BATCHES[::-1]]
    n = tokens(BATCHES)
    engine.train_batch(steps[0], global_num_loss_tokens=n)
    if offload_between:
        assert engine.pipe.host_buffers.free_bytes() > 0  # parked activations' buffers, kept for reuse
        engine.offload()
        engine.offload()
        assert engine.offloaded and engine.pipe.host_buffers.free_bytes() == 0
        refused = [
            lambda: engine.train_batch(steps[1], global_num_loss_tokens=n),
            lambda: engine.forward_backward(steps[1], WeightedTokenLoss(), normalizer=n),
            lambda: engine.eval_batch(steps[1], global_num_loss_tokens=n),
            lambda: engine.forward(steps[1]),
            engine.optimizer_step,
        ]
        for call in refused:
            with pytest.raises(OffloadedError, match="onload"):
                call()
        assert dict(engine.named_weights(torch.float32))  # weights for a colocated rollout engine
        engine.onload()
        engine.onload()
    engine.train_batch(steps[1], global_num_loss_tokens=n)
    weights = {name: t.clone() for name, t in engine.named_weights(torch.float32)}
    optim = {
        f"{name}/{key}": value.clone() if isinstance(value, torch.Tensor) else value
        for name, entry in engine.state_dict()["optimizer"]["state"].items()
        for key, value in entry.items()
    }
    return weights, optim


@pytest.mark.parametrize("optim_step", ["sync", "async"])
def test_offload_onload_equals_never_offloaded(optim_step):
    got = train_twice(make_engine(ADAM, optim_step=optim_step), offload_between=True)
    want = train_twice(make_engine(ADAM, optim_step=optim_step), offload_between=False)
    assert got[0].keys() == want[0].keys() and got[1].keys() == want[1].keys()
    for name in want[0]:
        assert torch.equal(got[0][name], want[0][name]), name
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), name


def test_offload_between_forward_backward_and_optimizer_step():
    """Offloading waits for the early updates of a pending step; its `optimizer_step` follows the onload."""
    engines = [make_engine(), make_engine()]
    for i, engine in enumerate(engines):
        engine.forward_backward(BATCHES, WeightedTokenLoss(), normalizer=NORMALIZER)
        if i == 0:
            engine.offload()
            with pytest.raises(OffloadedError):
                engine.optimizer_step()
            engine.onload()
        engine.optimizer_step()
    got, want = (dict(e.named_weights(torch.float32)) for e in engines)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_step_must_be_finished_before_anything_else():
    engine = make_engine()
    with pytest.raises(RuntimeError, match="without a forward_backward"):
        engine.optimizer_step()
    engine.forward_backward(BATCHES, WeightedTokenLoss(), normalizer=NORMALIZER)
    for call in (
        lambda: engine.forward_backward(BATCHES, WeightedTokenLoss(), normalizer=NORMALIZER),
        lambda: engine.forward(BATCHES),
        lambda: engine.eval_batch(BATCHES, global_num_loss_tokens=7),
        engine.state_dict,
    ):
        with pytest.raises(RuntimeError, match="call engine.optimizer_step"):
            call()
    engine.optimizer_step()
    assert engine.version == 1
    with pytest.raises(ValueError, match="normalizer"):
        engine.forward_backward(BATCHES, WeightedTokenLoss(), normalizer=0.0)
    with pytest.raises(ValueError, match="no micro-batches"):
        engine.forward_backward([], WeightedTokenLoss(), normalizer=NORMALIZER)


def test_version_counts_steps_and_the_checkpoint_resumes_exactly():
    """`version` counts optimizer steps only; the shared layout holds the live masters and optimizer
    states under Hugging Face names; loading it into a fresh engine (a deep copy, in place as a
    checkpointer does, or with other param groups' LRs) and training on equals training on without
    the interruption."""
    o = OptimSettings(lr=1e-2, eps=1e-3, weight_decay=0.1, gradient_clipping=0.5, total_steps=6,
                      warmup_steps=1, lr_scheduler_type="cosine")  # fmt: skip
    steps = [BATCHES, BATCHES[::-1], BATCHES[1:]]
    whole, first = make_engine(o), make_engine(o)
    assert whole.version == 0
    whole.forward(BATCHES)
    whole.eval_batch(BATCHES, global_num_loss_tokens=tokens(BATCHES))
    assert whole.version == 0
    for mbs in steps[:2]:
        whole.train_batch(mbs, global_num_loss_tokens=tokens(mbs))
        first.forward_backward(mbs, first.objective, normalizer=tokens(mbs))
        first.optimizer_step()
    assert whole.version == first.version == 2
    state = first.state_dict()
    assert set(state) == {"model", "optimizer", "scheduler", "version"} and state["version"] == 2
    names = [n for n, _ in tiny_model().named_parameters()]
    assert list(state["model"]) == names and sorted(state["optimizer"]["state"]) == sorted(names)
    live = {hp.name: hp.master for hp in first.pipe.store.params}
    for name in names:
        assert state["model"][name] is live[name], name  # live, so a checkpointer loads in place
    copied = make_engine(o)
    copied.load_state_dict(copy.deepcopy(state))
    in_place = make_engine(o)
    template = in_place.state_dict()
    with torch.no_grad():
        for name, t in state["model"].items():
            template["model"][name].copy_(t)
        for name, entry in state["optimizer"]["state"].items():
            for key, value in entry.items():
                template["optimizer"]["state"][name][key].copy_(value)
    template["optimizer"]["param_groups"] = state["optimizer"]["param_groups"]  # hyper-parameters: data
    template["scheduler"], template["version"] = state["scheduler"], state["version"]
    in_place.load_state_dict(template)
    # The param groups' LR of a fresh engine (0: warm-up step 0): the schedule's LR at `version` wins.
    other_groups = make_engine(o)
    other_groups.load_state_dict({**copy.deepcopy(state), "optimizer": {
        "state": copy.deepcopy(state["optimizer"]["state"]),
        "param_groups": make_engine(o).state_dict()["optimizer"]["param_groups"],
    }})  # fmt: skip
    want = whole.train_batch(steps[2], global_num_loss_tokens=tokens(steps[2]))
    wanted = {name: t.clone() for name, t in whole.named_weights(torch.float32)}
    for resumed in (copied, in_place, other_groups):
        assert resumed.version == 2
        out = resumed.train_batch(steps[2], global_num_loss_tokens=tokens(steps[2]))
        assert torch.equal(out["loss"], want["loss"]) and torch.equal(out["lr"], want["lr"])
        for name, t in resumed.named_weights(torch.float32):
            assert torch.equal(t, wanted[name]), name
        assert resumed.version == 3


# ------------------------------------------------------------------------------- gloo: d2


def _d2_worker(rank: int, world_size: int) -> dict:
    """Rank 0 trains on two of `BATCHES`, rank 1 on the third: uneven shares, one normalizer."""
    mine = [BATCHES[i] for i in ([0, 1] if rank == 0 else [2])]
    engine = make_engine()
    outputs = engine.forward(mine, temperature=TEMPERATURE)
    loss = engine.forward_backward(mine, WeightedTokenLoss(), normalizer=NORMALIZER)
    norm = engine.optimizer_step()["grad_norm"]
    stepped = {name: t.clone() for name, t in engine.named_weights(torch.float32)}
    ranks = (engine.dp_rank, engine.dp_size)
    return {"outputs": outputs, "loss": loss, "norm": norm, "stepped": stepped, "ranks": ranks}


def test_data_parallel_forward_and_custom_objective_step_equal_reference():
    """Two gloo replicas: each one's `forward` is the reference on its own micro-batches, and one SGD
    step on the weighted token loss over both shares gives the single-process reference weights."""
    from workers import run_workers

    results = run_workers(_d2_worker, 2)
    model = tiny_model()
    ref_loss, grads = reference_weighted_grads(model, BATCHES, NORMALIZER)
    norm, _ = clipped(grads, 0.0)
    want = sgd_step_reference(model, grads, SGD.lr)
    for rank, result in enumerate(results):
        assert result["ranks"] == (rank, 2)
        for out, i in zip(result["outputs"], [0, 1] if rank == 0 else [2]):
            expected = reference_token_outputs(model, BATCHES[i], temperature=TEMPERATURE)
            for key in ("logprobs", "entropy"):
                torch.testing.assert_close(out[key], expected[key], msg=f"rank {rank} batch {i} {key}")
        torch.testing.assert_close(result["loss"], ref_loss, msg=f"rank {rank}")
        torch.testing.assert_close(result["norm"], norm, msg=f"rank {rank}")
        for name, value in want.items():
            torch.testing.assert_close(result["stepped"][name], value, msg=f"rank {rank} {name}")
