"""SFT records -> token ids with a loss mask, and the `max_length` policy.

Assistant spans are found by rendering message prefixes with the tokenizer's own chat
template rather than by matching role markers of known templates: for assistant turn i,
`render(messages[:i], add_generation_prompt=True)` ends where the model starts generating,
and `render(messages[:i + 1])` ends after the turn. The loss covers what the model must
produce there: the tokens between the two renderings up to and including the turn's last
special token (the end-of-turn token, e.g. `<|im_end|>`; the whole turn if it has none);
tokens the template adds after it (a newline) are not trained. This works for any template whose renderings of message
prefixes are prefixes of the whole rendering (token by token); templates that rewrite
earlier turns (e.g. dropping past reasoning) are rejected with an error, not mis-masked.
Cost: one rendering and tokenization per assistant turn, quadratic in the number of turns.

Every row's shape is checked before any is tokenized (`laden.data.rows.check_sft_rows`): a row that
cannot be used stops the run at start-up naming its `path:line`, or is left out and counted
(`on_bad_row`).

Samples hold Python lists: about 44 bytes of host memory per token (an int object and a
pointer for the id, a pointer to a cached 0/1 for the mask), ~0.45 GB for 10M tokens, in
exchange for samples that pack directly with no conversion.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, NamedTuple, cast

from laden.data.rows import OnBadRow, check_sft_rows
from laden.data.sources import Records

LENGTH_POLICIES = ("filter", "truncate")


class Sample(NamedTuple):
    """One tokenized training sequence; unpacks as `(input_ids, loss_mask)`."""

    input_ids: list[int]
    loss_mask: list[int]


@dataclass(kw_only=True, slots=True)
class LengthStats:
    """What the row check and the `max_length` policy did to a dataset; every record lands in kept,
    filtered, no-loss or skipped."""

    num_records: int = 0
    """Records read (bad rows included)."""
    num_skipped_bad_rows: int = 0
    """Rows left out because they cannot be used (`on_bad_row: skip`; see `laden.data.rows`)."""
    num_kept: int = 0
    """Samples kept (including truncated ones)."""
    num_filtered: int = 0
    """Samples dropped for being longer than `max_length` (policy `filter`)."""
    num_truncated: int = 0
    """Kept samples that were cut to `max_length` (policy `truncate`)."""
    num_no_loss_tokens: int = 0
    """Samples dropped because no token carries loss (no assistant turn, or truncated before it)."""
    max_num_tokens_raw: int = 0
    """Longest sample before the policy, in tokens."""
    max_num_tokens: int = 0
    """Longest kept sample, in tokens."""
    mean_num_tokens: float = 0.0
    """Mean length of kept samples, in tokens."""
    num_loss_tokens: int = 0
    """Tokens with loss over all kept samples."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tokenize_sft_record(
    record: Mapping[str, Any],
    tokenizer: Any,
    *,
    prompt_key: str = "prompt",
    completion_key: str = "completion",
    messages_key: str = "messages",
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[int], list[int]]:
    """Tokenize one SFT record into `(input_ids, loss_mask)`; loss only on assistant turns.

    A `messages_key` record keeps its roles; a prompt/completion record becomes a user turn
    and an assistant turn (either side may also be a list of messages). Without a chat
    template, a prompt/completion record is `prompt + completion + eos` with loss on
    `completion + eos`.
    """
    messages = _record_messages(record, prompt_key, completion_key, messages_key)
    if getattr(tokenizer, "chat_template", None):
        return _tokenize_chat(messages, tokenizer, dict(chat_template_kwargs or {}))
    if messages_key in record:
        raise ValueError(
            f"a {messages_key!r} record needs a tokenizer with a chat template, and "
            f"{_tokenizer_name(tokenizer)} has none; set `tokenizer.chat_template` or use "
            f"{prompt_key!r}/{completion_key!r} records"
        )
    return _tokenize_plain(record[prompt_key], record[completion_key], tokenizer)


