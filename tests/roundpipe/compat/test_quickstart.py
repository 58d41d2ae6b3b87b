"""RoundPipe's two quick-start notebooks (`example/resnet_cifar100.en.ipynb`,
`example/qwen3_nekoqa.en.ipynb`) on laden: CPU, tiny fp32 models, synthetic data.

The notebooks train with the default asynchronous `step`, so the plain PyTorch references
here apply each update with the gradients of the weights one update earlier.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from laden import RoundPipe, RoundPipeRunConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def stale_reference(ref: nn.Module, opt: torch.optim.Optimizer, batches, loss_of) -> list[float]:
    """Asynchronous `step`: update k applies gradients taken on the weights before update k-1."""
    evaluator = copy.deepcopy(ref)
    previous = copy.deepcopy(ref.state_dict())
    losses = []
    for batch in batches:
        evaluator.load_state_dict(previous)
        previous = copy.deepcopy(ref.state_dict())
        evaluator.zero_grad()
        loss = loss_of(evaluator, *batch)
        loss.backward()
        losses.append(loss.item())
        for p, q in zip(ref.parameters(), evaluator.parameters()):
            p.grad = None if q.grad is None else q.grad.clone()
        opt.step()
        opt.zero_grad()
    return losses


def assert_params_close(model: nn.Module, ref: nn.Module, **tol) -> None:
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, p_ref, msg=name, **tol)


# ---- resnet_cifar100.en.ipynb ----------------------------------------------------------------


class BasicBlock(nn.Module):
    """The notebook's ResNet basic block (conv-BN-ReLU-conv-BN + identity or 1x1 downsample)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample:
            identity = self.downsample(x)
        out = out + identity
        return self.relu(out)


def build_resnet(num_classes: int = 10) -> nn.Sequential:
    """The notebook's build_resnet, shrunk: 4-16 channels, one or two blocks per width."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, 1, 1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        BasicBlock(4, 8, 2),
        BasicBlock(8, 8),
        BasicBlock(8, 16, 2),
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(),
        nn.Linear(16, num_classes),
    )


def image_batches(num: int, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [
        (torch.randn(batch, 3, 8, 8, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
        for _ in range(num)
    ]


def resnet_reference_loss(num_microbatch: int, divisor: float):
    criterion = nn.CrossEntropyLoss()

    def loss_of(model, images, labels):
        # BatchNorm normalizes each micro-batch with its own statistics, as the pipeline does
        return sum(
            criterion(model(i), t) / divisor
            for i, t in zip(images.chunk(num_microbatch), labels.chunk(num_microbatch))
        )

    return loss_of


def test_resnet_notebook_training_loop():
    """resnet_cifar100.en.ipynb, cells "model = RoundPipe(...)" and the training loop: OptimizerCtx + Adam + GradScaler + return_outputs."""
    from laden import GradScaler, OptimizerCtx
    from laden.optim import Adam

    model = RoundPipe(build_resnet(), optim_dtype=torch.float32)
    with OptimizerCtx():
        optimizer = Adam(model.parameters())
    scaler = GradScaler()
    criterion = nn.CrossEntropyLoss()

    def optimizer_step():
        scaler.step(optimizer)
        optimizer.zero_grad()

    divisor = torch.cuda.device_count() + 1
    losses, correct, total = [], 0, 0
    model.train()
    for images, labels in image_batches(3):
        loss, outputs = model.forward_backward(
            input_args=(images,),
            label=labels,
            loss_fn=lambda outputs, labels: scaler.scale(criterion(outputs.float(), labels)) / divisor,
            return_outputs=True,
        )
        model.step(optimizer_step)
        scaler.update()
        losses.append(loss.item() / scaler.get_scale())
        _, predicted = outputs.max(1)
        correct += predicted.eq(labels).sum().item()
        total += labels.size(0)
    model.synchronize()

    ref = build_resnet()
    num_microbatch = model.num_devices + 1
    ref_losses = stale_reference(
        ref,
        torch.optim.Adam(ref.parameters()),
        image_batches(3),
        resnet_reference_loss(num_microbatch, divisor),
    )
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    assert 0 <= correct <= total == 24
    assert_params_close(model.model, ref, atol=1e-5, rtol=1e-4)


def test_resnet_training_loop_with_torch_adam():
    """resnet_cifar100.en.ipynb, training loop with what laden has today: torch.optim.Adam on optim_parameters(), no scaler."""
    model = RoundPipe(build_resnet(), optim_dtype=torch.float32)
    optimizer = torch.optim.Adam(model.optim_parameters())
    criterion = nn.CrossEntropyLoss()
    divisor = torch.cuda.device_count() + 1

    def optimizer_step():
        optimizer.step()
        optimizer.zero_grad()

    losses = []
    model.train()
    for images, labels in image_batches(3):
        loss = model.forward_backward(
            input_args=(images,),
            label=labels,
            loss_fn=lambda outputs, labels: criterion(outputs.float(), labels) / divisor,
        )
        model.step(optimizer_step)
        losses.append(loss.item())
    model.synchronize()

    ref = build_resnet()
    num_microbatch = model.num_devices + 1
    ref_losses = stale_reference(
        ref,
        torch.optim.Adam(ref.parameters()),
        image_batches(3),
        resnet_reference_loss(num_microbatch, divisor),
    )
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    assert_params_close(model.model, ref, atol=1e-5, rtol=1e-4)


def test_resnet_evaluate():
    """resnet_cifar100.en.ipynb, cell "def evaluate(loader)": eval mode, no_grad, model(images), loss and accuracy."""
    model, ref = RoundPipe(build_resnet(), optim_dtype=torch.float32), build_resnet()
    criterion = nn.CrossEntropyLoss()

    def evaluate(net, loader):
        net.eval()
        correct, total, loss_sum = 0, 0, 0.0
        with torch.no_grad():
            for images, labels in loader:
                outputs = net(images)
                loss_sum += criterion(outputs.float(), labels).item() * labels.size(0)
                correct += outputs.max(1)[1].eq(labels).sum().item()
                total += labels.size(0)
        return loss_sum / total, correct / total

    loader = image_batches(2)
    loss, acc = evaluate(model, loader)
    ref_loss, ref_acc = evaluate(ref, loader)
    assert loss == pytest.approx(ref_loss, rel=1e-5) and acc == ref_acc


def test_resnet_batchnorm_running_stats_follow_training():
    """resnet_cifar100.en.ipynb, train then evaluate: BatchNorm running statistics are updated by the training forward."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, 1, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(256, 10)
    )
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=1))
    images, labels = image_batches(1)[0]
    criterion = nn.CrossEntropyLoss()
    rp.forward_backward(input_args=(images,), label=labels, loss_fn=criterion)
    rp.synchronize()
    criterion(ref(images), labels).backward()
    assert ref[1].num_batches_tracked.item() == 1
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean)
    torch.testing.assert_close(model[1].running_var, ref[1].running_var)


