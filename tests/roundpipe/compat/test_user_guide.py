"""The RoundPipe user guide, case by case, on laden (CPU as the device, tiny fp32 models).

Each case runs the guide's code with `laden` in place of `roundpipe` and compares it with a
plain PyTorch reference written in the test. The first line of every docstring names the
guide page and section (`docs/UserGuide/...`); README.md in this folder lists every case.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._pytree import register_pytree_node

from laden import ModelExecutePlan, RoundPipe, RoundPipeRunConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 32),
        nn.Tanh(),
        nn.Linear(32, 32),
        nn.GELU(),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Linear(32, 4),
    )


def mse_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum()


def batches(num: int, batch: int = 6, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 8, generator=gen), torch.randn(batch, 4, generator=gen)) for _ in range(num)]


def chunked_loss(model: nn.Module, x, y, num_microbatch: int, loss_fn=mse_sum) -> torch.Tensor:
    """The reference of `forward_backward`: loss_fn per micro-batch, summed."""
    return sum(loss_fn(model(xc), yc) for xc, yc in zip(x.chunk(num_microbatch), y.chunk(num_microbatch)))


def assert_params_close(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, p_ref, msg=name)


def assert_grads_close(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, p_ref.grad, msg=name)


def stale_reference(ref: nn.Module, make_opt, data, loss_of) -> None:
    """Asynchronous `step`: update k applies the gradients computed on the weights before update k-1."""
    opt = make_opt(ref.parameters())
    evaluator = copy.deepcopy(ref)
    previous = copy.deepcopy(ref.state_dict())
    for x, y in data:
        evaluator.load_state_dict(previous)
        previous = copy.deepcopy(ref.state_dict())
        evaluator.zero_grad()
        loss_of(evaluator, x, y).backward()
        for p, q in zip(ref.parameters(), evaluator.parameters()):
            p.grad = q.grad.clone()
        opt.step()
        opt.zero_grad()


# ---- overview.en.md ----------------------------------------------------------------------


def test_overview_training_loop_is_one_step_stale():
    """overview.en.md, "Sequential Code, Parallel Run": the forward_backward + step loop (asynchronous step).

    Parameters after four asynchronous steps equal a plain loop whose gradients are taken one update late.
    """
    data = batches(4)
    model, ref = mlp(), mlp()
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    optimizer = torch.optim.Adam(rp.optim_parameters(), lr=1e-2)
    for x, y in data:
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
        rp.step(lambda: (optimizer.step(), optimizer.zero_grad()))
    rp.synchronize()
    stale_reference(
        ref, lambda p: torch.optim.Adam(p, lr=1e-2), data, lambda m, x, y: chunked_loss(m, x, y, 2)
    )
    assert_params_close(model, ref)


def test_overview_loss_is_sum_of_microbatch_losses():
    """overview.en.md, "Input Splitting and Microbatch Execution": returned loss and gradients are sums over micro-batches."""
    model, ref = mlp(), mlp()
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    rp = RoundPipe(model)
    loss = rp.forward_backward(
        input_args=(x,), label=y, loss_fn=mse_sum, run_config=RoundPipeRunConfig(num_microbatch=3)
    )
    rp.synchronize()
    ref_loss = chunked_loss(ref, x, y, 3)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)


def test_overview_mean_loss_by_dividing_by_num_microbatch():
    """overview.en.md, "Input Splitting and Microbatch Execution": criterion / num_microbatch == full-batch mean loss."""
    model, ref = mlp(), mlp()
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    criterion, num_microbatch = nn.MSELoss(), 4
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch))
    loss = rp.forward_backward(
        input_args=(x,), label=y, loss_fn=lambda outputs, labels: criterion(outputs, labels) / num_microbatch
    )
    rp.synchronize()
    ref_loss = criterion(ref(x), y)  # one batch, one mean
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)


# ---- BasicUsage/training_loop.en.md --------------------------------------------------------


class MaskedInput(nn.Module):
    """A first layer that takes keyword arguments, like a Hugging Face model's input_ids/attention_mask."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 32)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.proj(input_ids)
        return h if attention_mask is None else h * attention_mask


def kwargs_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(MaskedInput(), nn.Tanh(), nn.Linear(32, 4))


def test_training_loop_input_kwargs():
    """training_loop.en.md, "forward_backward()": input_kwargs={"input_ids": ..., "attention_mask": ...}."""
    model, ref = kwargs_model(), kwargs_model()
    ids, mask, y = torch.randn(6, 8), (torch.rand(6, 32) > 0.3).float(), torch.randn(6, 4)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    loss = rp.forward_backward(
        input_kwargs={"input_ids": ids, "attention_mask": mask}, label=y, loss_fn=mse_sum
    )
    rp.synchronize()
    ref_loss = sum(
        mse_sum(ref[1:](ref[0](input_ids=i, attention_mask=m)), t)
        for i, m, t in zip(ids.chunk(3), mask.chunk(3), y.chunk(3))
    )
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)


def test_training_loop_return_outputs():
    """training_loop.en.md, "forward_backward()": loss, outputs = forward_backward(..., return_outputs=True)."""
    model, ref = mlp(), mlp()
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    loss, outputs = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, return_outputs=True)
    torch.testing.assert_close(outputs, ref(x).detach())
    torch.testing.assert_close(loss, chunked_loss(ref, x, y, 2).detach())


