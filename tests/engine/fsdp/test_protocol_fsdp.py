"""The `TrainEngine` protocol on the fsdp engine: one plain process (d1) and gloo d2, c2, t2.

Against the plain references of `protocol_reference`: `forward`'s log-probs and entropies, the
gradients of a custom per-token objective (weights in `batch.fields`), `named_weights`
reassembling the model with at most one full tensor held beyond it, offload then onload equal
to never offloading (and the storages really released meanwhile), `version` counting steps.
The multi-process cases run in one spawn (a module fixture): process start-up is the cost.
"""

from __future__ import annotations

import pytest
import torch
from fsdp_cases import VOCAB, tiny_model
from memtrack import LiveBytes
from protocol_reference import (
    WeightedTokenLoss,
    packed_batches,
    reference_token_outputs,
    reference_weighted_grads,
    reference_weighted_loss,
    sgd_step_reference,
)
from torch.distributed.tensor import DTensor
from workers import run_workers

from laden.engine.base import OffloadedError, TrainEngine
from laden.engine.fsdp import FSDPEngine
from laden.model.hf.export import hf_state_names
from laden.optim import OptimSettings

pytestmark = pytest.mark.usefixtures("one_thread")

BATCHES = packed_batches(VOCAB, num_micro_batches=3, docs_per_mb=2, seed=3)
NORMALIZER = 7.0  # any positive number the ranks agree on; not the token count, so it is really used
TEMPERATURE = 0.7
SGD = OptimSettings(type="sgd", lr=0.5, weight_decay=0.0, gradient_clipping=0.0, total_steps=4)
ADAM = OptimSettings(lr=1e-2, eps=1e-3, weight_decay=0.0, gradient_clipping=0.5, total_steps=4)
MODES = {"d2": {"dp": 2}, "c2": {"cp": 2}, "t2": {"tp": 2}}
SLACK_BYTES = 1024  # a few scalars' storages (the all-gather's bookkeeping), far below any weight


def make_engine(optim: OptimSettings = SGD, **mode) -> FSDPEngine:
    cpu = torch.device("cpu")  # the gloo workers and the references are on the host, GPU or not
    return FSDPEngine(
        tiny_model(), **mode, device=cpu, dtype=torch.float32, optimizer_dtype=torch.float32, optim=optim
    )


def rank_batches(mode: str, rank: int) -> list[int]:
    """Which of `BATCHES` a rank trains on: under d2 rank 0 has two and rank 1 one (so rank 1 runs a
    padding micro-batch, whose fields read as zeros); c2 and t2 ranks share every row."""
    if mode == "d2":
        return [0, 1] if rank == 0 else [2]
    return [0, 1, 2]