# ---- qwen3_nekoqa.en.ipynb ----------------------------------------------------------------------

TEXTS = [
    ("Good morning!", "Good morning, master! Nya~"),
    ("What a nice day!", "Let us go out and play, nya!"),
    ("I am tired.", "Rest a while; I will stay by you."),
    ("Do you like fish?", "Fish is the best, meow!"),
    ("Tell me a joke.", "Why did the cat sit on the computer? To keep an eye on the mouse!"),
    ("Good night.", "Sweet dreams, nya."),
    ("Are you hungry?", "Always! Feed me please~"),
    ("Let us study.", "Okay, I will sit on your notes."),
]


@pytest.fixture(scope="module")
def neko(tiny_tokenizer):
    """The notebook's tokenizer and data, shrunk: a char-level ChatML tokenizer and eight dialogues."""
    text_input = [
        tiny_tokenizer.apply_chat_template(
            [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
            tokenize=False,
            add_generation_prompt=False,
        )
        for q, a in TEXTS
    ]
    return tiny_tokenizer, text_input


def raw_qwen3(tokenizer):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=(len(tokenizer) + 7) // 8 * 8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, use_cache=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).float()


def tokenize(tokenizer, texts):
    """The notebook's tokenize(): pad positions of the labels set to -100."""
    enc = tokenizer(texts, return_tensors="pt", padding=True, truncation=False)
    labels = enc["input_ids"].clone()
    labels[labels == tokenizer.pad_token_id] = -100
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}, labels


NUM_MICROBATCH = 2
BATCH_SIZE = 4