def test_training_loop_per_call_run_config():
    """training_loop.en.md, "forward_backward()": run_config overrides the model-level config for one call."""
    sizes: list[int] = []

    def recording(out, y):
        sizes.append(out.shape[0])
        return mse_sum(out, y)

    rp = RoundPipe(mlp(), model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    rp.forward_backward(input_args=(x,), label=y, loss_fn=recording)
    assert sizes == [6, 6]
    sizes.clear()
    rp.forward_backward(
        input_args=(x,), label=y, loss_fn=recording, run_config=RoundPipeRunConfig(num_microbatch=4)
    )
    assert sizes == [3, 3, 3, 3]


def test_training_loop_synchronous_step_is_exact():
    """training_loop.en.md, "model.step()": is_async=False blocks; every iteration uses the newest weights."""
    data = batches(3)
    model, ref = mlp(), mlp()
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    optimizer = torch.optim.AdamW(rp.optim_parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def step_fn():
        optimizer.step()
        optimizer.zero_grad()

    for x, y in data:
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
        rp.step(step_fn, is_async=False)
        chunked_loss(ref, x, y, 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_params_close(model, ref)  # no synchronize needed after synchronous steps


def test_training_loop_gradient_clipping_in_step_fn():
    """training_loop.en.md, "model.step()": clip_grad_norm_ on optimizer.param_groups[0]['params'] inside step_fn."""
    model, ref = mlp(), mlp()
    x, y = torch.randn(6, 8), 10 * torch.randn(6, 4)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    optimizer = torch.optim.SGD(rp.optim_parameters(), lr=0.1)

    def step_fn():
        torch.nn.utils.clip_grad_norm_(optimizer.param_groups[0]["params"], max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()

    rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
    rp.step(step_fn, is_async=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    chunked_loss(ref, x, y, 2).backward()
    assert torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm=1.0) > 1.0  # clipping bites
    ref_opt.step()
    assert_params_close(model, ref)


def test_training_loop_parameters_redirected_inside_step_fn():
    """training_loop.en.md, "parameter() redirection": inside step_fn, model.parameters() are the optimizer parameters."""
    model, ref = mlp(), mlp()
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    optimizer = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    masters = {id(p) for p in rp.optim_parameters()}
    seen: list[bool] = []

    def step_fn():
        seen.append(all(id(p) in masters for p in rp.parameters()))
        torch.nn.utils.clip_grad_norm_(rp.parameters(), max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()

    rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
    rp.step(step_fn, is_async=False)
    chunked_loss(ref, x, y, 2).backward()
    torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm=0.5)
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert seen == [True]
    assert_params_close(model, ref)


def test_training_loop_synchronize_exposes_weights_and_grads():
    """training_loop.en.md, "model.synchronize()": after it, params are the newest and .grad holds accumulated gradients."""
    model, ref = mlp(), mlp()
    (x1, y1), (x2, y2) = batches(2)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    optimizer = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    rp.forward_backward(input_args=(x1,), label=y1, loss_fn=mse_sum)
    rp.step(lambda: (optimizer.step(), optimizer.zero_grad()))
    rp.synchronize()  # 1. weights after the asynchronous update
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    chunked_loss(ref, x1, y1, 2).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    assert_params_close(rp.model, ref)
    rp.forward_backward(input_args=(x2,), label=y2, loss_fn=mse_sum)  # 3. gradients to inspect
    rp.synchronize()
    chunked_loss(ref, x2, y2, 2).backward()
    assert_grads_close(rp.model, ref)
    state = copy.deepcopy(rp.model.state_dict())  # 2. what a checkpoint saves
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value, msg=name)


def test_training_loop_evaluation_accuracy():
    """training_loop.en.md, "Inference / Evaluation": synchronize, eval, no_grad, model(images), accuracy."""
    model, ref = mlp(), mlp()
    images, labels = torch.randn(10, 8), torch.randint(0, 4, (10,))
    rp = RoundPipe(model)
    rp.synchronize()
    rp.eval()
    correct, ref_correct = 0, 0
    with torch.no_grad():
        for batch, target in zip(images.split(5), labels.split(5)):
            outputs = rp(batch)
            _, predicted = outputs.max(1)
            correct += predicted.eq(target).sum().item()
            ref_correct += ref(batch).max(1)[1].eq(target).sum().item()
            torch.testing.assert_close(outputs, ref(batch))
    rp.train()
    assert correct == ref_correct and rp.training


def test_training_loop_forward_call_conventions():
    """training_loop.en.md, "forward() vs forward_backward()": model(x, attention_mask=m) == model.forward(...), and a per-call config."""
    model, ref = kwargs_model(), kwargs_model()
    x, mask = torch.randn(6, 8), (torch.rand(6, 32) > 0.5).float()
    rp = RoundPipe(model)
    with torch.no_grad():
        expected = ref[1:](ref[0](x, attention_mask=mask))
        torch.testing.assert_close(rp(x, attention_mask=mask), expected)
        torch.testing.assert_close(rp.forward(x, attention_mask=mask), expected)
        cfg = RoundPipeRunConfig(num_microbatch=2)
        torch.testing.assert_close(rp(x, attention_mask=mask, roundpipe_run_config=cfg), expected)


def test_training_loop_forward_output_supports_backward():
    """training_loop.en.md, "forward() vs forward_backward()": the output of forward supports loss.backward()."""
    model, ref = mlp(), mlp()
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    criterion = nn.MSELoss()
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    loss = criterion(rp(x), y)
    loss.backward()
    rp.synchronize()
    criterion(ref(x), y).backward()
    assert_grads_close(model, ref)


# ---- BasicUsage/wrap_model.en.md -------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm residual MLP block: the repeated layer of "adapter + blocks + adapter"."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.relu(self.up(self.norm(h))))


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.norm, self.lm_head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))


def tiny_lm(vocab: int = 40, hidden: int = 32, num_blocks: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(vocab, hidden), *[Block(hidden) for _ in range(num_blocks)], Head(hidden, vocab)
    )


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def test_wrap_model_sequential_adapter_blocks_adapter():
    """wrap_model.en.md, "nn.Sequential Representation": input adapter + repeated blocks + output adapter, trained."""
    model, ref = tiny_lm(), tiny_lm()
    ids, labels = torch.randint(0, 40, (4, 6)), torch.randint(0, 40, (4, 6))
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    loss = rp.forward_backward(input_args=(ids,), label=labels, loss_fn=lm_loss)
    rp.synchronize()
    ref_loss = chunked_loss(ref, ids, labels, 2, lm_loss)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)


