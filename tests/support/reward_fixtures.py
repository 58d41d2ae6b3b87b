"""Reward functions for `test_rl_rewards.py`, importable by spawned `RewardPool` workers.

`scripted_reward` does what the completion says: "crash" raises, "hang" sleeps far past any
test timeout, "hang_with_child" starts a `sleep` subprocess (its pid goes to the `pid_file`
field) and hangs, "exit" kills its own worker process, "nan", "none", "str" ("1.0") and "bool"
(True) return values that are not rewards, "np32" returns `numpy.float32(0.5)`; for the worker
recycling tests, "pid" returns the worker's pid, "leak" keeps another `LEAK_BYTES` in a module-level
list and returns how many it holds, "oom" raises `MemoryError`; anything else scores 1.0 when it
equals `answer`, else 0.0.
"""

from __future__ import annotations

import os
import subprocess
import time

NOT_A_FUNCTION = 42
LEAK_BYTES = 60 * 2**20
_LEAKED: list[bytes] = []


def scripted_reward(prompt, completion, prompt_ids, completion_ids, answer=None, **data_fields):
    """Misbehave on request; otherwise exact match against `answer`."""
    if completion == "crash":
        raise ValueError("scripted crash")
    if completion == "hang":
        time.sleep(600)
    if completion == "hang_with_child":
        child = subprocess.Popen(["sleep", "600"])
        with open(data_fields["pid_file"], "w") as f:
            f.write(str(child.pid))
        time.sleep(600)
    if completion == "exit":
        os._exit(3)
    if completion == "nan":
        return float("nan")
    if completion == "none":
        return None
    if completion == "str":
        return "1.0"
    if completion == "bool":
        return True
    if completion == "pid":
        return float(os.getpid())
    if completion == "leak":
        _LEAKED.append(b"\1" * LEAK_BYTES)  # written, so resident (zeroed pages may stay unmapped)
        return float(len(_LEAKED))
    if completion == "oom":
        raise MemoryError
    if completion == "np32":
        import numpy

        return numpy.float32(0.5)
    return float(completion == answer)


def length_reward(prompt, completion, prompt_ids, completion_ids, **data_fields):
    """The number of completion tokens plus the `bonus` field: checks argument passing."""
    return float(len(completion_ids) + data_fields.get("bonus", 0))
