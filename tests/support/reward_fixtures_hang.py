"""A reward module that blocks forever at import (as one that starts a server would), for
`test_rl_rewards.py`: importing it must never hang the trainer, only the worker that does."""

import time

time.sleep(10**6)


def score(prompt, completion, prompt_ids, completion_ids, **data_fields):
    return 1.0
