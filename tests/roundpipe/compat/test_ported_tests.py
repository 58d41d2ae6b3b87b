"""RoundPipe's own test suite (`tests/`), ported to laden through its public API.

`tests/test_batch.py` drives RoundPipe's internal `Batch` class; here the same inputs go
through `RoundPipe.forward` / `forward_backward` on an echo layer, so what is compared is
the split and merge a user sees. The model tests (`tests/models/`) train real checkpoints
against stored losses; here they run tiny random-init models against a plain PyTorch loop.
"""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
from torch import nn

from laden import RoundPipe, RoundPipeRunConfig

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- tests/test_roundpipe.py ------------------------------------------------------------------


@pytest.mark.parametrize("auto, designate", list(itertools.product([False, True], [True, False])))
def test_roundpipe_attribute_shim(auto, designate):
    """tests/test_roundpipe.py::test_RoundPipe_attribute_shim: writes and deletes reach the original model."""
    import laden

    model_class = laden.AutoRoundPipe if auto else RoundPipe
    original = nn.Linear(10, 5)
    if designate:
        wrapped = model_class(nn.Linear(10, 5))
        wrapped.set_original_model(original)
    else:
        wrapped = model_class(original)
    obj = {"dict": 123}
    wrapped.var1 = 42
    wrapped.var2 = obj
    assert original.var1 == 42 and original.var2 is obj
    assert wrapped.var1 == 42 and wrapped.var2 is obj
    del wrapped.var1
    del wrapped.var2
    assert not hasattr(original, "var1") and not hasattr(original, "var2")
    assert not hasattr(wrapped, "var1") and not hasattr(wrapped, "var2")


# ---- tests/test_optim.py ------------------------------------------------------------------------


def run_optim(cls, ref_cls, **optim_kwargs) -> None:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, n + 1, n + 2, generator=gen) for n in range(1, 5)]
    params += [torch.randn(n, generator=gen) for n in range(0, 70, 7)]
    params += [torch.randn(n, dtype=torch.complex64, generator=gen) for n in range(0, 70, 7)]
    random.Random(0).shuffle(params)
    params = [p.requires_grad_(True) for p in params]
    ref_params = [p.clone().detach().requires_grad_(True) for p in params]
    optimizer, ref_optimizer = cls(params, **optim_kwargs), ref_cls(ref_params, **optim_kwargs)
    for _ in range(5):
        for p, ref_p in zip(params, ref_params):
            p.grad = torch.randn(p.shape, dtype=p.dtype, generator=gen)
            ref_p.grad = p.grad.clone()
        optimizer.step()
        ref_optimizer.step()
        for p, ref_p in zip(params, ref_params):
            assert torch.allclose(p, ref_p, atol=1e-6)


@pytest.mark.parametrize(
    "lr_betas, weight_decay, amsgrad, maximize, decoupled_weight_decay",
    itertools.product(
        [(0.01, 0.9, 0.999), (torch.tensor(0.001), torch.tensor(0.8), torch.tensor(0.95))],
        [0.0, 0.01],
        [True, False],
        [True, False],
        [True, False],
    ),
)
def test_adam(lr_betas, weight_decay, amsgrad, maximize, decoupled_weight_decay):
    """tests/test_optim.py::test_Adam: laden.optim.Adam equals torch.optim.Adam (real, complex, odd sizes)."""
    from laden.optim import Adam

    lr, *betas = lr_betas
    run_optim(
        Adam, torch.optim.Adam, lr=lr, betas=tuple(betas), eps=1e-4, weight_decay=weight_decay,
        amsgrad=amsgrad, maximize=maximize, decoupled_weight_decay=decoupled_weight_decay,
    )  # fmt: skip


# ---- tests/test_batch.py ------------------------------------------------------------------------


