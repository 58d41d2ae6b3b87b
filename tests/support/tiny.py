"""Tiny, fully local model and tokenizer assets.

laden must run with no model hub: the embedded default job, the examples and the tests
all use a character-level tokenizer built here with `tokenizers` and saved through
`save_pretrained`, so that what is exercised afterwards is the real
`AutoTokenizer.from_pretrained` loading path. The model is a random-init Qwen3 with a
few layers. Trade-off: a character vocabulary makes sequences long for their text, which
is what we want for exercising the token-budget code on a CPU.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARACTERS = string.ascii_letters + string.digits + string.punctuation + " \n"


def build_char_tokenizer(out_dir: str | Path) -> Path:
    """Build a character-level fast tokenizer with a ChatML template and save it to `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    vocab["<unk>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        bos_token=None,
        unk_token="<unk>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return out


def tiny_qwen3_config(
    vocab_size: int = 128,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
):
    """A Qwen3 config small enough to train on a CPU in seconds."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=hidden_size // num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=3,
        bos_token_id=None,
    )


def write_tiny_model_dir(out_dir: str | Path, **config_overrides) -> Path:
    """Write tokenizer files and a `config.json` (no weights) for a random-init tiny Qwen3.

    laden initialises a model from config alone when the directory has no weight files
    (`actor.init_from_config`), seeded by the run's `seed`.
    """
    out = build_char_tokenizer(out_dir)
    from transformers import AutoTokenizer

    vocab_size = len(AutoTokenizer.from_pretrained(out))
    cfg = tiny_qwen3_config(vocab_size=_round_up(vocab_size, 8), **config_overrides)
    cfg.save_pretrained(out)
    return out


def write_tiny_teacher(
    out_dir: str | Path, source: str | Path, *, seed: int, head_scale: float = 1.0
) -> Path:
    """A tiny model with weights (a teacher for distillation tests): `source`'s tokenizer and config.json,
    weights drawn with `seed`, the output head times `head_scale` (a sharper, more distinct distribution)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    shutil.copytree(source, out, dirs_exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(out)
    return out


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


if __name__ == "__main__":  # pragma: no cover - asset regeneration
    import sys

    path = write_tiny_model_dir(sys.argv[1] if len(sys.argv) > 1 else "laden/assets/tiny")
    print(json.dumps({"written": str(path)}))
