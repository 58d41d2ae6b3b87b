"""Mixture-of-experts families under the roundpipe engine, and LoRA on memory-mapped weights.

Qwen3-MoE (a dense layer among sparse ones) and GPT-OSS (attention sinks, sliding and full
layers, biased experts) split and train like the dense families: streamed == resident, for the
`RoundPipe` wrapper and for the engine with lean activations (which skip the layers they cannot
handle). LoRA with `pin_model="off"` on a model loaded from safetensors keeps the frozen base
weights as file-backed views of the checkpoint, and trains exactly as LoRA on a resident model.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from tiny import tiny_qwen3_config
from torch import nn
from transformers import AutoModelForCausalLM, GptOssConfig, Qwen3MoeConfig

from laden import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from laden.data.batch import pack_samples
from laden.engine.roundpipe import RoundPipeEngine
from laden.model.lora import LoraSettings, apply_lora
from laden.model.loss import chunked_linear_cross_entropy
from laden.model.patches.apply import apply_patches
from laden.model.split import causal_lm_loss, shift_labels, split_causal_lm
from laden.optim import OptimSettings, param_groups_with_decay

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:the largest layer needs .* activations of:UserWarning"),
    pytest.mark.filterwarnings("ignore:enable_lean_.* left .* as is:UserWarning"),
]
VOCAB = 64


def qwen3_moe_config(**overrides) -> Qwen3MoeConfig:
    """Three layers: sparse, dense (`mlp_only_layers`), sparse; 4 experts, 2 per token."""
    base = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=False, pad_token_id=0,
    )  # fmt: skip
    return Qwen3MoeConfig(**{**base, **overrides})


def gpt_oss_config(**overrides) -> GptOssConfig:
    """Three layers alternating a 4-token sliding window and full attention; 4 experts, 2 per token."""
    base = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=False,
        pad_token_id=0,
    )  # fmt: skip
    return GptOssConfig(**{**base, **overrides})


FAMILIES = {"qwen3_moe": qwen3_moe_config, "gpt_oss": gpt_oss_config}


def family_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[name](), dtype=torch.float32)
    # from_config leaves the routers at zero (ties everywhere); give them a real routing
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            nn.init.normal_(module.weight, std=0.5)
    return model


def padded_batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[3, 4:] = 0
    return ids, mask, shift_labels(torch.where(mask.bool(), ids, -100))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_moe_families_streamed_equal_resident(family, grain):
    model = family_model(family)
    assert split_causal_lm(model).num_decoder_layers == 3
    ref = copy.deepcopy(model)
    ids, mask, labels = padded_batch()
    logits = ref(input_ids=ids, attention_mask=mask).logits
    ref_loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    ref_loss.backward()
    rp = RoundPipe(model)
    plan = ModelExecutePlan(fwd_plan=[range(0, 3)], bwd_plan=[range(3, 5), range(1, 3), range(0, 1)])
    cfg = RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain, execute_plan=plan)
    loss = rp.forward_backward(input_kwargs={"input_ids": ids, "attention_mask": mask}, label=labels,
                               loss_fn=causal_lm_loss, run_config=cfg)  # fmt: skip
    rp.synchronize()
    torch.testing.assert_close(loss, ref_loss.detach())
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, p_ref.grad, msg=name)


def packed_steps(num_steps: int) -> list[list]:
    gen = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(num_steps):
        docs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (6, 4, 7, 3)]
        samples = [(d, [1] * len(d)) for d in docs]
        steps.append([pack_samples(samples[:2]), pack_samples(samples[2:])])
    return steps


def reference_step(model: nn.Module, micro_batches: list, num_tokens: int) -> torch.Tensor:
    """Per-document HF forward and backward of the summed token loss over the global count."""
    total = torch.zeros(())
    for mb in micro_batches:
        for doc in mb.input_ids.split(mb.seqlens):
            hidden = model.model(input_ids=doc[None]).last_hidden_state[0]  # [T, H]
            loss = chunked_linear_cross_entropy(hidden, model.lm_head.weight, shift_labels(doc[None])[0])
            (loss / num_tokens).backward()
            total = total + loss.detach() / num_tokens
    return total


def adam(**overrides) -> OptimSettings:
    base = dict(type="adam", lr=1e-2, eps=1e-4, weight_decay=0.1, gradient_clipping=1.0, total_steps=10)
    return OptimSettings(**{**base, **overrides})


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_with_lean_activations_trains_moe_families_as_resident_adamw(family, recwarn):
    model = family_model(family)
    ref = copy.deepcopy(model)
    report = apply_patches(model, lean_activations=True, fused_elementwise=False, tiled_mlp_tokens=None)
    skipped = {s.patch: s.reason for s in report.skipped}
    assert "lean MLP" in skipped  # the expert blocks keep Hugging Face's backward, with a log line
    assert any("left" in str(w.message) and "as is" in str(w.message) for w in recwarn)
    o = adam()
    opt = torch.optim.AdamW(
        param_groups_with_decay(ref.named_parameters(), o.weight_decay), lr=o.lr, eps=o.eps
    )
    engine = RoundPipeEngine(model, optim=o, compute_dtype=torch.float32, recompute_grain="layer",
                             model_memory_limit=0.0004)  # fmt: skip
    for mbs in packed_steps(2):
        num_tokens = sum(mb.num_loss_tokens for mb in mbs)
        ref_loss = reference_step(ref, mbs, num_tokens)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), o.gradient_clipping)
        opt.step()
        opt.zero_grad()
        out = engine.train_batch(mbs, global_num_loss_tokens=num_tokens)
        torch.testing.assert_close(out["loss"], ref_loss)
        torch.testing.assert_close(out["grad_norm"], ref_norm)
    masters = engine.state_dict()["model"]
    for name, p in ref.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_router_aux_loss_config_is_refused_with_the_fix(family):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](output_router_logits=True))
    with pytest.raises(ValueError, match="output_router_logits = False"):
        split_causal_lm(model)


# ---- LoRA on memory-mapped weights ------------------------------------------------------


def file_backing(t: torch.Tensor) -> str | None:
    """The file mapped at `t`'s storage (from /proc/self/maps), or None for anonymous memory."""
    ptr = t.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if start <= ptr < end:
            return parts[5] if len(parts) > 5 and parts[5].startswith("/") else None
    return None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random-init Qwen3 saved as safetensors (fp32)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=VOCAB, num_hidden_layers=3))
    out = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(out)
    return out