class Echo(nn.Module):
    """Returns its inputs unchanged: forward(...) shows how they were split and merged back."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []

    def forward(self, *args, **kwargs):
        self.seen.append((args, kwargs))
        return args, kwargs


@pytest.mark.parametrize("num_microbatch", [2, 3, 4])
def test_io_auto(num_microbatch):
    """tests/test_batch.py::test_io_auto (without RoundPipePackedData): nested inputs split on dim 0 and merged back."""
    args = (
        torch.tensor(233),
        torch.randn(12, 3, 4),
        (torch.randn(12, 6), torch.randn(12, 7), "string in tuple"),
        [torch.randn(12, 6), torch.randn(12, 7), "string in list"],
        {"a": torch.randn(12, 8), "string": "string in dict"},
        "non-tensor argument",
        42,
    )
    kwargs = {
        "x": torch.randn(12, 10),
        "y": [torch.randn(12, 11), "string in list"],
        "z": {"inner_tensor": torch.randn(6, 12), "inner_string": "inner string"},
        "non_tensor": 3.14,
        "tuple_arg": (torch.randn(12, 5, 6), "string in tuple"),
    }
    echo = Echo()
    rp = RoundPipe(nn.Sequential(echo))
    with torch.no_grad():
        args_out, kwargs_out = rp(
            *args, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch), **kwargs
        )
    assert len(echo.seen) == num_microbatch
    assert args_out[0] == args[0]
    torch.testing.assert_close(args_out[1], args[1])
    for i in (2, 3):
        torch.testing.assert_close(args_out[i][0], args[i][0])
        torch.testing.assert_close(args_out[i][1], args[i][1])
        assert args_out[i][2] == args[i][2]
    torch.testing.assert_close(args_out[4]["a"], args[4]["a"])
    assert args_out[4]["string"] == args[4]["string"] and args_out[5:] == args[5:]
    torch.testing.assert_close(kwargs_out["x"], kwargs["x"])
    torch.testing.assert_close(kwargs_out["y"][0], kwargs["y"][0])
    assert kwargs_out["y"][1] == kwargs["y"][1]
    # not batch-sized: replicated to every micro-batch, then concatenated like any tensor output
    torch.testing.assert_close(
        kwargs_out["z"]["inner_tensor"], torch.cat([kwargs["z"]["inner_tensor"]] * num_microbatch)
    )
    assert kwargs_out["z"]["inner_string"] == kwargs["z"]["inner_string"]
    assert kwargs_out["non_tensor"] == kwargs["non_tensor"]
    torch.testing.assert_close(kwargs_out["tuple_arg"][0], kwargs["tuple_arg"][0])
    assert kwargs_out["tuple_arg"][1] == kwargs["tuple_arg"][1]


@pytest.mark.parametrize("num_microbatch", [2, 3, 4])
def test_io_auto_labels(num_microbatch):
    """tests/test_batch.py::test_io_auto, label part: (scalar, batch tensor, int) -> scalar and int replicated, tensor split."""
    seen: list = []

    def loss_fn(out, label):
        seen.append(label)
        return out.sum() * label[0]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1))
    ref = copy.deepcopy(model)
    label = (torch.tensor(2.0), torch.randn(12, 3, 4), 42)
    x = torch.randn(12, 4)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch))
    rp.forward_backward(input_args=(x,), label=label, loss_fn=loss_fn)
    rp.synchronize()
    size = 12 // num_microbatch
    assert len(seen) == num_microbatch
    for i, (scalar, part, number) in enumerate(seen):
        assert scalar == label[0] and number == label[2]
        torch.testing.assert_close(part, label[1][i * size : (i + 1) * size])
    (ref(x).sum() * label[0]).backward()
    torch.testing.assert_close(model[0].weight.grad, ref[0].weight.grad)


@pytest.mark.parametrize("num_microbatch", [2, 3, 4])
def test_io_spec(num_microbatch):
    """tests/test_batch.py::test_io_spec (without RoundPipePackedData): spec-driven split of args, kwargs, labels and merge."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate, sum_reducer

    args = (torch.tensor(233), torch.randn(3, 12, 4))
    kwargs = {"x": torch.randn(10, 12), "non_tensor": "hello"}
    cfg = RoundPipeRunConfig(
        num_microbatch=num_microbatch,
        split_input=((_Replicate, TensorChunkSpec(1)), {"x": TensorChunkSpec(0), "non_tensor": _Replicate}),
        merge_output=((sum_reducer, TensorChunkSpec(1)), {"x": TensorChunkSpec(0), "non_tensor": None}),
    )
    rp = RoundPipe(nn.Sequential(Echo()))
    with torch.no_grad():
        args_out, kwargs_out = rp(*args, roundpipe_run_config=cfg, **kwargs)
    assert args_out[0] == args[0] * num_microbatch
    torch.testing.assert_close(args_out[1], args[1])
    torch.testing.assert_close(kwargs_out["x"], kwargs["x"])
    assert kwargs_out["non_tensor"] == kwargs["non_tensor"]


@pytest.mark.parametrize("num_microbatch", [1, 2, 3, 4])
def test_out_packed(num_microbatch):
    """tests/test_batch.py::test_out_packed: merge_output=False returns every leaf as a per-micro-batch list."""
    args = (torch.tensor(233), torch.randn(12, 3, 4))
    kwargs = {"x": torch.randn(12, 10), "non_tensor": "hello"}
    rp = RoundPipe(nn.Sequential(Echo()))
    with torch.no_grad():
        args_out, kwargs_out = rp(
            *args,
            roundpipe_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch, merge_output=False),
            **kwargs,
        )
    chunks, x_chunks = torch.chunk(args[1], num_microbatch), torch.chunk(kwargs["x"], num_microbatch)
    for i in range(num_microbatch):
        assert args_out[0][i] == args[0]
        torch.testing.assert_close(args_out[1][i], chunks[i])
        torch.testing.assert_close(kwargs_out["x"][i], x_chunks[i])
        assert kwargs_out["non_tensor"][i] == kwargs["non_tensor"]