def plain(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def storages_released(engine: FSDPEngine) -> bool:
    tensors = []
    for p in engine.model.parameters():
        tensors += [p, *([p.grad] if p.grad is not None else [])]
    tensors += [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    local = [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]
    return bool(local) and all(t.untyped_storage().nbytes() == 0 for t in local if t.numel())


def weights_holding(engine: FSDPEngine, dtype: torch.dtype, want: dict[str, torch.Tensor]):
    """(names, all equal to `want`, peak bytes held beyond the model) of one `named_weights` pass."""
    names, equal = [], True
    with LiveBytes() as live:
        for name, t in engine.named_weights(dtype):
            names.append(name)
            equal = equal and t.dtype == dtype and torch.equal(t, want[name])
            del t  # the caller's reference would otherwise outlive the next gather
    return names, equal, live.peak_bytes


def train_twice(engine: FSDPEngine, batches, *, offload_between: bool):
    """Two steps; optionally offloaded and onloaded (twice each: idempotent) between them."""
    steps = [batches, batches[::-1]]
    tokens = sum(mb.num_loss_tokens for mb in BATCHES)  # the same on every rank
    engine.train_batch(steps[0], global_num_loss_tokens=tokens)
    released = refused = False
    if offload_between:
        engine.offload()
        engine.offload()
        released = storages_released(engine)
        try:
            engine.train_batch(steps[1], global_num_loss_tokens=tokens)
        except OffloadedError:
            refused = True
        engine.onload()
        engine.onload()
    engine.train_batch(steps[1], global_num_loss_tokens=tokens)
    weights = {n: t.clone() for n, t in engine.named_weights(torch.float32)}
    optim = {
        f"{n}/{k}": plain(v)
        for n, entry in engine.state_dict()["optimizer"]["state"].items()
        for k, v in entry.items()
    }
    return weights, optim, released, refused


# ------------------------------------------------------------------------- one plain process


def test_forward_equals_teacher_forced_reference():
    engine = make_engine()
    ref = tiny_model()
    outs = engine.forward(BATCHES, temperature=TEMPERATURE)
    assert len(outs) == len(BATCHES)
    for out, batch in zip(outs, BATCHES):
        want = reference_token_outputs(ref, batch, temperature=TEMPERATURE)
        for key in ("logprobs", "entropy"):
            assert out[key].dtype == torch.float32 and out[key].device.type == "cpu"
            torch.testing.assert_close(out[key], want[key], msg=key)
    only = engine.forward(BATCHES[:1], outputs=("entropy",))[0]
    assert list(only) == ["entropy"]
    torch.testing.assert_close(only["entropy"], reference_token_outputs(ref, BATCHES[0])["entropy"])


def test_custom_objective_gradients_equal_reference():
    engine = make_engine()
    assert isinstance(engine, TrainEngine)
    ref_loss, ref_grads = reference_weighted_grads(tiny_model(), BATCHES, NORMALIZER)
    loss = engine.forward_backward(BATCHES, WeightedTokenLoss(), normalizer=NORMALIZER)
    torch.testing.assert_close(loss, ref_loss)
    for name, p in engine.model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], msg=name)
    evaluated = engine.eval_batch(BATCHES, global_num_loss_tokens=7, objective=WeightedTokenLoss())["loss"]
    torch.testing.assert_close(evaluated, reference_weighted_loss(tiny_model(), BATCHES, 7.0).detach())


def test_named_weights_reassemble_the_model_holding_one_tensor():
    """bf16 asked of fp32 masters: every tensor is a cast copy, and only one exists at a time."""
    engine = make_engine()
    model = tiny_model()
    want = {n: t.to(torch.bfloat16) for n, t in model.state_dict().items()}
    names, equal, peak = weights_holding(engine, torch.bfloat16, want)
    assert names == hf_state_names(model) == list(want)
    assert equal
    largest = max(t.nbytes for t in want.values())
    assert largest <= peak <= largest + SLACK_BYTES, (peak, largest)


def test_offload_onload_equals_never_offloaded():
    got = train_twice(make_engine(ADAM), BATCHES, offload_between=True)
    want = train_twice(make_engine(ADAM), BATCHES, offload_between=False)
    check_offload(got, want)


def check_offload(got, want) -> None:
    weights, optim, released, refused = got
    assert released and refused
    assert weights.keys() == want[0].keys() and optim.keys() == want[1].keys()
    for name in want[0]:
        assert torch.equal(weights[name], want[0][name]), name
    for name in want[1]:
        assert torch.equal(optim[name], want[1][name]), name


def test_version_counts_steps_and_is_checkpointed():
    engine = make_engine()
    assert engine.version == 0
    tokens = sum(mb.num_loss_tokens for mb in BATCHES)
    engine.forward(BATCHES)
    engine.eval_batch(BATCHES, global_num_loss_tokens=tokens)
    assert engine.version == 0
    engine.train_batch(BATCHES, global_num_loss_tokens=tokens)
    engine.forward_backward(BATCHES, WeightedTokenLoss(), normalizer=NORMALIZER)
    engine.optimizer_step()
    assert engine.version == 2
    state = engine.state_dict()
    assert state["version"] == 2
    fresh = make_engine()
    fresh.load_state_dict(state)
    assert fresh.version == 2
    for name, p in fresh.model.named_parameters():
        assert torch.equal(p, dict(engine.model.named_parameters())[name]), name


# ------------------------------------------------------------------------ gloo: d2, c2, t2


