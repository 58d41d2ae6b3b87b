"""`laden sft`'s held-out accuracy (`evaluator.generate`): greedy completions of the held-out prompts, exact match.

The loss on `valid_dataset` says how likely the reference answers are; it does not say whether the model
answers correctly. With `evaluator.generate`, each evaluation also generates greedily for every held-out
prompt (the prompt rendered as in training: the chat template's generation prompt, or the plain prompt)
and counts the completions equal to the reference completion (both stripped of surrounding whitespace):
`eval/accuracy` in metrics.jsonl, next to `eval_loss`. A run evaluates before its first step and after
its last, so the log shows three held-out prompts' completions before -> after.

How: the engine's full weights (`named_weights`, every rank takes part) are loaded into a plain Hugging
Face model on the host and `generate` runs there, rank 0 only. What it costs: a host copy of the model
and unbatched CPU generation, a few seconds for the tiny embedded model and 20 prompts; meant for small
models and held-out sets (a large model's held-out accuracy is `laden rl`'s evaluator on the rollout engine).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from laden.data.overlap import prompt_overlap

log = logging.getLogger("laden.sft")

NUM_SHOWN = 3
"""Held-out prompts whose completions the log shows before -> after."""


@dataclass(kw_only=True, slots=True)
class HeldOutPrompt:
    """One held-out row: the prompt's token ids and the completion it should get."""

    text: str
    """The prompt as the log shows it."""
    prompt_ids: list[int]
    reference: str


@dataclass(kw_only=True, slots=True)
class GenerationResult:
    """One evaluation's exact-match accuracy and the completions it was computed from, in row order."""

    accuracy: float
    completions: list[str] = field(default_factory=list)


def held_out_prompts(
    records: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    prompt_key: str,
    completion_key: str,
    messages_key: str,
) -> list[HeldOutPrompt]:
    """The rows' prompts rendered for generation and their references: the last assistant turn of a chat row
    (its earlier turns are the prompt), the completion of a prompt/completion row."""
    return [_held_out(row, tokenizer, prompt_key, completion_key, messages_key) for row in records]


def _held_out(
    row: Mapping[str, Any], tokenizer: Any, prompt_key: str, completion_key: str, messages_key: str
):
    if row.get(messages_key) is not None:
        turns = list(row[messages_key])
        last = max(i for i, t in enumerate(turns) if t.get("role") == "assistant")
        prompt, reference = turns[:last], str(turns[last]["content"])
    else:
        prompt, reference = [{"role": "user", "content": str(row[prompt_key])}], str(row[completion_key])
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    else:  # a plain prompt/completion row trains on `prompt + completion + eos` (`laden.data.sft`)
        text = "".join(str(turn["content"]) for turn in prompt)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return HeldOutPrompt(
        text="\n".join(str(t["content"]) for t in prompt), prompt_ids=ids, reference=reference
    )


def check_disjoint(
    train: Sequence[Mapping[str, Any]],
    held_out: Sequence[Mapping[str, Any]],
    prompt_key: str,
    held_out_key: str,
) -> None:
    """Warn when held-out prompts are also training prompts: their accuracy would measure recall, not learning.
    `prompt_key` and `held_out_key`: each dataset's own prompt field."""
    overlap = prompt_overlap(train, held_out, prompt_key, held_out_key)
    if overlap.num_shared:
        log.warning(
            "valid_dataset: %s; evaluator.generate's accuracy counts them too. Remove them from valid_dataset for "
            "an accuracy on prompts the model never saw", overlap.summary(),
        )  # fmt: skip


def generate_accuracy(
    engine: Any, model_config: Any, tokenizer: Any, prompts: Sequence[HeldOutPrompt], *, is_main: bool
) -> GenerationResult | None:
    """Greedy exact-match accuracy of the engine's current weights on `prompts` (every rank calls it; rank 0
    generates and returns the result, the others None)."""
    weights = {name: t for name, t in engine.named_weights(torch.float32, device="cpu")}
    if not is_main:
        return None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    missing, _ = model.load_state_dict(weights, strict=False)
    if any(name != "lm_head.weight" for name in missing):  # a tied head is not exported on its own
        raise RuntimeError(f"evaluator.generate: the engine's weights lack {missing[:3]}")
    model.tie_weights()
    completions = [_complete(model.eval(), tokenizer, p) for p in prompts]
    correct = sum(c.strip() == p.reference.strip() for c, p in zip(completions, prompts))
    return GenerationResult(accuracy=correct / max(1, len(prompts)), completions=completions)


@torch.no_grad()
def _complete(model: Any, tokenizer: Any, prompt: HeldOutPrompt) -> str:
    """The greedy completion, up to the end-of-sequence token or twice the reference's length in tokens."""
    max_new_tokens = 2 * len(tokenizer(prompt.reference, add_special_tokens=False)["input_ids"]) + 2
    ids = torch.tensor([prompt.prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )  # fmt: skip
    return tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)


@dataclass(kw_only=True, slots=True)
class HeldOutAccuracy:
    """`evaluator.generate` over a run: each evaluation's accuracy, kept for the before -> after lines."""

    prompts: list[HeldOutPrompt]
    model_config: Any
    tokenizer: Any
    is_main: bool
    results: list[tuple[int, GenerationResult]] = field(default_factory=list)
    """(step, result) of each evaluation of this process, on rank 0."""

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any, *, is_main: bool) -> HeldOutAccuracy:
        """The held-out prompts of `cfg.valid_dataset`, checked against `cfg.train_dataset`'s."""
        from transformers import AutoConfig

        from laden.data import read_dataset

        held_out = read_dataset(cfg.valid_dataset, field="valid_dataset")
        if is_main:
            train = read_dataset(cfg.train_dataset, field="train_dataset")
            check_disjoint(train, held_out, cfg.train_dataset.prompt_key, cfg.valid_dataset.prompt_key)
        ds = cfg.valid_dataset
        keys = {
            "prompt_key": ds.prompt_key,
            "completion_key": ds.completion_key,
            "messages_key": ds.messages_key,
        }
        return cls(prompts=held_out_prompts(held_out, tokenizer, **keys), tokenizer=tokenizer, is_main=is_main,
                   model_config=AutoConfig.from_pretrained(cfg.actor.path))  # fmt: skip

    def __call__(self, engine: Any, step: int) -> float | None:
        """The accuracy of the engine's weights after `step` (rank 0; None elsewhere)."""
        result = generate_accuracy(
            engine, self.model_config, self.tokenizer, self.prompts, is_main=self.is_main
        )
        if result is None:
            return None
        self.results.append((step, result))
        return result.accuracy

    def before_after(self) -> list[str]:
        """The log's before -> after lines (rank 0, once two evaluations ran; else none)."""
        if len(self.results) < 2:
            return []
        return log_before_after(self.prompts, self.results[0][1], self.results[-1][1])


def log_before_after(
    prompts: Sequence[HeldOutPrompt], before: GenerationResult, after: GenerationResult
) -> list[str]:
    """Log (and return) the held-out accuracy and `NUM_SHOWN` prompts' completions before -> after training."""
    lines = [
        f"held-out accuracy {before.accuracy:.3f} -> {after.accuracy:.3f} ({len(prompts)} prompts, exact match)"
    ]
    for p, b, a in list(zip(prompts, before.completions, after.completions))[:NUM_SHOWN]:
        lines.append(f"  {p.text!r}: {b.strip()!r} -> {a.strip()!r} (reference {p.reference!r})")
    for line in lines:
        log.info("%s", line)
    return lines