class Accumulating(nn.Module):
    """The guide's MyBlock: reads its parameters, writes a standalone buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("acc", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.acc.add_(out.mean(dim=0).detach())
        return out


def test_wrap_model_standalone_buffer_write_persists():
    """wrap_model.en.md, "Variable Access Restrictions": a standalone buffer written in forward keeps the write."""
    torch.manual_seed(0)
    model = nn.Sequential(Accumulating(), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=1))
    with torch.no_grad():
        rp(x)
        rp(x)
        ref(x)
        ref(x)
    rp.synchronize()
    assert ref[0].acc.abs().sum() > 0
    torch.testing.assert_close(model[0].acc, ref[0].acc)


class DeviceFromInput(nn.Module):
    """Temporary tensors take their device from the input and the weights, never a hard-coded one."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[0], 1, device=x.device)
        bias = torch.zeros(self.linear.weight.shape[0], device=self.linear.weight.device)
        return self.linear(x) * mask + bias


def test_wrap_model_temporaries_follow_the_input_device():
    """wrap_model.en.md, "Temporary Tensor Device Placement": device inferred from inputs or weights."""
    torch.manual_seed(0)
    model = nn.Sequential(DeviceFromInput(), nn.Tanh(), nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
    rp.synchronize()
    ref_loss = chunked_loss(ref, x, y, 3)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)


@pytest.mark.parametrize("pin_model", ["alloc", "register", "off"])
def test_wrap_model_constructor_arguments(pin_model):
    """wrap_model.en.md, "Wrapping the Model": RoundPipe(model=..., optim_dtype=..., model_run_config=..., pin_model=...)."""
    model, ref = mlp(), mlp()
    rp = RoundPipe(
        model=model,
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=4),
        pin_model=pin_model,
    )
    assert all(p.dtype == torch.float32 for p in rp.optim_parameters())
    optimizer = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches(2, batch=8):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
        rp.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
        chunked_loss(ref, x, y, 4).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_params_close(model, ref)


def tiny_qwen3(seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, use_cache=False, pad_token_id=0,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).float()