def test_guess_from_packed_data():
    """tests/test_batch.py::test_guess_from_packed_data: an unmerged output fed back in is split per micro-batch."""
    rp = RoundPipe(nn.Sequential(Echo()))
    x, replicate = torch.randn(32, 9), torch.randn(5, 6)
    cfg = RoundPipeRunConfig(num_microbatch=4, merge_output=False)
    with torch.no_grad():
        (packed,), _ = rp(x, roundpipe_run_config=cfg)
        (merged,), kwargs_out = rp(
            packed, to_replicate=replicate, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=4)
        )
    torch.testing.assert_close(merged, x)
    torch.testing.assert_close(kwargs_out["to_replicate"], torch.cat([replicate] * 4))


def test_none():
    """tests/test_batch.py::test_none: a None argument passes through; no kwargs stay no kwargs."""
    echo = Echo()
    rp = RoundPipe(nn.Sequential(echo))
    with torch.no_grad():
        args_out, kwargs_out = rp(None, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=3))
    assert args_out == (None,) and kwargs_out == {}
    assert echo.seen == [((None,), {})]


# ---- tests/models/ (tiny random-init configs instead of checkpoints) -------------------------------


def tiny_causal_lm(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, use_cache=False, pad_token_id=0,
    )  # fmt: skip
    if family == "qwen3":
        config = Qwen3Config(**common)
    elif family == "llama":
        config = LlamaConfig(**common)
    elif family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        config = Qwen3MoeConfig(
            **common, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1
        )
    else:
        from transformers import GptOssConfig

        config = GptOssConfig(
            **{**common, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2
        )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).float()


def lm_batches(num: int = 3, batch: int = 4, seq: int = 8):
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(num):
        ids = torch.randint(1, 64, (batch, seq), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, -2:] = 0  # one padded row, as the tokenized MATH-500 batches have
        ids[0, -2:] = 0
        labels = ids.clone()
        labels[mask == 0] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def reference_losses(family: str, *, num_microbatch: int, stale: bool, lr: float = 1e-3):
    """Plain PyTorch: micro-batch losses (token-sum / tokens of the batch), Adam, optionally one step stale."""
    ref = reference_model = tiny_causal_lm(family)
    opt = torch.optim.Adam(ref.parameters(), lr=lr)
    evaluator = copy.deepcopy(ref)
    previous = copy.deepcopy(ref.state_dict())
    losses = []
    for batch in lm_batches():
        net = ref
        if stale:
            evaluator.load_state_dict(previous)
            previous = copy.deepcopy(ref.state_dict())
            evaluator.zero_grad()
            net = evaluator
        loss = net(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        ).loss
        loss.backward()
        losses.append(loss.item())
        if stale:
            for p, q in zip(ref.parameters(), evaluator.parameters()):
                p.grad = None if q.grad is None else q.grad.clone()
        opt.step()
        opt.zero_grad()
    return reference_model, losses


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_causal_lm_classic(family):
    """tests/models/test_qwen3.py::test_qwen3_miniumn, test_llama.py::test_llama3_classic: model(**inputs).logits, loss.backward(), synchronize, step."""
    raw = tiny_causal_lm(family)
    model = RoundPipe(raw, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    optim = torch.optim.Adam(raw.parameters(), lr=1e-3)
    losses = []
    for input_dict in lm_batches():
        input_dict = dict(input_dict)
        labels = input_dict.pop("labels")
        logits = model(**input_dict).logits
        loss = raw.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)
        loss.backward()
        losses.append(loss.item())
        model.synchronize()
        optim.step()
        optim.zero_grad()
    _, ref_losses = reference_losses(family, num_microbatch=2, stale=False)
    assert losses == pytest.approx(ref_losses, rel=1e-4)


