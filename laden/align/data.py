"""Preference pairs: rows of one prompt with a chosen and a rejected completion, tokenized and packed.

A row is either

- `{"prompt": P, "chosen": C, "rejected": R}`: each side is tokenized as an SFT prompt/completion row
  (`laden.data.sft.tokenize_sft_record`: the chat template when the tokenizer has one, with P a string
  or a list of messages and C, R strings or lists of assistant messages; else `P + C + eos`), the
  loss tokens being the completion's; or
- `{"chosen": C, "rejected": R}` without a prompt column (AReaL's Anthropic/hh-rlhf form): C and R are
  whole texts (the dialogue so far and the answer), each tokenized as `text + eos`, and the prompt is
  their longest common token prefix (AReaL's rule), so the loss tokens are those after it.

Column names: `prompt_key`, `chosen_key`, `rejected_key` of the dataset section. A pair is longer than
`max_length` when either side is; `filter` drops it, `truncate` cuts both sides. A pair whose chosen or
rejected side keeps no loss token (one text a prefix of the other, or cut before its completion) is
dropped and counted as `num_no_loss_tokens`. Token counts in the statistics are per pair (both sides).

`pack_pairs` packs pairs as consecutive documents (chosen, then rejected), what the pair objectives of
`laden.align.objectives` read; `ref_logprobs` (DPO) rides as a per-token field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from laden.data.batch import PackedBatch, pack_samples
from laden.data.rows import keep_good_rows
from laden.data.sft import LengthStats, tokenize_sft_record

Side = tuple[list[int], list[int]]
"""One side of a pair: (input ids, loss mask)."""


@dataclass(slots=True)
class Pair:
    """A tokenized preference pair; `ref`: the reference model's log-probs per input token of each side (DPO)."""

    chosen: Side
    rejected: Side
    ref: tuple[list[float], list[float]] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.chosen[0]) + len(self.rejected[0])


def pair_row_problem(row: Any, *, chosen_key: str, rejected_key: str, prompt_key: str) -> str | None:
    """Why a row cannot be a preference pair, or None."""
    if not isinstance(row, Mapping):
        return f"the row is a {type(row).__name__}, not an object with {chosen_key!r} and {rejected_key!r}"
    for key in (chosen_key, rejected_key):
        value = row.get(key)
        if value is None:
            return (
                f"no {key!r} field (have {sorted(row)}); a preference row needs {chosen_key!r} and {rejected_key!r} "
                f"(set the dataset's chosen_key / rejected_key to its columns)"
            )
        if not isinstance(value, (str, list)) or (isinstance(value, str) and not value):
            return f"{key!r} is {value!r}: it must be a non-empty string or a list of chat messages"
    prompt = row.get(prompt_key)
    if prompt is not None and not isinstance(prompt, (str, list)):
        return f"{prompt_key!r} is a {type(prompt).__name__}: it must be a string or a list of chat messages"
    if prompt is None and not all(isinstance(row[k], str) for k in (chosen_key, rejected_key)):
        return f"without a {prompt_key!r} field, {chosen_key!r} and {rejected_key!r} must be whole texts (strings)"
    return None


def tokenize_pair(row: Mapping[str, Any], tokenizer: Any, *, prompt_key: str, chosen_key: str,
                  rejected_key: str) -> tuple[Side, Side]:  # fmt: skip
    """The two sides of a row (see the module docstring)."""
    if row.get(prompt_key) is not None:
        return tuple(  # type: ignore[return-value]
            tokenize_sft_record({"prompt": row[prompt_key], "completion": row[key]}, tokenizer)
            for key in (chosen_key, rejected_key)
        )
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            f"{getattr(tokenizer, 'name_or_path', 'the tokenizer')} has no eos token to end a text with"
        )
    chosen = list(tokenizer(row[chosen_key], add_special_tokens=True)["input_ids"]) + [eos]
    rejected = list(tokenizer(row[rejected_key], add_special_tokens=True)["input_ids"]) + [eos]
    common = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        common += 1
    return (chosen, [0] * common + [1] * (len(chosen) - common)), (
        rejected, [0] * common + [1] * (len(rejected) - common),
    )  # fmt: skip


def build_pairs(
    records: Sequence[Any],
    tokenizer: Any,
    *,
    max_length: int,
    length_policy: str = "filter",
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    on_bad_row: Any = "stop",
    field: str = "train_dataset",
) -> tuple[list[Pair], LengthStats]:
    """Check every row, tokenize the pairs and apply the length policy; the statistics account for every row."""
    rows, skipped = keep_good_rows(
        records,
        lambda row: pair_row_problem(row, chosen_key=chosen_key, rejected_key=rejected_key, prompt_key=prompt_key),
        on_bad_row=on_bad_row, field=field,
    )  # fmt: skip
    stats = LengthStats(num_records=len(rows) + skipped, num_skipped_bad_rows=skipped)
    pairs: list[Pair] = []
    for index, row in enumerate(rows):
        try:
            chosen, rejected = tokenize_pair(
                row, tokenizer, prompt_key=prompt_key, chosen_key=chosen_key, rejected_key=rejected_key
            )
        except ValueError as e:
            raise ValueError(f"{rows.where(index)}: {e}") from e
        longest = max(len(chosen[0]), len(rejected[0]))
        stats.max_num_tokens_raw = max(stats.max_num_tokens_raw, len(chosen[0]) + len(rejected[0]))
        if longest > max_length:
            if length_policy == "filter":
                stats.num_filtered += 1
                continue
            chosen = (chosen[0][:max_length], chosen[1][:max_length])
            rejected = (rejected[0][:max_length], rejected[1][:max_length])
            stats.num_truncated += 1
        if not any(chosen[1][1:]) or not any(rejected[1][1:]):  # the first token is never a target
            stats.num_no_loss_tokens += 1
            continue
        pair = Pair(chosen=chosen, rejected=rejected)
        pairs.append(pair)
        stats.num_loss_tokens += sum(chosen[1][1:]) + sum(rejected[1][1:])
        stats.max_num_tokens = max(stats.max_num_tokens, pair.num_tokens)
    stats.num_kept = len(pairs)
    stats.mean_num_tokens = sum(p.num_tokens for p in pairs) / max(len(pairs), 1)
    if not pairs:
        raise ValueError(
            f"{field}: no preference pair is left of {stats.num_records} rows of {getattr(rows, 'source', 'the data')} "
            f"({stats.num_filtered} longer than {field}.max_length={max_length}, {stats.num_no_loss_tokens} without "
            f"a completion token on both sides); raise {field}.max_length or fix the data"
        )
    return pairs, stats


def pack_pairs(pairs: Sequence[Pair], *, with_ref: bool = False) -> PackedBatch:
    """One micro-batch of `pairs`, chosen then rejected per pair; `with_ref`: each side's `ref` log-probs
    as the per-token field `ref_logprobs`."""
    sides = [side for p in pairs for side in (p.chosen, p.rejected)]
    if not with_ref:
        return pack_samples(sides)
    missing = [i for i, p in enumerate(pairs) if p.ref is None]
    if missing:
        raise ValueError(
            f"pairs {missing[:5]} have no reference log-probs; compute them before packing with_ref"
        )
    refs = [r for p in pairs for r in p.ref]  # type: ignore[union-attr]
    return pack_samples(sides, fields={"ref_logprobs": refs})
