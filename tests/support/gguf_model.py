"""A tiny Qwen3 written as a GGUF file (optionally with a byte-level BPE tokenizer), for loading tests."""

from __future__ import annotations

import torch

# A byte-level BPE vocabulary for a GGUF file: the 256 byte symbols, a few merges, and `<|im_end|>`
# marked as a control token (the end of sequence)
GGUF_MERGES = ["a b", "c d", "ab cd", "e f", "ef g", "Ġ a", "h i"]


GGUF_EOS = "<|im_end|>"


def _gguf_tokens():
    """The vocabulary: byte-level BPE spells byte b as chr(b) when printable, else as chr(256 + k)
    for the k-th unprintable byte (GPT-2's byte alphabet), then the merged tokens and the EOS."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1))
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    spelled, k = [], 0
    for b in range(256):
        spelled.append(chr(b) if b in printable else chr(256 + k))
        k += b not in printable
    return spelled + [m.replace(" ", "") for m in GGUF_MERGES] + [GGUF_EOS]


def _write_tiny_gguf(path, *, tokenizer=False):
    """A random tiny Qwen3 written as an fp32 GGUF file with the `gguf` package's writer; with
    `tokenizer`, the file carries a byte-level BPE tokenizer too (`tokenizer.ggml.*`)."""
    import gguf
    from tiny import tiny_qwen3_config
    from transformers import Qwen3ForCausalLM

    tokens = _gguf_tokens() if tokenizer else []
    # head_dim 128: transformers' GGUF reader does not read head_dim and assumes Qwen3's default.
    cfg = tiny_qwen3_config(
        vocab_size=len(tokens) or 64, hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).float()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_name("tiny")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types(
            [gguf.TokenType.CONTROL if t == GGUF_EOS else gguf.TokenType.NORMAL for t in tokens]
        )
        writer.add_token_merges(GGUF_MERGES)
        writer.add_eos_token_id(tokens.index(GGUF_EOS))
    for name, tensor in model.state_dict().items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