def neko_reference(tokenizer, text_input, num_epochs: int):
    """Plain PyTorch: the same loss per micro-batch, one-step-stale Adam updates."""
    ref = raw_qwen3(tokenizer)
    batches = []
    for _ in range(num_epochs):
        for start in range(0, len(text_input), BATCH_SIZE):
            batches.append(tokenize(tokenizer, text_input[start : start + BATCH_SIZE]))

    def loss_of(model, input_dict, labels):
        total = 0.0
        for i in range(0, labels.shape[0], labels.shape[0] // NUM_MICROBATCH):
            sl = slice(i, i + labels.shape[0] // NUM_MICROBATCH)
            logits = model(**{k: v[sl] for k, v in input_dict.items()}).logits
            total = (
                total
                + model.loss_function(logits=logits, labels=labels[sl], vocab_size=model.vocab_size)
                / NUM_MICROBATCH
            )
        return total

    losses = stale_reference(ref, torch.optim.Adam(ref.parameters(), lr=1e-3), batches, loss_of)
    return ref, losses


def neko_train(model, tokenizer, text_input, optim, scaler=None, num_epochs: int = 1) -> list[float]:
    """The notebook's training cell (shuffle off, so the reference sees the same batches)."""

    def optimizer_step():
        if scaler is None:
            optim.step()
        else:
            scaler.step(optim)
        optim.zero_grad()

    scale = (lambda loss: loss) if scaler is None else scaler.scale
    losses = []
    for _ in range(num_epochs):
        model.train()
        for start in range(0, len(text_input), BATCH_SIZE):
            input_dict, labels = tokenize(tokenizer, text_input[start : start + BATCH_SIZE])
            loss = model.forward_backward(
                input_kwargs=input_dict,
                label=labels,
                loss_fn=lambda outputs, labels: scale(
                    model.loss_function(logits=outputs.logits, labels=labels, vocab_size=model.vocab_size)
                    / NUM_MICROBATCH
                ),
            )
            losses.append(loss.item() / (1.0 if scaler is None else scaler.get_scale()))
            model.step(optimizer_step)
            if scaler is not None:
                scaler.update()
    return losses


def test_nekoqa_notebook_training_loop(neko):
    """qwen3_nekoqa.en.ipynb, cells "wrap_model_to_roundpipe" and the training loop (Adam + GradScaler)."""
    from laden import GradScaler, wrap_model_to_roundpipe
    from laden.optim import Adam

    tokenizer, text_input = neko
    model = wrap_model_to_roundpipe(
        raw_qwen3(tokenizer),
        model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH),
        optim_dtype=torch.float32,
    )
    optim = Adam(model.optim_parameters(), lr=1e-3)
    losses = neko_train(model, tokenizer, text_input, optim, GradScaler(), num_epochs=2)
    model.synchronize()
    ref, ref_losses = neko_reference(tokenizer, text_input, num_epochs=2)
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    assert_params_close(model, ref, atol=1e-5, rtol=1e-4)


def test_nekoqa_training_loop_with_roundpipe_and_torch_adam(neko):
    """qwen3_nekoqa.en.ipynb, training loop with what laden has today: RoundPipe(raw_model) and torch.optim.Adam, no scaler."""
    tokenizer, text_input = neko
    raw = raw_qwen3(tokenizer)
    model = RoundPipe(
        raw, model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH), optim_dtype=torch.float32
    )
    optim = torch.optim.Adam(model.optim_parameters(), lr=1e-3)
    losses = neko_train(model, tokenizer, text_input, optim, num_epochs=2)
    model.synchronize()
    ref, ref_losses = neko_reference(tokenizer, text_input, num_epochs=2)
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    assert_params_close(raw, ref, atol=1e-5, rtol=1e-4)


def test_nekoqa_greedy_generate(neko):
    """qwen3_nekoqa.en.ipynb, cell "def generate(prompt)": greedy decoding through model(...).logits with num_microbatch=1."""
    tokenizer, _ = neko
    raw = raw_qwen3(tokenizer)
    ref = copy.deepcopy(raw)
    model = RoundPipe(raw, optim_dtype=torch.float32)

    @torch.no_grad()
    def generate(net, prompt, max_new_tokens=6, **call_kwargs):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        input_ids = tokenizer(text, return_tensors="pt")["input_ids"]
        for _ in range(max_new_tokens):
            outputs = net(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **call_kwargs)
            next_id = outputs.logits[:, -1, :].argmax(dim=-1, keepdim=True)
            input_ids = torch.cat([input_ids, next_id], dim=-1)
        return input_ids

    model.synchronize()
    model.eval()
    got = generate(model, "Good morning!", roundpipe_run_config=RoundPipeRunConfig(num_microbatch=1))
    model.train()
    torch.testing.assert_close(got, generate(ref.eval(), "Good morning!"))


def test_nekoqa_save_pretrained_after_synchronize(neko, tmp_path):
    """qwen3_nekoqa.en.ipynb, last cell: model.synchronize(); model.save_pretrained(dir) saves the trained weights."""
    from transformers import AutoModelForCausalLM

    tokenizer, text_input = neko
    raw = raw_qwen3(tokenizer)
    model = RoundPipe(
        raw, model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH), optim_dtype=torch.float32
    )
    optim = torch.optim.Adam(model.optim_parameters(), lr=1e-3)
    neko_train(model, tokenizer, text_input, optim, num_epochs=1)
    model.synchronize()
    model.save_pretrained(tmp_path / "finetuned")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "finetuned")
    ref, _ = neko_reference(tokenizer, text_input, num_epochs=1)
    assert_params_close(reloaded, ref, atol=1e-5, rtol=1e-4)
