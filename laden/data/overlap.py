"""Which held-out prompts are also training prompts: a claim about learning needs data the model never saw.

Two rows are the same prompt when their prompt texts are equal after normalisation: Unicode NFKC,
case folded, and every character that is neither a letter, a digit, an arithmetic sign nor a
decimal point removed ("What is 3 + 4?" and "what is 3+4" are one prompt; "Calculate 3 + 4" is another). A chat
prompt's text is its turns' contents joined. What it costs: two paraphrases of one problem in other
words are not caught; a task's own generator can do better (`examples/prepare_arith.py` compares
the arithmetic expressions).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_DROPPED = re.compile(r"[^\w+\-*/^=<>%.]+|_|(?<!\d)\.|\.(?!\d)")  # a dot only inside a number stays
PROMPT_FIELDS = ("messages", "prompt")
"""The fields a row's prompt is read from (the first present), as `laden.rl.workflow` renders it."""


def prompt_text(row: Mapping[str, Any], prompt_key: str | None = None) -> str | None:
    """The row's prompt as one string (a chat prompt's contents joined), or None when it has none."""
    key = prompt_key or next((k for k in PROMPT_FIELDS if row.get(k) is not None), None)
    value = row.get(key) if key is not None else None
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence):
        return "\n".join(str(turn.get("content", "")) for turn in value if isinstance(turn, Mapping))
    return None


def normalized(text: str) -> str:
    """`text` as the overlap check compares it (see the module docstring)."""
    return _DROPPED.sub("", unicodedata.normalize("NFKC", text).casefold())


@dataclass(kw_only=True, slots=True)
class Overlap:
    """How many held-out rows share their prompt with a training row."""

    num_held_out: int
    """Held-out rows compared (rows without a prompt are not counted)."""
    num_shared: int
    """Held-out rows whose normalised prompt is a training prompt's."""
    num_exact: int
    """Of those, rows whose prompt text is identical to a training prompt's."""
    examples: list[str] = field(default_factory=list)
    """Up to 3 shared prompts, as they appear in the held-out data."""

    def summary(self) -> str:
        """One line: the counts and the examples."""
        shown = "; ".join(repr(e[:80]) for e in self.examples)
        return (
            f"{self.num_shared} of {self.num_held_out} held-out prompts are also training prompts "
            f"({self.num_exact} identical, the rest after normalisation){': ' + shown if shown else ''}"
        )


def prompt_overlap(
    train: Iterable[Mapping[str, Any]],
    held_out: Iterable[Mapping[str, Any]],
    prompt_key: str | None = None,
    held_out_key: str | None = None,
) -> Overlap:
    """Compare the prompts of `held_out` with those of `train` (see the module docstring). `prompt_key`: the
    training rows' prompt field, `held_out_key` the held-out rows' (each dataset names its own; default:
    `prompt_key`); None: the first of `PROMPT_FIELDS` a row has."""
    held_out_key = held_out_key if held_out_key is not None else prompt_key
    exact: set[str] = set()
    loose: set[str] = set()
    for row in train:
        text = prompt_text(row, prompt_key)
        if text is not None:
            exact.add(text)
            loose.add(normalized(text))
    counted = shared = identical = 0
    examples: list[str] = []
    for row in held_out:
        text = prompt_text(row, held_out_key)
        if text is None:
            continue
        counted += 1
        if normalized(text) in loose:
            shared += 1
            identical += text in exact
            if len(examples) < 3:
                examples.append(text)
    return Overlap(num_held_out=counted, num_shared=shared, num_exact=identical, examples=examples)