def lora_model(checkpoint: Path, *, mmap: bool) -> nn.Module:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    if not mmap:  # the same weights copied into anonymous memory
        model = copy.deepcopy(model)
    apply_lora(model, LoraSettings(rank=4, alpha=8.0), seed=0)
    return model


needs_proc_maps = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


@needs_proc_maps
def test_frozen_base_stays_a_file_backed_mmap_while_lora_trains(checkpoint):
    model = lora_model(checkpoint, mmap=True)
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    weights_file = str((checkpoint / "model.safetensors").resolve())
    assert {file_backing(p) for p in frozen.values()} == {weights_file}
    engine = RoundPipeEngine(model, optim=adam(), compute_dtype=torch.float32, pin_model="off",
                             model_memory_limit=0.0004)  # fmt: skip
    losses = [engine.train_batch(mbs, global_num_loss_tokens=sum(m.num_loss_tokens for m in mbs))["loss"]
              for mbs in packed_steps(1) * 4]  # fmt: skip
    assert losses[-1] < losses[0]
    store = engine.pipe.store
    trainable = [hp for hp in store.params if hp.param.requires_grad]
    assert trainable and all(".lora_" in hp.name for hp in trainable)  # only adapters get masters
    for name, p in model.named_parameters():
        if name in frozen:
            assert p is frozen[name] or p.data_ptr() == frozen[name].data_ptr(), name
            assert file_backing(p) == weights_file, name
    states = engine.optimizer.state
    assert sum(len(states[p]) > 0 for p in states) == len(trainable)  # Adam states for the adapters alone


def test_lora_on_mmap_equals_lora_on_a_resident_model(checkpoint):
    engines = []
    for mmap, pin_model in ((True, "off"), (False, "alloc")):
        engines.append(RoundPipeEngine(lora_model(checkpoint, mmap=mmap), optim=adam(), pin_model=pin_model,
                                       compute_dtype=torch.float32, model_memory_limit=0.0004))  # fmt: skip
    for mbs in packed_steps(3):
        num_tokens = sum(mb.num_loss_tokens for mb in mbs)
        got, want = (e.train_batch(mbs, global_num_loss_tokens=num_tokens) for e in engines)
        torch.testing.assert_close(got["loss"], want["loss"])
        torch.testing.assert_close(got["grad_norm"], want["grad_norm"])
    got_state, want_state = (e.state_dict()["model"] for e in engines)
    assert set(got_state) == set(want_state)
    for name, t in want_state.items():
        torch.testing.assert_close(got_state[name], t, msg=name)


@needs_proc_maps
def test_wrapped_lora_model_on_mmap_optimizes_only_adapters(checkpoint):
    model = lora_model(checkpoint, mmap=True)
    ref = lora_model(checkpoint, mmap=False)
    rp = RoundPipe(model, pin_model="off")
    names = [n for n, _ in rp.optim_named_parameters()]
    assert names and all(".lora_" in n for n in names)
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    ids, mask, labels = padded_batch()
    cfg = RoundPipeRunConfig(num_microbatch=2, recompute_grain="layer")
    for _ in range(2):
        logits = ref(input_ids=ids, attention_mask=mask).logits
        nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum").backward()
        opt_ref.step()
        opt_ref.zero_grad()
        rp.forward_backward(input_kwargs={"input_ids": ids, "attention_mask": mask}, label=labels,
                            loss_fn=causal_lm_loss, run_config=cfg)  # fmt: skip
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    weights_file = str((checkpoint / "model.safetensors").resolve())
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(p, p_ref, msg=name)
        if not p.requires_grad:
            assert file_backing(p) == weights_file, name
