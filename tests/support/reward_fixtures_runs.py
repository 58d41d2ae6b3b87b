"""Rewards for the `laden rl` start-up and failure tests (`test_rl_eval.py`), importable by spawned workers.

`letter_reward_until` is the tiny task's reward until the file named by `LADEN_TEST_CALLS` holds more
than `LADEN_TEST_LIMIT` bytes (one is appended per call), then it raises: a reward service that goes
down in the middle of a run. A limit of -1 never raises (the same reward, fixed).
"""

from __future__ import annotations

import os

from laden.rl.rewards import letter_reward


def letter_reward_until(prompt, completion, prompt_ids, completion_ids, **fields):
    """`letter_reward` while the call count is within `LADEN_TEST_LIMIT`, else RuntimeError."""
    path, limit = os.environ["LADEN_TEST_CALLS"], int(os.environ["LADEN_TEST_LIMIT"])
    with open(path, "ab") as f:
        f.write(b".")
    if limit >= 0 and os.path.getsize(path) > limit:
        raise RuntimeError("the reward service is down")
    return letter_reward(prompt, completion, prompt_ids, completion_ids, **fields)


def needs_answer(prompt, completion, prompt_ids, completion_ids, answer, **fields):
    """1.0 for an exact answer: its rows need an `answer` field."""
    return float(completion.strip() == str(answer))
