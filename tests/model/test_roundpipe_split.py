"""laden.model.split: a causal LM as embed / decoder steps / head == the model's own forward."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_qwen3_config
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from laden.model.split import causal_lm_loss, shift_labels, split_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def build(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "qwen3":
        from transformers import Qwen3ForCausalLM

        return Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=48, hidden_size=32, intermediate_size=64))
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**SMALL))
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**SMALL))
    return MistralForCausalLM(MistralConfig(**SMALL, sliding_window=4))  # windows shorter than the text


def run_split(model: nn.Module, **inputs):
    split = split_causal_lm(model)
    x = split.layers[0](**inputs)
    for layer in split.layers[1:]:
        x = layer(x)
    return x


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "mistral"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_split_equals_model_forward_on_padded_batch(family, attn):
    model = build(family)
    model.config._attn_implementation = attn
    ids = torch.randint(0, 48, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    expected = model(input_ids=ids, attention_mask=mask).logits
    out = run_split(model, input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(out.logits[mask.bool()], expected[mask.bool()])
    labels = shift_labels(torch.where(mask.bool(), ids, -100))
    loss = causal_lm_loss(out, labels)
    ref = nn.functional.cross_entropy(expected.reshape(-1, 48), labels.reshape(-1), reduction="sum")
    torch.testing.assert_close(loss, ref)


@pytest.mark.parametrize("attn", ["eager", "sdpa", "laden_varlen"])
def test_packed_row_equals_documents_run_alone(attn):
    model = build("qwen3")
    if attn == "laden_varlen":
        from laden.model.attention import set_attention

        set_attention(model, "varlen")
    else:
        model.config._attn_implementation = attn
    lengths = [4, 3, 5]
    docs = [torch.randint(0, 48, (n,)) for n in lengths]
    cu = torch.tensor([0, 4, 7, 12], dtype=torch.int32)
    out = run_split(
        model, input_ids=torch.cat(docs)[None], position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5,
    )  # fmt: skip
    expected = torch.cat([model(input_ids=d[None]).logits for d in docs], dim=1)
    torch.testing.assert_close(out.logits, expected)


def test_tied_embedding_stays_one_parameter():
    cfg = tiny_qwen3_config(vocab_size=48)
    cfg.tie_word_embeddings = True
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(cfg)
    split = split_causal_lm(model)
    assert split.layers[-1].lm_head.weight is split.layers[0].embed_tokens.weight
    assert split.num_decoder_layers == cfg.num_hidden_layers


def test_unsupported_models_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="supported model types"):
        split_causal_lm(nn.Sequential(nn.Linear(2, 2)))
    model = build("llama")
    with pytest.raises(ValueError, match="unexpected model inputs"):
        run_split(model, input_ids=torch.zeros(1, 3, dtype=torch.long), token_type_ids=torch.zeros(1, 3))


def saved_activation_bytes(fn, params) -> int:
    """Bytes of the tensors autograd saves while `fn` runs, parameters excluded (storages once)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activation_estimate_matches_what_autograd_saves(dtype):
    """The planner's per-layer estimate (kept bytes) against the tensors a decoder step and the head
    (norm + chunked loss) really save for backward, on a packed row of two documents."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from laden.model.attention import set_attention
    from laden.model.split import activation_bytes

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=128, intermediate_size=384, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=500, tie_word_embeddings=True)  # fmt: skip
    model = Qwen3ForCausalLM(cfg).to(dtype)
    set_attention(model, "varlen")
    split = split_causal_lm(model)
    num_tokens = 256
    ids = torch.randint(0, 500, (1, num_tokens))
    cu = torch.tensor([0, 100, num_tokens], dtype=torch.int32)
    state = split.layers[0](
        input_ids=ids, position_ids=torch.cat([torch.arange(100), torch.arange(num_tokens - 100)])[None],
        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=156, max_length_k=156,
    )  # fmt: skip
    state = state.with_hidden(state.hidden_states.detach().requires_grad_(True))
    decoder, head = split.layers[1], split.layers[-1]
    cases = [
        (decoder, lambda: decoder(state), {}),
        (head, lambda: causal_lm_loss(head(state), ids, chunk_size=64), {"loss_chunk_size": 64}),
    ]
    for step, run, extra in cases:
        measured = saved_activation_bytes(run, model.parameters())
        kept, transient = activation_bytes(step, num_tokens, dtype=dtype, **extra)
        assert 0.9 * measured <= kept <= 1.25 * measured, (type(step).__name__, kept, measured)
        assert transient > 0
    assert activation_bytes(nn.Linear(2, 2), num_tokens, dtype=dtype) == (0, 0)


@pytest.mark.parametrize("lean", [False, True], ids=["hf_norms", "lean_norms"])
@pytest.mark.parametrize("lean_mlp", [False, True], ids=["hf_mlp", "lean_mlp"])
@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled_mlp"])
def test_decoder_activation_estimate_follows_the_long_context_knobs(tiled, lean_mlp, lean):
    """The planner's kept-activation estimate of a decoder layer is conservative and close (within
    15%) to what autograd saves, with and without the tiled MLP, the lean MLP and the lean RMSNorms.
    Measured on a row of unequal documents (the per-document path, which saves the most); a row of
    equal ones (one SDPA batch) saves less, so the estimate stays conservative there."""
    from lean_cases import _layer_saved_bytes
    from transformers import AutoModelForCausalLM, Qwen3Config

    from laden.model.attention import set_attention
    from laden.model.patches.lean_mlp import enable_lean_mlp
    from laden.model.patches.lean_norm import enable_lean_rmsnorm
    from laden.model.patches.tiled import enable_tiled_mlp
    from laden.model.split import DecoderStep, activation_bytes

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=256, intermediate_size=768, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, vocab_size=128)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    set_attention(model, "auto")
    tile = 64
    if lean_mlp:
        enable_lean_mlp(model)
    if tiled:
        enable_tiled_mlp(model, tile_tokens=tile)
    if lean:
        enable_lean_rmsnorm(model)
    num_tokens = 256
    measured = _layer_saved_bytes(model, num_tokens, documents=(100, 156))[0] / num_tokens
    equal_documents = _layer_saved_bytes(model, num_tokens)[0] / num_tokens
    assert equal_documents < measured
    step = next(s for s in split_causal_lm(model).layers if isinstance(s, DecoderStep))
    kept, transient = activation_bytes(step, num_tokens, dtype=torch.bfloat16)
    assert measured <= kept / num_tokens <= 1.15 * measured
    tile_work = 2 * tile * 4 * config.intermediate_size * 2 if tiled else 0
    assert transient == kept + tile_work