def test_wrap_model_preset_one_line():
    """wrap_model.en.md, "Using Model Presets": wrap_model_to_roundpipe(model, use_sequential_preset=True, ...)."""
    from laden import wrap_model_to_roundpipe

    raw, ref = tiny_qwen3(), tiny_qwen3()
    model = wrap_model_to_roundpipe(
        raw, use_sequential_preset=True, model_run_config=RoundPipeRunConfig(num_microbatch=2),
        optim_dtype=torch.float32,
    )  # fmt: skip
    assert model.vocab_size == 64 and model.config is raw.config
    ids = torch.randint(1, 64, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_wrap_model_original_attributes_stay_readable():
    """wrap_model.en.md, "Using Model Presets": after wrapping a causal LM, model.vocab_size and model.config stay readable."""
    raw = tiny_qwen3()
    model = RoundPipe(raw, optim_dtype=torch.float32)
    assert model.config is raw.config
    assert model.vocab_size == raw.config.vocab_size == 64


def test_wrap_model_automatic_splitting():
    """wrap_model.en.md, "Automatic Model Wrapping": wrap_model_to_roundpipe(model, use_sequential_preset=False)."""
    from laden import wrap_model_to_roundpipe

    class NotSequential(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.blocks, self.out = (
                nn.Linear(8, 32),
                nn.ModuleList(Block(32) for _ in range(2)),
                nn.Linear(32, 4),
            )

        def forward(self, x):
            h = self.inp(x)
            for block in self.blocks:
                h = block(h)
            return self.out(h)

    torch.manual_seed(0)
    raw = NotSequential()
    ref = copy.deepcopy(raw)
    model = wrap_model_to_roundpipe(raw, use_sequential_preset=False, optim_dtype=torch.float32)
    x = torch.randn(6, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))


# ---- BasicUsage/optimizer.en.md ----------------------------------------------------------------


def test_optimizer_on_optim_parameters():
    """optimizer.en.md, option 2: Adam(model.optim_parameters(), lr=1e-3), here torch.optim.Adam."""
    model, ref = mlp(), mlp()
    rp = RoundPipe(model, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    optimizer = torch.optim.Adam(rp.optim_parameters(), lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3, weight_decay=0.01)
    for x, y in batches(3):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
        rp.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
        chunked_loss(ref, x, y, 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_params_close(model, ref)


def test_optimizer_ctx_redirects_parameters():
    """optimizer.en.md, option 1 and "What OptimizerCtx Does": model.parameters() inside OptimizerCtx are the optimizer parameters."""
    from laden import OptimizerCtx

    model, ref = mlp(), mlp()
    rp = RoundPipe(model, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    with OptimizerCtx():
        named = dict(rp.named_parameters())
        optimizer = torch.optim.AdamW([{"params": rp.parameters(), "lr": 1e-2}])
    assert set(named) == {n for n, _ in rp.optim_named_parameters()}
    x, y = batches(1)[0]
    rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
    rp.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    chunked_loss(ref, x, y, 2).backward()
    ref_opt.step()
    assert_params_close(model, ref)


def test_optimizer_cpu_adam_decoupled_weight_decay():
    """optimizer.en.md, "RoundPipe CPU Optimizers": Adam(..., weight_decay=0.01, decoupled_weight_decay=True) == AdamW."""
    from laden.optim import Adam

    model, ref = mlp(), mlp()
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    optimizer = Adam(rp.optim_parameters(), lr=1e-3, weight_decay=0.01, decoupled_weight_decay=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    for x, y in batches(2):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
        rp.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
        chunked_loss(ref, x, y, 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_params_close(model, ref)


def test_optimizer_torch_fused_adamw():
    """optimizer.en.md, "RoundPipe CPU Optimizers": a PyTorch optimizer with fused=True works on the optimizer parameters."""
    model, ref = mlp(), mlp()
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    optimizer = torch.optim.AdamW(rp.optim_parameters(), lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in batches(2):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
        rp.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
        chunked_loss(ref, x, y, 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_params_close(model, ref)


# ---- BasicUsage/grad_scaler.en.md ---------------------------------------------------------------


def test_grad_scaler_training_loop():
    """grad_scaler.en.md, "Basic Usage": scaler.scale in loss_fn, scaler.step in step_fn, scaler.update, real loss."""
    from laden import GradScaler, OptimizerCtx
    from laden.optim import Adam

    model, ref = mlp(), mlp()
    criterion, num_microbatch = nn.MSELoss(), 2
    rp = RoundPipe(model, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    with OptimizerCtx():
        optimizer = Adam(rp.parameters(), lr=1e-3)
    scaler = GradScaler()
    real_losses = []
    for x, y in batches(2):
        loss = rp.forward_backward(
            input_args=(x,),
            label=y,
            loss_fn=lambda outputs, labels: scaler.scale(criterion(outputs.float(), labels)) / num_microbatch,
        )
        rp.step(lambda: (scaler.step(optimizer), optimizer.zero_grad()), is_async=False)
        scaler.update()
        real_losses.append(loss.item() / scaler.get_scale())
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    ref_losses = []
    for x, y in batches(2):
        loss = chunked_loss(ref, x, y, 2, lambda o, t: criterion(o, t) / num_microbatch)
        loss.backward()
        ref_losses.append(loss.item())
        ref_opt.step()
        ref_opt.zero_grad()
    assert real_losses == pytest.approx(ref_losses, rel=1e-5)
    assert_params_close(model, ref)


def test_grad_scaler_manual_unscale_then_clip():
    """grad_scaler.en.md, "Manual Unscaling": unscale_, clip_grad_norm_, step inside step_fn."""
    from laden import GradScaler

    model, ref = mlp(), mlp()
    x, y = torch.randn(6, 8), 10 * torch.randn(6, 4)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    optimizer = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    scaler = GradScaler(init_scale=1024.0)

    def step_fn():
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(optimizer.param_groups[0]["params"], max_norm=1.0)
        scaler.step(optimizer)
        optimizer.zero_grad()

    rp.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: scaler.scale(mse_sum(o, t)))
    rp.step(step_fn, is_async=False)
    scaler.update()
    chunked_loss(ref, x, y, 2).backward()
    torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm=1.0)
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert_params_close(model, ref)


# ---- BasicUsage/multi_gpu.en.md -------------------------------------------------------------


def test_multi_gpu_fixed_num_microbatch_is_independent_of_device_count():
    """multi_gpu.en.md, "Consistent Behavior Across GPU Counts": same num_microbatch, one or two devices, same training."""
    results = []
    for num_devices in (1, 2):
        model = mlp()
        rp = RoundPipe(
            model,
            model_run_config=RoundPipeRunConfig(num_microbatch=3),
            devices=[torch.device("cpu")] * num_devices,
        )
        optimizer = torch.optim.SGD(rp.optim_parameters(), lr=0.05)
        losses = []
        for x, y in batches(3):
            losses.append(rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum))
            rp.step(lambda: (optimizer.step(), optimizer.zero_grad()))  # noqa: B023
        rp.synchronize()
        results.append((torch.stack(losses), [p.detach().clone() for p in model.parameters()]))
    (losses_1, params_1), (losses_2, params_2) = results
    torch.testing.assert_close(losses_1, losses_2)
    for p1, p2 in zip(params_1, params_2):
        torch.testing.assert_close(p1, p2)


@pytest.mark.parametrize("num_devices", [1, 2])
def test_multi_gpu_default_num_microbatch_is_devices_plus_one(num_devices):
    """multi_gpu.en.md, "Consistent Behavior Across GPU Counts": the default num_microbatch is device count + 1."""
    calls: list[int] = []

    def recording(out, y):
        calls.append(out.shape[0])
        return mse_sum(out, y)

    rp = RoundPipe(mlp(), devices=[torch.device("cpu")] * num_devices)
    rp.forward_backward(input_args=(torch.randn(12, 8),), label=torch.randn(12, 4), loss_fn=recording)
    assert len(calls) == num_devices + 1


# ---- AdvancedUsage/custom_data_type.en.md ---------------------------------------------------


class TransformerOutput:
    """The guide's dataclass-like output: two tensors and a non-tensor field kept in the context."""

    def __init__(self, logits: torch.Tensor, hidden_states: torch.Tensor, loss: float = 0.0) -> None:
        self.logits, self.hidden_states, self.loss = logits, hidden_states, loss


register_pytree_node(
    TransformerOutput,
    lambda obj: ([obj.logits, obj.hidden_states], {"loss": obj.loss}),
    lambda children, context: TransformerOutput(*children, loss=context["loss"]),
)


class FlexibleOutput:
    def __init__(self, logits: torch.Tensor, attentions: torch.Tensor | None = None) -> None:
        self.logits, self.attentions = logits, attentions


def _flatten_flexible(obj):
    children = [obj.logits] + ([obj.attentions] if obj.attentions is not None else [])
    return children, {"has_attentions": obj.attentions is not None}


register_pytree_node(
    FlexibleOutput,
    _flatten_flexible,
    lambda children, context: FlexibleOutput(children[0], children[1] if context["has_attentions"] else None),
)


class BatchResult:
    def __init__(self, outputs: list, metadata: dict) -> None:
        self.outputs, self.metadata = outputs, metadata


register_pytree_node(
    BatchResult,
    lambda obj: ([obj.outputs, obj.metadata], None),
    lambda children, context: BatchResult(outputs=children[0], metadata=children[1]),
)


class ToTransformerOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> TransformerOutput:
        h = torch.tanh(self.proj(x))
        return TransformerOutput(logits=h, hidden_states=h * 2, loss=0.5)


class FromTransformerOutput(nn.Module):
    def __init__(self, with_attentions: bool) -> None:
        super().__init__()
        self.proj, self.with_attentions = nn.Linear(16, 4), with_attentions

    def forward(self, out: TransformerOutput) -> BatchResult:
        assert isinstance(out, TransformerOutput) and out.loss == 0.5
        logits = self.proj(out.logits + out.hidden_states)
        flexible = FlexibleOutput(logits, logits.softmax(-1) if self.with_attentions else None)
        return BatchResult(outputs=[flexible, logits], metadata={"scale": logits * 3, "tag": "ok"})


def custom_type_model(with_attentions: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(ToTransformerOutput(), FromTransformerOutput(with_attentions))


def result_loss(result: BatchResult, y: torch.Tensor) -> torch.Tensor:
    flexible, logits = result.outputs
    extra = flexible.attentions.sum() if flexible.attentions is not None else 0.0
    return mse_sum(flexible.logits, y) + result.metadata["scale"].sum() * 0.1 + extra


@pytest.mark.parametrize("with_attentions", [True, False])
def test_custom_data_type_registered_outputs(with_attentions):
    """custom_data_type.en.md, all three examples: registered dataclass, optional field and nested outputs cross layers, split and merge."""
    model, ref = custom_type_model(with_attentions), custom_type_model(with_attentions)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    plan = ModelExecutePlan(
        fwd_plan=[range(0, 1)], bwd_plan=[range(1, 2), range(0, 1)]
    )  # output crosses stages
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=3, execute_plan=plan))
    loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=result_loss)
    rp.synchronize()
    ref_loss = chunked_loss(ref, x, y, 3, result_loss)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)
    with torch.no_grad():
        merged, expected = rp(x), ref(x)
    assert isinstance(merged, BatchResult) and merged.metadata["tag"] == "ok"
    torch.testing.assert_close(merged.outputs[0].logits, expected.outputs[0].logits)
    assert (merged.outputs[0].attentions is None) == (not with_attentions)
    torch.testing.assert_close(merged.metadata["scale"], expected.metadata["scale"])


# ---- AdvancedUsage/custom_microbatch_split.en.md ---------------------------------------------


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, images: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.proj(images) * scale


def two_input_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(TwoInputs(), nn.Tanh(), nn.Linear(4, 4))


def test_custom_split_default_splits_batch_and_replicates_scalars():
    """custom_microbatch_split.en.md, "Automatic Input Splitting": dim-0 split of tensors; scalar tensors replicated."""
    shapes: list[tuple] = []

    class Recording(TwoInputs):
        def forward(self, images, scale):
            shapes.append((tuple(images.shape), tuple(scale.shape)))
            return super().forward(images, scale)

    torch.manual_seed(0)
    rp = RoundPipe(nn.Sequential(Recording()))
    with torch.no_grad():
        rp(torch.randn(12, 8), torch.tensor(2.0), roundpipe_run_config=RoundPipeRunConfig(num_microbatch=4))
    assert shapes == [((3, 8), ())] * 4


def test_custom_split_input_spec():
    """custom_microbatch_split.en.md, "Approach 1: Split Spec": split_input=((TensorChunkSpec(0), _Replicate), None)."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    class MeanScaled(TwoInputs):  # uses the whole scale tensor, so a split one would change the output
        def forward(self, images, scale):
            return super().forward(images, scale.mean(0))

    torch.manual_seed(0)
    model = nn.Sequential(MeanScaled(), nn.Tanh(), nn.Linear(4, 4))
    ref = copy.deepcopy(model)
    images, scale = torch.randn(6, 8), torch.randn(6, 4)  # scale has a batch-sized dim 0, yet is replicated
    config = RoundPipeRunConfig(num_microbatch=3, split_input=((TensorChunkSpec(0), _Replicate), None))
    rp = RoundPipe(model, model_run_config=config)
    with torch.no_grad():
        out = rp(images, scale)
    torch.testing.assert_close(out, ref[2](ref[1](ref[0](images, scale))))  # two inputs: the layers by hand


def test_custom_split_input_function():
    """custom_microbatch_split.en.md, "Approach 2: Custom Function": custom_split(args, kwargs, num_microbatch)."""

    def custom_split(args, kwargs, num_microbatch):
        images, masks = args
        args_list = list(zip(images.chunk(num_microbatch), masks.chunk(num_microbatch)))
        return args_list, [kwargs] * num_microbatch

    model, ref = two_input_model(), two_input_model()
    images, masks, y = torch.randn(6, 8), torch.rand(6, 4), torch.randn(6, 4)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=3, split_input=custom_split))
    loss = rp.forward_backward(input_args=(images, masks), label=y, loss_fn=mse_sum)
    rp.synchronize()
    ref_loss = sum(
        mse_sum(ref[1:](ref[0](i, m)), t) for i, m, t in zip(images.chunk(3), masks.chunk(3), y.chunk(3))
    )
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)


class PositionalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.out = nn.Embedding(20, 16), nn.Embedding(8, 16), nn.Linear(16, 20)

    def forward(self, input_ids, attention_mask, position_ids):
        return self.out(self.tok(input_ids) + self.pos(position_ids)) * attention_mask[..., None]


def test_custom_split_transformer_kwargs_function():
    """custom_microbatch_split.en.md, "Approach 2": split_transformer_input over input_ids / attention_mask / position_ids."""

    def split_transformer_input(args, kwargs, num_microbatch):
        chunks = [kwargs[k].chunk(num_microbatch) for k in ("input_ids", "attention_mask", "position_ids")]
        kwargs_list = [{"input_ids": i, "attention_mask": m, "position_ids": p} for i, m, p in zip(*chunks)]
        return [()] * num_microbatch, kwargs_list

    torch.manual_seed(0)
    model = nn.Sequential(PositionalLM())
    ref = copy.deepcopy(model)
    kwargs = {
        "input_ids": torch.randint(0, 20, (4, 8)),
        "attention_mask": torch.ones(4, 8),
        "position_ids": torch.arange(8).expand(4, 8).contiguous(),
    }
    labels = torch.randint(0, 20, (4, 8))
    rp = RoundPipe(
        model, model_run_config=RoundPipeRunConfig(num_microbatch=2, split_input=split_transformer_input)
    )
    loss = rp.forward_backward(input_kwargs=kwargs, label=labels, loss_fn=lm_loss)
    rp.synchronize()
    ref_loss = sum(
        lm_loss(ref[0](**{k: v[i : i + 2] for k, v in kwargs.items()}), labels[i : i + 2]) for i in (0, 2)
    )
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)


def weighted_loss(out, label):
    targets, weights = label
    return (((out - targets) ** 2).sum(-1) * weights).sum()


def test_custom_split_label_function():
    """custom_microbatch_split.en.md, "split_label" / "Custom Function": custom_split_label(label, num_microbatch)."""

    def custom_split_label(label, num_microbatch):
        targets, weights = label
        return list(zip(targets.chunk(num_microbatch), weights.chunk(num_microbatch)))

    model, ref = mlp(), mlp()
    x, targets, weights = torch.randn(6, 8), torch.randn(6, 4), torch.rand(6)
    rp = RoundPipe(
        model, model_run_config=RoundPipeRunConfig(num_microbatch=3, split_label=custom_split_label)
    )
    loss = rp.forward_backward(input_args=(x,), label=(targets, weights), loss_fn=weighted_loss)
    rp.synchronize()
    ref_loss = sum(
        weighted_loss(ref(xc), (t, w)) for xc, t, w in zip(x.chunk(3), targets.chunk(3), weights.chunk(3))
    )
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)


def test_custom_split_label_spec_replicates_class_weights():
    """custom_microbatch_split.en.md, "split_label" / "Split Spec": split_label=(TensorChunkSpec(0), _Replicate)."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    seen: list[torch.Tensor] = []

    def loss_fn(out, label):
        targets, class_weights = label
        seen.append(class_weights)
        return (((out - targets) ** 2) * class_weights.mean(0)).sum()  # the whole table in every micro-batch

    class_weights = torch.rand(6, 4)  # batch-sized dim 0, yet replicated by the spec
    rp = RoundPipe(
        mlp(),
        model_run_config=RoundPipeRunConfig(num_microbatch=3, split_label=(TensorChunkSpec(0), _Replicate)),
    )
    rp.forward_backward(
        input_args=(torch.randn(6, 8),), label=(torch.randn(6, 4), class_weights), loss_fn=loss_fn
    )
    assert len(seen) == 3 and all(torch.equal(w, class_weights) for w in seen)


def test_custom_merge_output_function():
    """custom_microbatch_split.en.md, "merge_output" / "Custom Function": custom_merge(outputs) keeps only logits."""
    model, ref = custom_type_model(True), custom_type_model(True)
    x = torch.randn(6, 8)
    config = RoundPipeRunConfig(
        num_microbatch=3, merge_output=lambda outputs: torch.cat([out.outputs[1] for out in outputs], dim=0)
    )
    rp = RoundPipe(model, model_run_config=config)
    with torch.no_grad():
        torch.testing.assert_close(rp(x), ref(x).outputs[1])


def test_custom_merge_output_sum_reducer():
    """custom_microbatch_split.en.md, "merge_output" / "Split Spec": _CustomReducer summing per-micro-batch outputs."""
    from torch.distributed.pipelining.microbatch import _CustomReducer

    class Total(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 1)

        def forward(self, x):
            return self.proj(x).sum()

    torch.manual_seed(0)
    model = nn.Sequential(Total())
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)
    sum_reducer = _CustomReducer(torch.tensor(0.0), lambda a, b: a + b)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=3, merge_output=sum_reducer))
    with torch.no_grad():
        torch.testing.assert_close(rp(x), ref(x))


