"""Colocated updates: `fill_in_place` equals `load_state_dict` of the new weights into a copy.

Sources: another model's Hugging Face state, and a roundpipe engine after training steps
(synchronous and asynchronous), whose `named_weights` in the compute dtype hands out the
current upload copies themselves: the right one of the two asynchronous buffers, holding the
masters rounded bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from protocol_reference import packed_batches
from tiny import tiny_qwen3_config
from torch import nn
from transformers import AutoModelForCausalLM

from laden.engine.roundpipe import ModelExecutePlan, RoundPipeEngine
from laden.model.hf.export import hf_state_names
from laden.optim import OptimSettings
from laden.weights import fill_in_place

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
BATCHES = packed_batches(VOCAB, num_micro_batches=2, docs_per_mb=2, seed=5)
NUM_LOSS_TOKENS = sum(mb.num_loss_tokens for mb in BATCHES)
STAGED = ModelExecutePlan.uniform(5, stage_layers=2, fused_layers=1)  # embedding + 3 layers + head
ADAM = OptimSettings(lr=1e-2, eps=1e-3, weight_decay=0.1, gradient_clipping=0.5, total_steps=4)


def tiny_model(seed: int, *, tied: bool = True, dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = tiny_qwen3_config(vocab_size=VOCAB, num_hidden_layers=3)
    cfg.tie_word_embeddings = tied
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def engine_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """A rollout engine's weights as `fill_in_place` takes them: its parameters by HF name."""
    state = model.state_dict(keep_vars=True)
    return {name: state[name] for name in hf_state_names(model)}