def build_sft_samples(
    records: Iterable[Mapping[str, Any]],
    tokenizer: Any,
    *,
    max_length: int,
    length_policy: Literal["filter", "truncate"] = "filter",
    prompt_key: str = "prompt",
    completion_key: str = "completion",
    messages_key: str = "messages",
    chat_template_kwargs: Mapping[str, Any] | None = None,
    source: str | None = None,
    on_bad_row: OnBadRow = "stop",
    field: str = "train_dataset",
) -> tuple[list[Sample], LengthStats]:
    """Check every row, tokenize them and apply the `max_length` policy; the stats account for every record.

    `source` names the records in errors (default: the `source` of `load_records`' result), each
    by its `path:line` (`Records.where`). A row that cannot be used (`check_sft_rows`) is a
    ValueError naming the first (`on_bad_row="stop"`; `field` names the dataset in the fix) or is
    left out and counted in `num_skipped_bad_rows` (`"skip"`). Raises ValueError naming the source
    when no record is left: none given, none with a loss token (no assistant turn), or all longer
    than `max_length`.
    """
    source = source or getattr(records, "source", None) or "the dataset"
    if not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length={max_length!r} must be an integer >= 2 (train_dataset.max_length)")
    if length_policy not in LENGTH_POLICIES:
        raise ValueError(
            f"length_policy={length_policy!r} is not one of {LENGTH_POLICIES} (train_dataset.length_policy)"
        )
    rows, num_skipped = check_sft_rows(
        records if isinstance(records, Records) else Records(cast(list[dict[str, Any]], list(records)), source=source),
        prompt_key=prompt_key, completion_key=completion_key, messages_key=messages_key,
        on_bad_row=on_bad_row, field=field,
    )  # fmt: skip
    samples: list[Sample] = []
    stats = LengthStats(num_records=len(rows) + num_skipped, num_skipped_bad_rows=num_skipped)
    num_cut_before_loss = 0  # no-loss samples whose loss tokens were all cut by `truncate`
    for index, record in enumerate(rows):
        try:
            input_ids, loss_mask = tokenize_sft_record(
                record,
                tokenizer,
                prompt_key=prompt_key,
                completion_key=completion_key,
                messages_key=messages_key,
                chat_template_kwargs=chat_template_kwargs,
            )
        except ValueError as e:
            raise ValueError(f"{rows.where(index)}: {e}") from e
        stats.max_num_tokens_raw = max(stats.max_num_tokens_raw, len(input_ids))
        if len(input_ids) > max_length:
            if length_policy == "filter":
                stats.num_filtered += 1
                continue
            input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
            truncated = True
        else:
            truncated = False
        # The first token is never a target, so its mask bit does not count.
        if not any(loss_mask[1:]):
            stats.num_no_loss_tokens += 1
            num_cut_before_loss += truncated
            continue
        stats.num_truncated += truncated
        stats.num_loss_tokens += sum(loss_mask[1:])
        samples.append(Sample(input_ids, loss_mask))
    stats.num_kept = len(samples)
    if not samples:
        keys = (completion_key, messages_key)
        raise ValueError(_nothing_kept_message(source, stats, num_cut_before_loss, max_length, keys))
    lengths = [len(s.input_ids) for s in samples]
    stats.max_num_tokens = max(lengths)
    stats.mean_num_tokens = sum(lengths) / len(lengths)
    return samples, stats


def _nothing_kept_message(
    source: str, stats: LengthStats, num_cut_before_loss: int, max_length: int, keys: tuple[str, str]
) -> str:
    """Why no sample of `source` is left, with the fix for each cause; `keys`: (completion, messages)."""
    if stats.num_records == 0:
        return f"{source} has no records; a dataset needs at least one record"
    completion, messages = keys
    causes = []
    num_no_assistant = stats.num_no_loss_tokens - num_cut_before_loss
    if num_no_assistant:
        causes.append(
            f"{num_no_assistant} have no loss tokens (no assistant turn in {messages!r}, or an empty "
            f"{completion!r}): give each record a {{'role': 'assistant'}} message in {messages!r} "
            f"or a non-empty {completion!r} (or set the dataset's prompt_key/completion_key/"
            "messages_key to the columns that hold them)"
        )
    if num_cut_before_loss:
        causes.append(
            f"{num_cut_before_loss} lose every loss token when truncated to max_length={max_length} "
            "(the assistant turn starts later): raise the dataset's max_length"
        )
    if stats.num_skipped_bad_rows:
        causes.append(f"{stats.num_skipped_bad_rows} are bad rows, left out (on_bad_row: skip)")
    if stats.num_filtered:
        causes.append(
            f"{stats.num_filtered} are longer than max_length={max_length} and filtered (the longest has "
            f"{stats.max_num_tokens_raw} tokens): raise the dataset's max_length or set its "
            "length_policy: truncate"
        )
    return f"no training sample is left from {source}: of its {stats.num_records} record(s), " + "; ".join(
        causes
    )


