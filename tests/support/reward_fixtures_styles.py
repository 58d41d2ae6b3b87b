"""One reward function per calling convention (`laden.rl.reward_styles`), for `test_rl_rewards.py`.

Every function scores by the same rule, `rule(completion, answer)`, from the arguments its style
gets, and raises when an argument has the wrong shape (a list that is not of one element, a raw
prompt of the other kind, the reserved raw-prompt keyword), so a test that compares them with the
rule also checks what each style passes. The TRL functions return None (TRL's "not applicable")
for prompts of the kind they are not written for.
"""

from __future__ import annotations

RAW_PROMPT_KEY = "_raw_prompt"  # laden.rl.reward_styles.RAW_PROMPT_KEY, never to be passed on


def rule(completion: str, answer: str) -> float:
    """Exact match plus a tenth of the completion's length."""
    return float(completion == answer) + 0.1 * len(completion)


def _no_raw_prompt(kwargs: dict) -> None:
    if RAW_PROMPT_KEY in kwargs:
        raise AssertionError(f"the reserved keyword {RAW_PROMPT_KEY} reached the reward function")


def laden_style(prompt, completion, prompt_ids, completion_ids, answer, **data_fields):
    _no_raw_prompt(data_fields)
    assert isinstance(prompt, str) and isinstance(completion_ids, list)
    return rule(completion, answer)


def areal_style(prompt, completions, prompt_ids, completion_ids, **data):
    _no_raw_prompt(data)
    assert isinstance(completions, str) and isinstance(prompt_ids, list)
    return rule(completions, data["answer"])


def trl_text_style(prompts, completions, completion_ids, answer, **kwargs):
    """TRL's standard (text) format: `prompts=[str]`, `completions=[str]`."""
    _no_raw_prompt(kwargs)
    ((prompt,), (completion,), (_ids,), (reference,)) = prompts, completions, completion_ids, answer
    if not isinstance(prompt, str):
        return [None]
    assert isinstance(completion, str)
    return [rule(completion, reference)]


def trl_chat_style(prompts, completions, **kwargs):
    """TRL's conversational format: `prompts=[turns]`, `completions=[[assistant turn]]`."""
    _no_raw_prompt(kwargs)
    ((prompt,), (completion,), (reference,)) = prompts, completions, kwargs["answer"]
    if isinstance(prompt, str):
        return [None]
    assert prompt[-1]["role"] == "user" and len(completion) == 1 and completion[0]["role"] == "assistant"
    return (rule(completion[0]["content"], reference),)


def verl_style(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "arith" and extra_info == {"split": "train"}
    return rule(solution_str, ground_truth)


def verl_dict_style(data_source, solution_str, ground_truth):
    return {"score": rule(solution_str, ground_truth), "acc": solution_str == ground_truth}


def trl_optional(prompts, completions, completion_ids, answer, **kwargs):
    """Exact match, or None (not applicable) for a row whose `answer` is None."""
    ((completion,), (reference,)) = completions, answer
    return [None if reference is None else float(completion == reference)]


def trl_length(prompts, completions, completion_ids, **kwargs):
    """The number of completion tokens, or None for an empty completion."""
    ((ids,),) = (completion_ids,)
    return [float(len(ids)) if ids else None]


def kwargs_only(**kwargs):
    return 1.0


def fits_no_style(x, y):
    return 1.0


def takes_one_completion(completion):
    return 1.0