@pytest.mark.parametrize("is_async, recompute_grain", [(True, "stage"), (False, "stage"), (True, "layer")])
def test_qwen3_fused(is_async, recompute_grain):
    """tests/models/test_qwen3.py::test_qwen3_fused: preset model, input_kwargs with labels, loss_fn=scaler.scale(output.loss)."""
    from laden import GradScaler, wrap_model_to_roundpipe
    from laden.optim import Adam

    raw = tiny_causal_lm("qwen3")
    model = wrap_model_to_roundpipe(
        raw, model_run_config=RoundPipeRunConfig(num_microbatch=1, recompute_grain=recompute_grain),
        use_sequential_preset=True, optim_dtype=torch.float32,
    )  # fmt: skip
    optim = Adam(model.optim_parameters(), lr=1e-3)
    scaler = GradScaler(8192.0)
    losses = []
    for input_dict in lm_batches():
        num_items_in_batch = (input_dict["labels"][..., 1:] != -100).sum().item()
        loss = model.forward_backward(
            input_kwargs={**input_dict, "return_logits": False, "num_items_in_batch": num_items_in_batch},
            loss_fn=lambda output, _: scaler.scale(output.loss),
        )
        losses.append(loss.item() / scaler.get_scale())
        model.step(lambda: (scaler.step(optim), optim.zero_grad(), None)[-1], is_async=is_async)
        scaler.update()
    _, ref_losses = reference_losses("qwen3", num_microbatch=1, stale=is_async)
    assert losses == pytest.approx(ref_losses, rel=1e-4)


def test_qwen3_fused_with_roundpipe_today():
    """tests/models/test_qwen3.py::test_qwen3_fused with what laden has today: RoundPipe(raw), torch Adam, model.loss_function on outputs.logits."""
    raw = tiny_causal_lm("qwen3")
    model = RoundPipe(raw, model_run_config=RoundPipeRunConfig(num_microbatch=2), optim_dtype=torch.float32)
    optim = torch.optim.Adam(model.optim_parameters(), lr=1e-3)
    losses = []
    for input_dict in lm_batches():
        labels = input_dict["labels"]
        num_items_in_batch = (labels[..., 1:] != -100).sum()
        loss = model.forward_backward(
            input_kwargs={
                "input_ids": input_dict["input_ids"],
                "attention_mask": input_dict["attention_mask"],
            },
            label=labels,
            loss_fn=lambda output, lab, n=num_items_in_batch: raw.loss_function(
                logits=output.logits, labels=lab, vocab_size=raw.config.vocab_size, num_items_in_batch=n
            ),
        )
        losses.append(loss.item())
        model.step(lambda: (optim.step(), optim.zero_grad(), None)[-1])
    model.synchronize()
    ref, ref_losses = reference_losses("qwen3", num_microbatch=2, stale=True)
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    for (name, p), p_ref in zip(raw.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, p_ref, msg=name, atol=1e-5, rtol=1e-4)


def test_qwen3_fused_accumulate():
    """tests/models/test_qwen3.py::test_qwen3_fused_accumulate: one forward_backward per row, one step per batch."""
    from laden import GradScaler, wrap_model_to_roundpipe
    from laden.optim import Adam

    model = wrap_model_to_roundpipe(
        tiny_causal_lm("qwen3"), model_run_config=RoundPipeRunConfig(num_microbatch=1), use_sequential_preset=True,
        optim_dtype=torch.float32,
    )  # fmt: skip
    optim = Adam(model.optim_parameters(), lr=1e-3)
    scaler = GradScaler(8192.0)
    losses = []
    for input_dict in lm_batches():
        num_items_in_batch = (input_dict["labels"][..., 1:] != -100).sum().item()
        loss = 0.0
        for row in range(input_dict["input_ids"].shape[0]):
            mb = {k: v[row : row + 1] for k, v in input_dict.items()}
            mb_loss = model.forward_backward(
                input_kwargs={**mb, "return_logits": False, "num_items_in_batch": num_items_in_batch},
                loss_fn=lambda output, _: scaler.scale(output.loss),
            )
            loss += mb_loss.item()
        losses.append(loss / scaler.get_scale())
        model.step(lambda: (scaler.step(optim), optim.zero_grad(), None)[-1])
        scaler.update()
    _, ref_losses = reference_losses("qwen3", num_microbatch=1, stale=True)
    assert losses == pytest.approx(ref_losses, rel=1e-4)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("use_preset", [False, True], ids=["auto", "preset"])
def test_moe_forward(family, use_preset):
    """tests/models/test_qwen3moe.py and test_gpt_oss.py (auto_forward, preset_forward): logits and aux_loss equal the plain model's."""
    from laden import wrap_model_to_roundpipe

    raw, ref = tiny_causal_lm(family), tiny_causal_lm(family)
    model = wrap_model_to_roundpipe(
        raw, model_run_config=RoundPipeRunConfig(num_microbatch=2), use_sequential_preset=use_preset
    )
    batch = lm_batches(1)[0]
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        out = model(**inputs, output_router_logits=True)
        expected = ref(**inputs, output_router_logits=True)
    torch.testing.assert_close(out.logits, expected.logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.aux_loss, expected.aux_loss, atol=1e-6, rtol=1e-5)
    assert len(out.router_logits) == len(expected.router_logits)
    for got, want in zip(out.router_logits, expected.router_logits):  # whole-batch rows, per layer
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    with pytest.raises(NotImplementedError, match="under grad mode"):  # no graph through the routers
        model(**inputs, output_router_logits=True)
