"""The built-in reward functions, named in a run's config as `reward_fn: "laden.rl.rewards:<name>"`.

A run names its reward as `reward_fn: "package.module:function"`, or several with weights
(`RewardSpec`s; the completion's reward is the weighted sum). laden's own convention calls the
function with keyword arguments `prompt`, `completion` (text), `prompt_ids`, `completion_ids`
(token ids) and every other field of the data row (`answer`, `metadata`, ...), and takes a float
back; functions written for AReaL, TRL or verl are called in their own convention, detected from
their signature (`laden.rl.reward_styles`, which also holds `load_reward_fn`). The functions run
in the worker processes of `laden.rl.reward_pool.RewardPool`.

Built-ins:
- `math_reward`: 1.0 when the completion's final answer equals the row's `answer`, decided
  by `math-verify` (LaTeX and plain expressions, `\\frac{1}{2}` == `0.5`); 0.0 otherwise.
- `reasoning_gym_reward`: the reasoning-gym task's own `score_answer` on the text inside the
  completion's last `<answer>...</answer>` tag.
- `letter_reward`: the share of the completion that is one letter (the embedded tiny RL task).

This module imports only the standard library, since every reward worker imports it;
`math-verify` and `reasoning-gym` load in the workers, at start-up when a built-in needs them
(`import_builtin_needs`; `pip install 'laden[rl]'`).
"""

from __future__ import annotations

import functools
import importlib
import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from laden.rl.reward_styles import RewardSetupError

__all__ = ["import_builtin_needs", "letter_reward", "math_reward", "reasoning_gym_reward"]


def math_reward(
    prompt: str,
    completion: str,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    answer: Any,
    answer_format: str = "expression",
    **data_fields: Any,
) -> float:
    """1.0 when the completion's final answer equals `answer` (by `math-verify`), else 0.0.

    `answer` is the reference: a number or a LaTeX/plain expression, with or without `$...$`
    or `\\boxed{}`. `math-verify` extracts the completion's answer (`\\boxed{}` first, then
    "the answer is ...", then the last expression) and compares symbolically and numerically.
    A reference it cannot parse raises `ValueError` (a data problem, not a wrong answer).

    `answer_format` (a data field, default `expression`): `number` demands that the extracted
    answer be a numeral (sign, digits, thousands commas, decimals), not an expression equal to
    the reference. Arithmetic tasks need it: math-verify evaluates what it extracts, so a
    completion that restates the question ("97 * 81") would otherwise score as "7857".

    `math-verify` bounds its own parsing time with `SIGALRM`, which only the main thread may
    use; called from another thread, those limits are turned off (`RewardPool`'s timeout
    still applies, since workers call rewards on their main thread).
    """
    math_verify = _require("math_verify", "math-verify", "math_reward")
    on_main = threading.current_thread() is threading.main_thread()
    parse_kw: dict[str, Any] = {} if on_main else {"parsing_timeout": None}
    verify_kw: dict[str, Any] = {} if on_main else {"timeout_seconds": None}
    reference = str(answer).strip()
    if "$" not in reference and "\\boxed" not in reference:
        reference = f"${reference}$"  # bare LaTeX (`\frac{1}{2}`) parses only inside math mode
    gold = math_verify.parse(reference, **parse_kw)
    if answer is None or not gold:
        raise ValueError(
            f"math_reward: math-verify cannot parse the reference answer {answer!r}; "
            "give the dataset's answer field as a number or a LaTeX expression"
        )
    if answer_format not in ("expression", "number"):
        raise ValueError(
            f"math_reward: answer_format={answer_format!r} is not 'expression' or 'number'; fix the "
            "dataset's answer_format field"
        )
    predicted = math_verify.parse(completion, **parse_kw)
    if answer_format == "number" and not (predicted and _NUMERAL.fullmatch(str(predicted[-1]).strip())):
        return 0.0
    return 1.0 if math_verify.verify(gold, predicted, **verify_kw) else 0.0


_NUMERAL = re.compile(r"[+-]?\d{1,3}(,\d{3})*(\.\d+)?|[+-]?\d+(\.\d+)?")
"""What `answer_format: number` accepts as math-verify's extracted answer text."""


