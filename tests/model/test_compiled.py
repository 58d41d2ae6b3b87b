"""Compiled decoder layers (`laden.model.patches.compiled`) == eager, in a model and in the roundpipe engine.

The compile backend here is `aot_eager`: Dynamo's capture and AOTAutograd's forward/backward
split with eager kernels, fast on a 2-core CPU and exact, so the tests check the plumbing
(class swap, shells, one compiled code for every layer, graph breaks at attention) with
tight tolerances (AOTAutograd's backward graph may sum the same gradient terms in another
order: fp32 rounding, not a different result). `inductor` (the default, what `actor.roundpipe.compile` uses) generates fused kernels
on top of the same capture.
"""

from __future__ import annotations

import copy

import pytest
import torch
from roundpipe_cases import SMALL_STAGES, make_steps, settings, tied_model
from tiled_cases import _lm_step
from tiny import tiny_qwen3_config
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from laden.engine.roundpipe import RoundPipeEngine
from laden.model.attention import set_attention
from laden.model.patches.compiled import compiled_layer_count, disable_compiled_layers, enable_compiled_layers

TIGHT = dict(rtol=1e-5, atol=1e-6)
pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:the largest layer needs .* activations of:UserWarning"),
]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _model(num_layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=64, num_hidden_layers=num_layers))
    set_attention(model, "auto")
    return model


def test_compiled_model_equals_eager_and_shares_one_compiled_code():
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    eager = _model(4)
    compiled = copy.deepcopy(eager)
    assert enable_compiled_layers(compiled, backend="aot_eager") == 4
    assert enable_compiled_layers(compiled, backend="aot_eager") == 4  # again: nothing changes
    assert compiled_layer_count(compiled) == 4
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    loss_e, grads_e = _lm_step(eager, ids)
    loss_c, grads_c = _lm_step(compiled, ids)
    torch.testing.assert_close(loss_c, loss_e, **TIGHT)
    assert grads_c.keys() == grads_e.keys()
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, **TIGHT, msg=name)
    graphs_for_4 = counters["stats"]["unique_graphs"]
    assert graphs_for_4 > 0  # it did compile
    # A model with twice the layers compiles no more graphs: the code is shared, not per layer.
    torch._dynamo.reset()
    counters.clear()
    deeper = _model(8)
    enable_compiled_layers(deeper, backend="aot_eager")
    _lm_step(deeper, ids)
    assert counters["stats"]["unique_graphs"] == graphs_for_4
    assert disable_compiled_layers(compiled) == 4 and compiled_layer_count(compiled) == 0
    torch.testing.assert_close(_lm_step(compiled, ids)[0], loss_e, rtol=0, atol=0)  # eager again


def test_bad_backend_and_non_causal_lm_are_refused():
    with pytest.raises(ValueError, match="backend=''"):
        enable_compiled_layers(_model(1), backend="")
    with pytest.raises(ValueError, match="no decoder layers"):
        enable_compiled_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_roundpipe_engine_with_compiled_layers_equals_eager(grain):
    """Shells bound to streamed weights stay compiled; losses and trained weights equal the eager engine's."""
    steps = make_steps(3)
    kwargs = dict(optim=settings(), recompute_grain=grain, model_memory_limit=SMALL_STAGES, num_microbatch=2)
    eager = RoundPipeEngine(tied_model(), **kwargs)
    compiled = RoundPipeEngine(tied_model(), compile_backend="aot_eager", **kwargs)
    assert compiled_layer_count(compiled.model) == 3
    for mbs in steps:
        tokens = sum(mb.num_loss_tokens for mb in mbs)
        a = eager.train_batch(mbs, global_num_loss_tokens=tokens)["loss"]
        b = compiled.train_batch(mbs, global_num_loss_tokens=tokens)["loss"]
        torch.testing.assert_close(b, a, **TIGHT)
    for name, t in eager.state_dict()["model"].items():
        torch.testing.assert_close(compiled.state_dict()["model"][name], t, **TIGHT, msg=name)
    assert counters["stats"]["unique_graphs"] > 0


def test_compiled_layers_survive_copies_and_pickling():
    import pickle

    model = _model(2)
    enable_compiled_layers(model, backend="aot_eager")
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert compiled_layer_count(clone) == 2
        assert type(clone.model.layers[0]) is type(model.model.layers[0])  # the same compiled class
        for (name, a), (_, b) in zip(model.state_dict().items(), clone.state_dict().items()):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