def test_custom_merge_output_disabled():
    """custom_microbatch_split.en.md, "Disabling Merging": merge_output=False returns per-micro-batch outputs."""
    model, ref = mlp(), mlp()
    x = torch.randn(6, 8)
    rp = RoundPipe(model)
    with torch.no_grad():
        output = rp(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=3, merge_output=False))
    output.synchronize()
    assert len(output) == 3
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(list(output)), ref(x))


def test_custom_merge_default_averages_scalar_tensors():
    """custom_microbatch_split.en.md, "Automatic Output Merging": scalar tensors are averaged across micro-batches."""

    class MeanOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 4)

        def forward(self, x):
            out = self.proj(x)
            return out, out.mean()

    torch.manual_seed(0)
    model = nn.Sequential(MeanOut())
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    with torch.no_grad():
        out, mean = rp(x)
        torch.testing.assert_close(out, ref(x)[0])
        torch.testing.assert_close(mean, torch.stack([ref(c)[1] for c in x.chunk(3)]).mean())


def test_custom_merge_default_rejects_unequal_non_tensors():
    """custom_microbatch_split.en.md, "Automatic Output Merging": unequal non-tensor outputs raise an error."""

    class Tagged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 4)

        def forward(self, x):
            return self.proj(x), int(x[0, 0] > 0)

    torch.manual_seed(0)
    rp = RoundPipe(nn.Sequential(Tagged()), model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x = torch.randn(4, 8)
    x[0, 0], x[2, 0] = 1.0, -1.0  # the two micro-batches tag differently
    with torch.no_grad(), pytest.raises(Exception):  # noqa: B017 - the guide names no exception type
        rp(x)


# ---- AdvancedUsage/execute_plan.en.md ---------------------------------------------------------


def four_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4))


