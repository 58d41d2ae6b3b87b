"""Tiny models, prompts and plain-PyTorch references (greedy decode, teacher-forced log-probs) for the native rollout engine's tests."""

from __future__ import annotations

import torch
from tiny import tiny_qwen3_config
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from laden.rollout import GenerationRequest, SamplingParams

EOS = 3


VOCAB = 96


def _model(kind: str = "qwen3", seed: int = 0, **overrides):
    """A tiny fp32 model of `kind`; `overrides`: config fields (e.g. Llama's `mlp_bias`)."""
    torch.manual_seed(seed)
    if kind == "qwen3":
        cfg = tiny_qwen3_config(vocab_size=VOCAB)
    elif kind == "llama":
        cfg = LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, max_position_embeddings=512, eos_token_id=EOS, tie_word_embeddings=True,
        )  # fmt: skip
    else:
        cfg = Qwen2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, eos_token_id=EOS, tie_word_embeddings=False,
        )  # fmt: skip
    cfg.update(overrides)
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    with torch.no_grad():  # visible biases so Qwen2's q/k/v (and any MLP) biases are exercised
        for layer in model.model.layers:
            projs = (
                layer.self_attn.q_proj,
                layer.self_attn.k_proj,
                layer.self_attn.v_proj,
                layer.mlp.down_proj,
            )
            for proj in projs:
                if proj.bias is not None:
                    proj.bias.normal_(0, 0.5)
    return model


def _prompts(n: int, seed: int = 1) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3 + (7 * i) % 23 for i in range(n)]  # uneven: 3 .. 25
    return [tuple(int(t) for t in torch.randint(4, VOCAB, (n_,), generator=g)) for n_ in lengths]


@torch.no_grad()
def reference_greedy(model, prompt, max_new: int, stop: set[int]) -> list[int]:
    """Plain loop: the whole sequence through the model each step, argmax of the last logits."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_new):
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
        ids.append(tok)
        if tok in stop:
            break
    return out


@torch.no_grad()
def teacher_forced_logprobs(model, prompt, output, temperature: float) -> torch.Tensor:
    ids = torch.tensor([[*prompt, *output]], device=model.device)
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0].cpu()


def _requests(prompts, **sampling) -> list[GenerationRequest]:
    n = sampling.pop("n_samples", 1)
    return [
        GenerationRequest(rid=f"r{i}", input_ids=p, sampling=SamplingParams(**sampling), n_samples=n)
        for i, p in enumerate(prompts)
    ]


def fresh_stop_string(text: str) -> str:
    """A stop string for greedy `text`: its first two characters from the 3rd on that were not seen
    before them, and whole (bytes that are not UTF-8 decode to U+FFFD, which no stop string holds)."""
    start = next(
        i
        for i in range(2, len(text) - 1)
        if text[i : i + 2] not in text[: i + 1] and "\ufffd" not in text[i : i + 2]
    )
    return text[start : start + 2]


# The benchmark's kernel options (benchmarks/run_rollout_h200.sh's `options` part), each as it
# runs there, and all of them together (the part's pick may join several)
KERNEL_OPTIONS = {
    "swiglu": {"triton_swiglu.IN_DECODE": True},
    "heads2": {"triton_decode.HEADS_PER_PROGRAM": 2},
    "prefetch3": {"triton_decode.PREFETCH_TABLE": True, "triton_decode.NUM_STAGES": 3},
    "maxreg128": {"triton_decode.MAX_REGISTERS": 128},
    "rows256": {"triton_linear.MAX_ROWS": 256},
    "cdf": {"triton_sampler.METHOD": "cdf"},
}


KERNEL_OPTIONS["all"] = {k: v for opt in KERNEL_OPTIONS.values() for k, v in opt.items()}
