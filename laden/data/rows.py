"""Checking every data row once, at start-up, so that a bad row is named by file and line before step 1.

A row that cannot be used (not an object, no prompt, a field of the wrong type, messages that are not
`{'role', 'content'}` dicts, an empty completion) would otherwise surface only when a step draws it:
hours into a run, at the same step on every rerun, with no row named. `check_sft_rows` (SFT) and
`check_prompt_rows` (RL prompts) read the shape of every row, without a tokenizer (what a chat
template makes of a row is tokenization's to report), and by `on_bad_row` either stop at start-up
with the first bad row's `path:line`, the problem, how many rows are bad and the fix (`stop`), or
leave the bad rows out with a warning and return how many (`skip`). The cost is one pass over the
rows' Python objects at start-up, small next to tokenizing them.

The kept rows stay a `Records` that still names each row by where it was read, so errors found
later (tokenization, a reward's missing field) point at the same `path:line`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from laden.data.sources import Records

__all__ = ["OnBadRow", "check_prompt_rows", "check_sft_rows", "prompt_row_problem", "sft_row_problem"]

log = logging.getLogger(__name__)

OnBadRow = Literal["stop", "skip"]
PROMPT_FIELDS = ("messages", "prompt")
"""Where an RL row's prompt is read when no `prompt_key` is given, first present first (as
`laden.rl.workflow.PROMPT_KEYS`, which `laden.data` cannot import)."""
_SHOWN = 5  # bad rows named in an error besides the first


def check_sft_rows(
    records: Sequence[Any],
    *,
    prompt_key: str = "prompt",
    completion_key: str = "completion",
    messages_key: str = "messages",
    on_bad_row: OnBadRow = "stop",
    field: str = "train_dataset",
) -> tuple[Records, int]:
    """The usable SFT rows of `records` and how many were left out (`sft_row_problem` decides).

    `on_bad_row="stop"`: a `ValueError` naming the first bad row (`path:line`), the problem, how many
    rows are bad and the fix; `"skip"`: the bad rows are left out with a warning. `field` names the
    dataset in the fix (`train_dataset`, `valid_dataset`).
    """

    def problem(row: Any) -> str | None:
        return sft_row_problem(
            row, prompt_key=prompt_key, completion_key=completion_key, messages_key=messages_key
        )

    return keep_good_rows(records, problem, on_bad_row=on_bad_row, field=field)


def check_prompt_rows(
    records: Sequence[Any],
    *,
    prompt_key: str | None = None,
    on_bad_row: OnBadRow = "stop",
    field: str = "train_dataset",
) -> tuple[Records, int]:
    """The usable RL prompt rows of `records` and how many were left out (`prompt_row_problem` decides);
    `on_bad_row` and `field` as in `check_sft_rows`."""
    return keep_good_rows(
        records,
        lambda row: prompt_row_problem(row, prompt_key=prompt_key),
        on_bad_row=on_bad_row,
        field=field,
    )


def sft_row_problem(
    row: Any,
    *,
    prompt_key: str = "prompt",
    completion_key: str = "completion",
    messages_key: str = "messages",
) -> str | None:
    """Why an SFT row cannot be used, or None: it needs a `messages_key` list of `{'role', 'content'}`
    dicts, or a `prompt_key` and a non-empty `completion_key`, each a string or such a list."""
    if not isinstance(row, Mapping):
        return f"the row is a {type(row).__name__}, not an object"
    if row.get(messages_key) is not None:
        return messages_problem(row[messages_key], messages_key)
    missing = [key for key in (prompt_key, completion_key) if row.get(key) is None]
    if missing:
        return (
            f"the row has neither {messages_key!r} nor both {prompt_key!r} and {completion_key!r} (no "
            f"{' or '.join(map(repr, missing))}); its keys are {sorted(row)}"
        )
    for key in (prompt_key, completion_key):
        problem = _text_or_messages_problem(row[key], key)
        if problem is not None:
            return problem
    if len(row[completion_key]) == 0:
        return f"{completion_key!r} is empty: there is nothing to train on"
    return None


def prompt_row_problem(row: Any, *, prompt_key: str | None = None) -> str | None:
    """Why an RL row has no usable prompt, or None: the `prompt_key` field (default: `messages`, else
    `prompt`) must be a non-empty string or a list of `{'role', 'content'}` dicts."""
    if not isinstance(row, Mapping):
        return f"the row is a {type(row).__name__}, not an object"
    keys = (prompt_key,) if prompt_key else PROMPT_FIELDS
    key = next((k for k in keys if row.get(k) is not None), None)
    if key is None:
        return f"the row has no {' or '.join(map(repr, keys))} field; its keys are {sorted(row)}"
    value = row[key]
    if isinstance(value, str) and not value.strip():
        return f"{key!r} is an empty string: there is nothing to prompt with"
    return _text_or_messages_problem(value, key)


def messages_problem(messages: Any, key: str) -> str | None:
    """Why `messages` (the row's `key` field) is not a non-empty list of `{'role', 'content'}` dicts, or None.

    `content` is a string or a list of parts (multimodal); None only beside `tool_calls`."""
    if not isinstance(messages, list):
        return f"{key!r} is a {type(messages).__name__}, expected a list of {{'role', 'content'}} dicts"
    if not messages:
        return f"{key!r} is an empty list"
    for i, message in enumerate(messages):
        where = f"{key}[{i}]"
        if not isinstance(message, Mapping):
            return f"{where} is a {type(message).__name__}, expected a {{'role', 'content'}} dict"
        absent = [k for k in ("role", "content") if k not in message]
        if absent:
            return f"{where} has no {' or '.join(map(repr, absent))} (its keys are {sorted(message)})"
        if not isinstance(message["role"], str):
            return f"{where}['role'] is a {type(message['role']).__name__}, expected a string"
        content = message["content"]
        if not (isinstance(content, str | list) or (content is None and message.get("tool_calls"))):
            return f"{where}['content'] is a {type(content).__name__}, expected a string or a list of parts"
    return None


def _text_or_messages_problem(value: Any, key: str) -> str | None:
    if isinstance(value, str):
        return None
    if isinstance(value, list):
        return messages_problem(value, key)
    return f"{key!r} is a {type(value).__name__}, expected a string or a list of {{'role', 'content'}} dicts"


def keep_good_rows(
    records: Sequence[Any], problem_of: Callable[[Any], str | None], *, on_bad_row: OnBadRow, field: str
) -> tuple[Records, int]:
    """The rows for which `problem_of` finds nothing, and how many it did find a problem with (see
    `check_sft_rows` for `on_bad_row` and `field`)."""
    if on_bad_row not in ("stop", "skip"):
        raise ValueError(f"{field}.on_bad_row={on_bad_row!r} must be 'stop' or 'skip'")
    rows = _as_records(records)
    bad = [(i, problem) for i, row in enumerate(rows) if (problem := problem_of(row)) is not None]
    if not bad:
        return rows, rows.skipped
    if on_bad_row == "stop" or len(bad) == len(rows):
        raise ValueError(_bad_rows_message(rows, bad, field, stopping=on_bad_row == "stop"))
    first, problem = bad[0]
    log.warning(
        "%s: left out %d of %d rows of %s that cannot be used (%s.on_bad_row: skip); the first, %s: %s",
        field, len(bad), len(rows), rows.source, field, rows.where(first), problem,
    )  # fmt: skip
    left_out = {i for i, _ in bad}
    kept = rows.subset([i for i in range(len(rows)) if i not in left_out], skipped=len(bad))
    return kept, kept.skipped


def _bad_rows_message(rows: Records, bad: list[tuple[int, str]], field: str, *, stopping: bool) -> str:
    first, problem = bad[0]
    others = ", ".join(rows.where(i) for i, _ in bad[1 : 1 + _SHOWN])
    more = f" (also {others}{', ...' if len(bad) > 1 + _SHOWN else ''})" if others else ""
    if stopping:
        return (
            f"{rows.where(first)}: {problem}; {len(bad)} of {len(rows)} rows of {rows.source} cannot be used"
            f"{more}. Fix the row(s), or set {field}.on_bad_row: skip to "
            "train without them (counted in the data stats)"
        )
    return (
        f"{rows.where(first)}: {problem}; all {len(rows)} rows of {rows.source} cannot be used{more}, so none "
        f"is left: fix the data, or set {field}'s prompt_key/completion_key/messages_key to its columns"
    )


def _as_records(records: Sequence[Any]) -> Records:
    if isinstance(records, Records):
        return records
    return Records(list(records), source=getattr(records, "source", None) or "the dataset")