def test_execute_plan_forward_plan():
    """execute_plan.en.md, "What Is an Execution Plan": plan.fwd_plan / plan.bwd_plan set by attribute, used by forward()."""
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 2), range(2, 4)]
    plan.bwd_plan = [range(3, 4), range(2, 3), range(1, 2), range(0, 1)]
    model, ref = four_layers(), four_layers()
    rp = RoundPipe(model)
    x = torch.randn(6, 8)
    with torch.no_grad():
        out = rp(x, roundpipe_run_config=RoundPipeRunConfig(execute_plan=plan, num_microbatch=2))
    torch.testing.assert_close(out, ref(x))


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_execute_plan_fused_plan(grain):
    """execute_plan.en.md, "What Is an Execution Plan": fwd_plan=[range(0, 3)], bwd_plan from layer 3 down, with forward_backward()."""
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 3)]
    plan.bwd_plan = [range(3, 4), range(2, 3), range(1, 2), range(0, 1)]
    model, ref = four_layers(), four_layers()
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    rp = RoundPipe(model)
    cfg = RoundPipeRunConfig(execute_plan=plan, num_microbatch=3, recompute_grain=grain)
    loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=cfg)
    rp.synchronize()
    ref_loss = chunked_loss(ref, x, y, 3)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)


def test_execute_plan_auto_fused():
    """execute_plan.en.md, "Automatic Tuning": plan = ModelExecutePlan.auto("fused", model), then run_config=RoundPipeRunConfig(execute_plan=plan)."""
    model, ref = mlp(), mlp()
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    rp = RoundPipe(model)
    rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)  # "run a few iterations first"
    rp.zero_grad()
    plan = ModelExecutePlan.auto("fused", rp)
    plan.check_valid(len(model), "fused")
    loss = rp.forward_backward(
        input_args=(x,),
        label=y,
        loss_fn=mse_sum,
        run_config=RoundPipeRunConfig(execute_plan=plan, num_microbatch=2),
    )
    rp.synchronize()
    ref_loss = chunked_loss(ref, x, y, 2)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)