def loaded_copy(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """The reference: `load_state_dict` of the new weights into a copy (tied targets follow their source)."""
    reference = copy.deepcopy(model)
    result = reference.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"}
    return reference


def assert_same_state(got: nn.Module, want: nn.Module) -> None:
    want_state = want.state_dict()
    for name, t in got.state_dict().items():
        assert t.dtype == want_state[name].dtype and torch.equal(t, want_state[name]), name


@pytest.mark.parametrize("tied", [True, False])
def test_fill_in_place_equals_load_state_dict(tied):
    rollout, trainer = tiny_model(0, tied=tied), tiny_model(1, tied=tied)
    new_state = {name: trainer.state_dict()[name] for name in hf_state_names(trainer)}
    want = loaded_copy(rollout, new_state)
    params = engine_params(rollout)
    storages = {name: t.data_ptr() for name, t in params.items()}
    num_bytes = fill_in_place(((n, t.clone()) for n, t in new_state.items()), params)
    assert num_bytes == sum(t.nbytes for t in new_state.values())
    assert {name: t.data_ptr() for name, t in engine_params(rollout).items()} == storages  # in place
    assert_same_state(rollout, want)


@pytest.mark.parametrize("optim_step", ["sync", "async"])
@pytest.mark.parametrize("num_steps", [1, 2])
def test_roundpipe_update_equals_loading_its_rounded_masters(optim_step, num_steps):
    engine = RoundPipeEngine(
        tiny_model(0), optim=ADAM, compute_dtype=torch.bfloat16, optimizer_dtype=torch.float32,
        execute_plan=STAGED, optim_step=optim_step,
    )  # fmt: skip
    for _ in range(num_steps):
        engine.train_batch(BATCHES, global_num_loss_tokens=NUM_LOSS_TOKENS)
    masters = engine.state_dict()["model"]
    rollout = tiny_model(1, dtype=torch.bfloat16)
    want = loaded_copy(rollout, {name: m.to(torch.bfloat16) for name, m in masters.items()})
    fill_in_place(engine.named_weights(), engine_params(rollout), overlap=True)
    assert_same_state(rollout, want)


@pytest.mark.parametrize("optim_step", ["sync", "async"])
def test_roundpipe_hands_out_the_current_upload_copies(optim_step):
    """Compute dtype asked: each trained weight is a view of the upload buffer the last update wrote
    (async: not the one the next step reads, which is one update old)."""
    engine = RoundPipeEngine(
        tiny_model(0), optim=ADAM, compute_dtype=torch.bfloat16, optimizer_dtype=torch.float32,
        execute_plan=STAGED, optim_step=optim_step,
    )  # fmt: skip
    engine.train_batch(BATCHES, global_num_loss_tokens=NUM_LOSS_TOKENS)
    current = 0  # sync: always; async: step 1 wrote the buffer it read (0), the next step reads 1
    by_name = {hp.name: hp for hp in engine.pipe.store.params}
    masters = engine.state_dict()["model"]
    stale = 0  # async: weights whose other upload buffer differs
    for name, t in engine.named_weights():
        hp = by_name[name]
        assert t.data_ptr() == hp.uploads[current].data_ptr(), name
        assert torch.equal(t, masters[name].to(torch.bfloat16)), name
        if optim_step == "async":
            stale += not torch.equal(hp.uploads[1], t)
    if optim_step == "async":  # buffer 1 really is one update old (some norm weights round the same)
        assert stale > len(by_name) // 2, (stale, len(by_name))
    for name, t in engine.named_weights(torch.float32):  # another dtype: the masters, as before
        assert t.data_ptr() == masters[name].data_ptr(), name


def test_mismatches_name_the_weight():
    rollout, trainer = tiny_model(0), tiny_model(1)
    new_state = {name: trainer.state_dict()[name] for name in hf_state_names(trainer)}
    params = engine_params(rollout)
    with pytest.raises(ValueError, match=r"'model.norm.weight' is \[3\] in the source but \[64\]"):
        fill_in_place({"model.norm.weight": torch.zeros(3)}, params)
    with pytest.raises(ValueError, match="'head.bias' has no destination"):
        fill_in_place({"head.bias": torch.zeros(3)}, params)
    with pytest.raises(ValueError, match=r"'model.norm.weight' was given twice \(1 weights before"):
        fill_in_place([("model.norm.weight", torch.zeros(64))] * 2, params)
    partial = {"model.norm.weight": new_state["model.norm.weight"]}
    with pytest.raises(ValueError, match=f"no value for {len(params) - 1} engine weight"):
        fill_in_place(partial, params)
    assert fill_in_place(partial, params, strict=False) == 64 * 4


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_pinned_host_to_device_update_is_complete_on_return(overlap):
    """Non-blocking copies from pinned memory: every one has landed when `fill_in_place` returns,
    even from a source that reuses one pinned buffer for every tensor."""
    state = {f"w{i}": torch.randn(256, 256) for i in range(4)}
    params = {name: torch.zeros(256, 256, device="cuda") for name in state}
    buffer = torch.empty(256, 256, pin_memory=True)

    def reused():
        for name, t in state.items():
            buffer.copy_(t)
            yield name, buffer

    if overlap:  # sources that stay valid: all copies queued, one wait
        pinned = {name: t.pin_memory() for name, t in state.items()}
        sources = iter(pinned.items())
    else:
        sources = reused()
    fill_in_place(sources, params, overlap=overlap)
    for name, t in state.items():
        assert torch.equal(params[name].cpu(), t), name


@pytest.mark.gpu
@pytest.mark.parametrize("optim_step", ["sync", "async"])
def test_roundpipe_update_of_a_gpu_engine_is_a_pinned_copy(optim_step):
    """On a GPU machine the upload copies handed out are page-locked, so the update is a pure pinned
    host-to-device copy; it equals loading the rounded masters."""
    engine = RoundPipeEngine(
        tiny_model(0), optim=ADAM, compute_dtype=torch.bfloat16, optimizer_dtype=torch.float32,
        execute_plan=STAGED, optim_step=optim_step, pin_model="alloc", devices=[torch.device("cuda", 0)],
    )  # fmt: skip
    engine.train_batch(BATCHES, global_num_loss_tokens=NUM_LOSS_TOKENS)
    assert all(t.is_pinned() for _, t in engine.named_weights())
    masters = engine.state_dict()["model"]
    rollout = tiny_model(1, dtype=torch.bfloat16).cuda()
    want = loaded_copy(rollout, {name: m.to(torch.bfloat16) for name, m in masters.items()})
    fill_in_place(engine.named_weights(), engine_params(rollout), overlap=True)
    assert_same_state(rollout, want)
