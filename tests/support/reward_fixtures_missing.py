"""A reward module that imports a package that is not installed, for `test_rl_rewards.py`."""

import not_installed_dep_xyz  # noqa: F401


def score(prompt, completion, prompt_ids, completion_ids, **data_fields):
    return 1.0
