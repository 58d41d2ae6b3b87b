"""A trained reward model on disk: a Hugging Face sequence classifier with one label.

`laden rw` trains the causal LM with a one-row head (`laden.model.value_head`); its export renames that
head `score` and writes the config of the architecture's `...ForSequenceClassification` class with
`num_labels: 1`, the format of Hugging Face's reward models (TRL's, AReaL's token classifier with one
label), so `AutoModelForSequenceClassification.from_pretrained(RUN/hf)` loads it. That class scores the
last token that is not padding, the token laden trains the score at (the EOS appended to each text):
`score_texts` appends it too. A model type without a sequence-classification class is refused at export,
naming the type.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch


class _WithConfig:
    """What `laden.model.hf.export.export_hf` reads of a model: its config (the weights come separately)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.generation_config = None


def classifier_config(config: Any) -> Any:
    """`config` as its architecture's one-label sequence classifier's."""
    from transformers import AutoModelForSequenceClassification

    mapping = AutoModelForSequenceClassification._model_mapping
    if type(config) not in mapping:
        raise ValueError(
            f"model type {config.model_type!r} has no Hugging Face sequence-classification class, so its reward "
            "model cannot be exported in that format; train a reward model from a model type that has one "
            "(Llama, Qwen2, Qwen3, Mistral, ...)"
        )
    out = copy.deepcopy(config)
    classifier: Any = mapping[type(config)]
    out.architectures = [classifier.__name__]
    out.num_labels = 1
    out.tie_word_embeddings = False
    return out


def as_classifier(
    config: Any, weights: Iterable[tuple[str, torch.Tensor]], tokenizer: Any | None
) -> tuple[Any, Iterator[tuple[str, torch.Tensor]]]:
    """What `export_hf` takes for a value model written as a classifier: (a stand-in model with the
    classifier's config, the weights with the head named `score.weight`). The `convert` of an engine's
    `export_hf` (`laden rw`'s export) and of `laden export`."""
    out = classifier_config(config)
    eos = getattr(tokenizer, "eos_token_id", None)
    if out.pad_token_id is not None and out.pad_token_id == eos:
        # the classifier scores the last token that is not padding: with padding = EOS that would skip the EOS
        # the score was trained at; without one it scores the last token of an unpadded row
        out.pad_token_id = None
    renamed = ((("score.weight" if name == "lm_head.weight" else name), t) for name, t in weights)
    return _WithConfig(out), renamed


def load_reward_model(path: str | Path, *, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) of an exported reward model, the model in eval mode."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
    return model.eval(), AutoTokenizer.from_pretrained(path)


@torch.no_grad()
def score_texts(model: Any, tokenizer: Any, texts: Sequence[str]) -> list[float]:
    """The reward model's score of each text (tokenized as in training: `text + eos`), one at a time."""
    scores = []
    for text in texts:
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"]) + [tokenizer.eos_token_id]
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits  # [1, 1]
        scores.append(float(logits[0, 0]))
    return scores