def reasoning_gym_reward(
    prompt: str,
    completion: str,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    *,
    entry: Mapping[str, Any] | str | None = None,
    question: str | None = None,
    answer: Any = None,
    metadata: Mapping[str, Any] | str | None = None,
    source_dataset: str | None = None,
    answer_tag: str = "answer",
    **data_fields: Any,
) -> float:
    """Score with the reasoning-gym task's own `score_answer` (a float in [0, 1]).

    The reasoning-gym entry is the row's `entry` field when it has one, else the row's
    `question`, `answer` and `metadata` fields (what `reasoning_gym.create_dataset(...)`
    yields); either may arrive JSON-encoded, as data files often store nested fields. The
    task comes from `source_dataset`, else from `metadata["source_dataset"]`. The scored
    answer is the text inside the completion's last `<answer_tag>...</answer_tag>`
    (`reasoning_gym.utils.extract_answer`); a completion without one scores 0.0.
    """
    rg_utils = _require("reasoning_gym.utils", "reasoning-gym", "reasoning_gym_reward")
    record = _reasoning_gym_entry(prompt, entry, question, answer, metadata)
    name = source_dataset or record["metadata"].get("source_dataset")
    if not name:
        raise ValueError(
            "reasoning_gym_reward: the row names no reasoning-gym task; pass a `source_dataset` "
            "field or keep the entry's metadata['source_dataset'] (reasoning-gym writes it)"
        )
    extracted = rg_utils.extract_answer(completion, tag_name=answer_tag)
    if extracted is None:
        return 0.0
    return float(_reasoning_gym_scorer(name)(extracted, record))


def _reasoning_gym_entry(
    prompt: str,
    entry: Mapping[str, Any] | str | None,
    question: str | None,
    answer: Any,
    metadata: Mapping[str, Any] | str | None,
) -> dict[str, Any]:
    if entry is not None:
        record = dict(_decoded("entry", entry))
    else:
        record = {"question": prompt if question is None else question, "answer": answer}
        record["metadata"] = metadata
    record["metadata"] = dict(_decoded("metadata", record.get("metadata") or {}))
    if record.get("answer") is None:
        raise ValueError(
            "reasoning_gym_reward: the row has no reference `answer` (nor an `entry` with one); "
            "keep the fields reasoning-gym generates: question, answer, metadata"
        )
    return record


def _decoded(field: str, value: Mapping[str, Any] | str) -> Mapping[str, Any]:
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, Mapping):
        raise ValueError(f"reasoning_gym_reward: field {field!r} must be a dict, got {type(value).__name__}")
    return value


@functools.cache
def _reasoning_gym_scorer(name: str) -> Callable[[str, dict[str, Any]], float]:
    reasoning_gym = _require("reasoning_gym", "reasoning-gym", "reasoning_gym_reward")
    try:
        return reasoning_gym.get_score_answer_fn(name)
    except ValueError as exc:
        raise ValueError(f"reasoning_gym_reward: reasoning-gym has no task {name!r} ({exc})") from exc


def _require(module_name: str, package: str, user: str) -> Any:
    """Import an optional dependency, saying which package to install when it is missing."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"{user} needs the {package} package: pip install 'laden[rl]' (or just {package})"
        ) from exc


def letter_reward(
    prompt: str, completion: str, prompt_ids: Any = None, completion_ids: Any = None, *, letter: str, **_: Any
) -> float:
    """The share of the completion's characters that are `letter` (the embedded tiny RL task: a
    random-init model learns to answer with one letter, which the reward separates from step 1)."""
    text = completion.strip()
    return sum(ch == letter for ch in text) / len(text) if text else 0.0


_BUILTIN_NEEDS: dict[Callable[..., Any], tuple[str, str]] = {
    math_reward: ("math_verify", "math-verify"),
    reasoning_gym_reward: ("reasoning_gym", "reasoning-gym"),
}
"""The optional package (module, distribution) each built-in imports."""


def import_builtin_needs(fn: Callable[..., Any]) -> None:
    """Import what a built-in needs now, so that a missing package stops the run at start-up
    (`RewardSetupError`); any other function needs nothing here."""
    needs = _BUILTIN_NEEDS.get(fn)
    if needs is None:
        return
    try:
        _require(*needs, fn.__name__)
    except ModuleNotFoundError as exc:
        raise RewardSetupError(f"reward_fn 'laden.rl.rewards:{fn.__name__}': {exc}") from None