def _protocol_worker(rank: int, world_size: int):
    out = {}
    for mode, sizes in MODES.items():
        mine = [BATCHES[i] for i in rank_batches(mode, rank)]
        engine = make_engine(**sizes)
        outputs = engine.forward(mine, temperature=TEMPERATURE)
        loss = engine.forward_backward(mine, WeightedTokenLoss(), normalizer=NORMALIZER)
        engine.optimizer_step()
        stepped = {n: t.clone() for n, t in engine.named_weights(torch.float32)}
        out[mode] = {"outputs": outputs, "loss": loss, "stepped": stepped, "version": engine.version}
    want = tiny_model().state_dict()
    out["named_weights"] = weights_holding(make_engine(dp=world_size), torch.float32, want)
    out["largest_bytes"] = max(t.nbytes for t in want.values())
    mine = [BATCHES[i] for i in rank_batches("d2", rank)]
    out["offload"] = [
        train_twice(make_engine(ADAM, dp=world_size), mine, offload_between=flag) for flag in (True, False)
    ]
    return out


@pytest.fixture(scope="module")
def parallel_results():
    return run_workers(_protocol_worker, 2)


@pytest.mark.parametrize("mode", list(MODES))
def test_parallel_forward_equals_reference(parallel_results, mode):
    """d2 (with a padding micro-batch), c2 (slices gathered back to rows), t2 (the full head)."""
    ref = tiny_model()
    for rank, result in enumerate(parallel_results):
        outs = result[mode]["outputs"]
        indices = rank_batches(mode, rank)
        assert len(outs) == len(indices)
        for out, i in zip(outs, indices):
            want = reference_token_outputs(ref, BATCHES[i], temperature=TEMPERATURE)
            for key in ("logprobs", "entropy"):
                torch.testing.assert_close(out[key], want[key], msg=f"{mode} rank {rank} batch {i} {key}")


@pytest.mark.parametrize("mode", list(MODES))
def test_parallel_custom_objective_step_equals_reference(parallel_results, mode):
    """The weighted token loss over every rank's micro-batches, one SGD step: the reference weights.
    Under c2 the fields are sliced like the labels; under t2 the objective gets the full head."""
    model = tiny_model()
    ref_loss, grads = reference_weighted_grads(model, BATCHES, NORMALIZER)
    want = sgd_step_reference(model, grads, SGD.lr)
    for rank, result in enumerate(parallel_results):
        got = result[mode]
        assert got["version"] == 1
        torch.testing.assert_close(got["loss"], ref_loss, msg=f"{mode} rank {rank} loss")
        assert got["stepped"].keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(got["stepped"][name], value, msg=f"{mode} rank {rank} {name}")


def test_parallel_named_weights_gather_one_tensor_at_a_time(parallel_results):
    want_names = hf_state_names(tiny_model())
    for result in parallel_results:
        names, equal, peak = result["named_weights"]
        largest = result["largest_bytes"]
        assert names == want_names and equal
        assert largest <= peak <= largest + SLACK_BYTES, (peak, largest)


def test_parallel_offload_onload_equals_never_offloaded(parallel_results):
    for result in parallel_results:
        check_offload(*result["offload"])


def test_objective_sees_compute_dtype_under_autocast():
    """fp32 masters with bf16 compute in one process: the objective gets bf16 hidden states and head
    weight (as under FSDP's mixed precision and the roundpipe engine), not the fp32 master, so its own
    GEMMs run in the compute dtype; gradients still reach the fp32 master."""
    seen: list[tuple[torch.dtype, torch.dtype]] = []

    def objective(hidden, head_weight, batch):
        seen.append((hidden.dtype, head_weight.dtype))
        return WeightedTokenLoss()(hidden, head_weight, batch)

    torch.manual_seed(0)
    engine = FSDPEngine(tiny_model(), device=torch.device("cpu"), dtype=torch.bfloat16,
                        optimizer_dtype=torch.float32, optim=SGD)  # fmt: skip
    batches = packed_batches(VOCAB)
    engine.forward_backward(batches, objective, normalizer=10.0)
    assert seen == [(torch.bfloat16, torch.bfloat16)] * len(batches)
    head = engine.model.get_output_embeddings().weight
    assert head.dtype == torch.float32 and head.grad is not None and head.grad.abs().sum() > 0