def test_execute_plan_auto_joint_models():
    """execute_plan.en.md, "Joint optimization across multiple models": plan1, plan2 = ModelExecutePlan.auto("fused", model1, model2)."""
    rp1, rp2 = RoundPipe(mlp(0)), RoundPipe(four_layers())
    plan1, plan2 = ModelExecutePlan.auto("fused", rp1, rp2)
    plan1.check_valid(7, "fused")
    plan2.check_valid(4, "fused")


def test_execute_plan_auto_run_types_are_valid():
    """execute_plan.en.md, "auto() parameters": run_type "infer" / "train" / "fused" each give a valid plan."""
    rp = RoundPipe(mlp())
    for run_type in ("infer", "train", "fused"):
        ModelExecutePlan.auto(run_type, rp, min_stages=2).check_valid(7, run_type)


def test_execute_plan_auto_upper_threshold_is_accepted_silently():
    """execute_plan.en.md, "auto() parameters": upper_threshold tunes load balancing."""
    import warnings

    rp = RoundPipe(mlp())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ModelExecutePlan.auto("fused", rp, upper_threshold=1.5).check_valid(7, "fused")


def test_execute_plan_model_timer_verbose(capsys):
    """execute_plan.en.md, "How to Build a Plan": ModelTimer.VERBOSE = True prints per-layer fwd/re/bwd times."""
    from laden.timer import ModelTimer

    ModelTimer.VERBOSE = True
    try:
        rp = RoundPipe(four_layers())
        rp.forward_backward(input_args=(torch.randn(4, 8),), label=torch.randn(4, 4), loss_fn=mse_sum)
    finally:
        ModelTimer.VERBOSE = False
    assert "Layer 0 fwd" in capsys.readouterr().err


@pytest.mark.parametrize(
    "plan, run_type",
    [
        (
            ModelExecutePlan(fwd_plan=[range(0, 2)], bwd_plan=[range(3, 4), range(0, 3)]),
            "fused",
        ),  # layer 2 twice
        (
            ModelExecutePlan(fwd_plan=[range(0, 3)], bwd_plan=[range(3, 4), range(1, 3)]),
            "fused",
        ),  # layer 0 missing
        (ModelExecutePlan(fwd_plan=[range(2, 4), range(0, 2)], bwd_plan=[]), "infer"),  # descending forward
        (
            ModelExecutePlan(fwd_plan=[range(0, 4)], bwd_plan=[range(0, 2), range(2, 4)]),
            "train",
        ),  # ascending bwd
    ],
    ids=["fused_overlap", "bwd_gap", "fwd_descending", "bwd_ascending"],
)
def test_execute_plan_validation_rules(plan, run_type):
    """execute_plan.en.md, "Validation Rules": plans that break a rule raise an error when used."""
    rp = RoundPipe(four_layers())
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    cfg = RoundPipeRunConfig(execute_plan=plan)
    with pytest.raises(ValueError):
        if run_type == "infer":
            with torch.no_grad():
                rp(x, roundpipe_run_config=cfg)
        elif run_type == "fused":
            rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=cfg)
        else:
            plan.check_valid(4, run_type)


# ---- AdvancedUsage/recompute_data.en.md ---------------------------------------------------------


class TopKRouter(nn.Module):
    """The guide's MoE routing replay: top-2 experts chosen in forward, replayed in the recompute."""

    def __init__(self, hidden: int = 8, num_experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_experts))
        self.routes: list[torch.Tensor] = []

    def forward(self, x):
        from laden import doing_recompute, get_recompute_data, save_for_recompute

        weights = torch.softmax(self.gate(x), dim=-1)
        if doing_recompute():
            (selected,) = get_recompute_data()
        else:
            selected = torch.topk(
                weights + torch.rand_like(weights), k=2, dim=-1
            ).indices  # non-deterministic
            save_for_recompute(selected)
        out = torch.zeros_like(x)
        for k in range(2):
            for e, expert in enumerate(self.experts):
                chosen = (selected[:, k] == e).unsqueeze(-1)
                out = out + chosen * weights[:, e : e + 1] * expert(x)
        return out