def _record_messages(
    record: Mapping[str, Any], prompt_key: str, completion_key: str, messages_key: str
) -> list[dict[str, Any]]:
    if not isinstance(record, Mapping):
        raise ValueError(f"expected a dict record, got {type(record).__name__}")
    if record.get(messages_key) is not None:
        messages = record[messages_key]
        if not isinstance(messages, list) or not all(
            isinstance(m, Mapping) and "role" in m and "content" in m for m in messages
        ):
            raise ValueError(
                f"{messages_key!r} must be a list of {{'role', 'content'}} dicts, got {messages!r:.200}"
            )
        return [dict(m) for m in messages]
    if record.get(prompt_key) is not None and record.get(completion_key) is not None:
        return _as_messages(record[prompt_key], "user") + _as_messages(record[completion_key], "assistant")
    raise ValueError(
        f"record has neither {messages_key!r} nor both {prompt_key!r} and {completion_key!r}; "
        f"its keys are {sorted(record)}; set train_dataset.prompt_key/completion_key/messages_key to its columns"
    )


def _as_messages(value: Any, role: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, Mapping) and "role" in m for m in value):
        return [dict(m) for m in value]
    raise ValueError(f"expected a string or a list of messages for the {role} side, got {value!r:.200}")


def _tokenize_plain(prompt: Any, completion: Any, tokenizer: Any) -> tuple[list[int], list[int]]:
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise ValueError(
            f"{_tokenizer_name(tokenizer)} has no chat template, so prompt and completion must be strings"
        )
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{_tokenizer_name(tokenizer)} has neither a chat template nor an eos token")
    # The prompt gets the tokenizer's own special tokens (e.g. BOS), as at inference.
    prompt_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    completion_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
    completion_ids.append(tokenizer.eos_token_id)
    return prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids)


def _tokenize_chat(
    messages: list[dict[str, Any]], tokenizer: Any, template_kwargs: dict[str, Any]
) -> tuple[list[int], list[int]]:
    def render(prefix: list[dict[str, Any]], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            prefix, tokenize=False, add_generation_prompt=generation_prompt, **template_kwargs
        )

    full_text = render(messages, False)
    input_ids = _encode(tokenizer, full_text)
    loss_mask = [0] * len(input_ids)
    special_ids = _special_token_ids(tokenizer)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError(
                "the conversation starts with an assistant turn, so its prompt cannot be rendered; "
                "add a system or user message before it"
            )
        start = _prefix_length(tokenizer, render(messages[:i], True), full_text, input_ids, i)
        end = _prefix_length(tokenizer, render(messages[: i + 1], False), full_text, input_ids, i + 1)
        # Train up to the turn's end-of-turn token; template tokens after it are not generated.
        turn_specials = [j for j in range(start, end) if input_ids[j] in special_ids]
        if turn_specials:
            end = turn_specials[-1] + 1
        loss_mask[start:end] = [1] * (end - start)
    return input_ids, loss_mask


def _prefix_length(
    tokenizer: Any, prefix_text: str, full_text: str, full_ids: list[int], num_messages: int
) -> int:
    """Number of tokens of `prefix_text`, checking that they are a prefix of the full tokenization."""
    prefix_ids = _encode(tokenizer, prefix_text) if full_text.startswith(prefix_text) else None
    if prefix_ids is None or full_ids[: len(prefix_ids)] != prefix_ids:
        level = "text" if prefix_ids is None else "tokens"
        raise ValueError(
            f"the chat template of {_tokenizer_name(tokenizer)} is not prefix-stable: the {level} of the first "
            f"{num_messages} messages is not a prefix of the {level} of the whole conversation, so the "
            "assistant turns cannot be located for the loss mask; use a template that renders earlier "
            "turns the same way whatever follows (set `tokenizer.chat_template`)"
        )
    return len(prefix_ids)


def _encode(tokenizer: Any, text: str) -> list[int]:
    # Rendered templates already carry their special tokens (BOS included).
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _special_token_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(token_id)
    return ids


def _tokenizer_name(tokenizer: Any) -> str:
    return f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r}"


def sample_lengths(samples: Sequence[Sample]) -> list[int]:
    """Token count of each sample, for micro-batch partitioning."""
    return [len(s.input_ids) for s in samples]