def test_recompute_data_moe_routing_replay():
    """recompute_data.en.md, "MoE Expert Routing Replay": routing saved in forward is reused by the recompute."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), TopKRouter(), nn.Tanh(), nn.Linear(8, 4))
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    plan = ModelExecutePlan(
        fwd_plan=[range(0, 3)], bwd_plan=[range(3, 4), range(0, 3)]
    )  # router is recomputed
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=1, execute_plan=plan))
    torch.manual_seed(1)
    loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
    rp.synchronize()
    grads = [p.grad.clone() for p in model.parameters()]
    # reference: the same forward with the same RNG draw, no recompute
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    from unittest import mock

    with mock.patch("laden.doing_recompute", return_value=False), mock.patch("laden.save_for_recompute"):
        ref_loss = mse_sum(model(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_recompute_data_conditional_branch():
    """recompute_data.en.md, "Conditional Branches": a Python branch chosen in forward is replayed from saved data."""
    from laden import doing_recompute, get_recompute_data, save_for_recompute

    branches: list[tuple[bool, bool]] = []

    class ConditionalLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.branch_a, self.branch_b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            if doing_recompute():
                (use_branch_a,) = get_recompute_data()
            else:
                use_branch_a = (x.mean() > 0).item()
                save_for_recompute(use_branch_a)
            branches.append((doing_recompute(), use_branch_a))
            return self.branch_a(x) if use_branch_a else self.branch_b(x)

    torch.manual_seed(0)
    model = nn.Sequential(ConditionalLayer(), nn.Tanh(), nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    plan = ModelExecutePlan(fwd_plan=[range(0, 2)], bwd_plan=[range(2, 3), range(0, 2)])
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=1, execute_plan=plan))
    loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
    rp.synchronize()
    assert [r for r, _ in branches] == [False, True] and branches[0][1] == branches[1][1]
    ref_loss = mse_sum(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())


# ---- AdvancedUsage/resolve_oom.en.md ----------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        RoundPipeRunConfig(num_microbatch=6),
        RoundPipeRunConfig(recompute_grain="layer"),
        RoundPipeRunConfig(num_microbatch=6, recompute_grain="layer"),
    ],
    ids=["more_microbatches", "layer_grain", "both"],
)
def test_resolve_oom_knobs_keep_the_gradients(config):
    """resolve_oom.en.md, "GPU OOM" 1 and 2: more micro-batches or recompute_grain="layer" train the same model."""
    model, ref = mlp(), mlp()
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    rp = RoundPipe(model)
    loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=config)
    rp.synchronize()
    num = config.num_microbatch or rp.num_devices + 1
    ref_loss = chunked_loss(ref, x, y, num)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)


def test_resolve_oom_smaller_memory_limit_gives_smaller_stages():
    """resolve_oom.en.md, "GPU OOM" 3: a lower model_memory_limit in ModelExecutePlan.auto forces smaller stages, same gradients."""
    model, ref = mlp(), mlp()
    rp = RoundPipe(model)
    roomy = ModelExecutePlan.auto("fused", rp, model_memory_limit=8.0)
    layer_gib = max(rp.layer_bytes(with_grads=True)) / (1 << 30)
    tight = ModelExecutePlan.auto("fused", rp, model_memory_limit=2 * layer_gib)
    assert len(tight.bwd_plan) > len(roomy.bwd_plan)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    loss = rp.forward_backward(
        input_args=(x,),
        label=y,
        loss_fn=mse_sum,
        run_config=RoundPipeRunConfig(execute_plan=tight, num_microbatch=2),
    )
    rp.synchronize()
    ref_loss = chunked_loss(ref, x, y, 2)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_close(model, ref)


def test_resolve_oom_manual_gradient_accumulation():
    """resolve_oom.en.md, "CPU OOM" 2: two forward_backward calls with fewer micro-batches, then one step."""
    model, ref = mlp(), mlp()
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    rp = RoundPipe(model)
    optimizer = torch.optim.SGD(rp.optim_parameters(), lr=0.05)
    config = RoundPipeRunConfig(num_microbatch=4)
    loss1 = rp.forward_backward(input_args=(x[:8],), label=y[:8], loss_fn=mse_sum, run_config=config)
    loss2 = rp.forward_backward(input_args=(x[8:],), label=y[8:], loss_fn=mse_sum, run_config=config)
    rp.step(lambda: (optimizer.step(), optimizer.zero_grad()))
    rp.synchronize()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    ref_loss = chunked_loss(ref, x, y, 8)  # one pass of 8 micro-batches
    ref_loss.backward()
    ref_opt.step()
    torch.testing.assert_close(loss1 + loss2, ref_loss.detach())
    assert_params_close(model, ref)


# ---- AdvancedUsage/run_config.en.md ------------------------------------------------------------------


def test_run_config_call_level_overrides_model_level():
    """run_config.en.md, "Model-Level Config vs Per-Call Overrides": per-call value wins; unset falls back to the model's."""
    grains_seen: list[int] = []

    def recording(out, y):
        grains_seen.append(out.shape[0])
        return mse_sum(out, y)

    model, ref = mlp(), mlp()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=4, recompute_grain="layer"))
    loss = rp.forward_backward(
        input_args=(x,), label=y, loss_fn=recording, run_config=RoundPipeRunConfig(num_microbatch=8)
    )
    assert grains_seen == [1] * 8
    grains_seen.clear()
    rp.forward_backward(input_args=(x,), label=y, loss_fn=recording, run_config=RoundPipeRunConfig())
    assert grains_seen == [2] * 4
    rp.synchronize()
    ref_loss = chunked_loss(ref, x, y, 8)
    torch.testing.assert_close(loss, ref_loss.detach())
    (ref_loss + chunked_loss(ref, x, y, 4)).backward()
    assert_grads_close(model, ref)


def test_run_config_output_device_defaults_to_cpu():
    """run_config.en.md, "output_device": RoundPipeRunConfig(output_device=None) puts outputs on the CPU."""
    model, ref = mlp(), mlp()
    x = torch.randn(4, 8)
    rp = RoundPipe(model)
    with torch.no_grad():
        out = rp(x, roundpipe_run_config=RoundPipeRunConfig(output_device=None))
    assert out.device.type == "cpu"
    with torch.no_grad():
        torch.testing.assert_close(out, ref(x))
