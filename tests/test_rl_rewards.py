"""Rewards: loading by import path, the math-verify and reasoning-gym built-ins, `RewardPool`.

The pool tests spawn real worker processes (about a second each to start); the misbehaving
rewards live in `reward_fixtures.py` so that workers can import them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

import pytest

from laden.rl.rewards import (
    RewardError,
    RewardPool,
    RewardTimeoutError,
    load_reward_fn,
    math_reward,
    reasoning_gym_reward,
)

SCRIPTED = "reward_fixtures:scripted_reward"


def _call(completion: str, answer: str = "a", **fields):
    """Keyword arguments of one reward call; `fields` add data fields or override the ids."""
    return {
        "prompt": "p",
        "completion": completion,
        "prompt_ids": [1, 2],
        "completion_ids": [3],
        "answer": answer,
        **fields,
    }


# --- load_reward_fn ------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["reward_fixtures:scripted_reward", "reward_fixtures.scripted_reward"])
def test_load_reward_fn_accepts_colon_and_dotted_paths(spec):
    import reward_fixtures

    assert load_reward_fn(spec) is reward_fixtures.scripted_reward


def test_load_reward_fn_finds_the_builtins():
    assert load_reward_fn("laden.rl.rewards:math_reward") is math_reward
    assert load_reward_fn("laden.rl.rewards.reasoning_gym_reward") is reasoning_gym_reward


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:score", "no module named 'no_such_module_xyz'"),
        ("reward_fixtures:scripted_rewrd", "has no attribute 'scripted_rewrd' .*scripted_reward"),
        ("reward_fixtures:NOT_A_FUNCTION", "names a int, not a callable"),
        ("scripted_reward", "not an import path"),
        ("reward_fixtures:", "not an import path"),
        ("", "non-empty string"),
    ],
)
def test_load_reward_fn_errors_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        load_reward_fn(spec)


def test_load_reward_fn_names_a_missing_dependency(tmp_path, monkeypatch):
    (tmp_path / "needs_dep_mod.py").write_text(
        "import not_installed_dep_xyz\n\ndef score(**kw):\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="imports the missing module 'not_installed_dep_xyz'; install it"):
        load_reward_fn("needs_dep_mod:score")


# --- math_reward ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("Adding up, the total is \\boxed{42}.", "42", 1.0),
        ("6 * 7 = 42, so the answer is 42", "42", 1.0),
        ("6 * 7 = 41, so the answer is 41", "42", 0.0),
        ("Half of it: $\\frac{1}{2}$", "0.5", 1.0),
        ("It is 0.5.", "\\frac{1}{2}", 1.0),
        ("It is \\boxed{\\frac{1}{3}}", "0.5", 0.0),
        ("I do not know.", "42", 0.0),
        ("The answer is 42", 42, 1.0),
    ],
)
def test_math_reward(completion, answer, reward):
    pytest.importorskip("math_verify", reason="math_reward needs math-verify: pip install math-verify")
    assert math_reward("q", completion, [1], [2], answer=answer) == reward


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("97 * 81", 0.0),  # restating the question: math-verify alone evaluates it to the answer
        ("\\boxed{97 \\times 81}", 0.0),
        ("97 * 81 = 7857", 1.0),
        ("The answer is 7,857.", 1.0),
        ("\\boxed{7857}", 1.0),
        ("7858", 0.0),
    ],
)
def test_math_reward_number_format_needs_a_numeral(completion, reward):
    pytest.importorskip("math_verify", reason="math_reward needs math-verify: pip install math-verify")
    assert math_reward("q", completion, [1], [2], answer="7857", answer_format="number") == reward


def test_math_reward_rejects_an_unknown_answer_format():
    pytest.importorskip("math_verify", reason="math_reward needs math-verify: pip install math-verify")
    with pytest.raises(ValueError, match="answer_format='numeric'"):
        math_reward("q", "7", [1], [2], answer="7", answer_format="numeric")


def test_math_reward_works_off_the_main_thread():
    pytest.importorskip("math_verify", reason="math_reward needs math-verify: pip install math-verify")
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        future = executor.submit(math_reward, "q", "so \\boxed{7}", [1], [2], answer="7")
        assert future.result() == 1.0


def test_math_reward_rejects_an_unparsable_reference():
    pytest.importorskip("math_verify", reason="math_reward needs math-verify: pip install math-verify")
    with pytest.raises(ValueError, match="cannot parse the reference answer"):
        math_reward("q", "\\boxed{1}", [1], [2], answer="")


# --- reasoning_gym_reward ------------------------------------------------------------------


@pytest.fixture(scope="module")
def arithmetic_entries():
    reasoning_gym = pytest.importorskip(
        "reasoning_gym", reason="reasoning_gym_reward needs reasoning-gym: pip install reasoning-gym"
    )
    return list(reasoning_gym.create_dataset("basic_arithmetic", seed=42, size=3))


def test_reasoning_gym_reward_uses_the_tasks_scorer(arithmetic_entries):
    for entry in arithmetic_entries:
        row = {"question": entry["question"], "answer": entry["answer"], "metadata": entry["metadata"]}
        right = f"<think>work</think><answer>{entry['answer']}</answer>"
        wrong = f"<answer>{int(entry['answer']) + 1}</answer>"
        assert reasoning_gym_reward(entry["question"], right, [1], [2], **row) == 1.0
        assert reasoning_gym_reward(entry["question"], wrong, [1], [2], **row) == 0.0
        assert reasoning_gym_reward(entry["question"], entry["answer"], [1], [2], **row) == 0.0  # no tag


def test_reasoning_gym_reward_takes_a_whole_or_json_encoded_entry(arithmetic_entries):
    import json

    entry = arithmetic_entries[0]
    right = f"<answer>{entry['answer']}</answer>"
    assert reasoning_gym_reward("q", right, [1], [2], entry=entry) == 1.0
    encoded = json.dumps(entry["metadata"])
    assert reasoning_gym_reward("q", right, [1], [2], answer=entry["answer"], metadata=encoded) == 1.0


def test_reasoning_gym_reward_needs_the_task_name(arithmetic_entries):
    with pytest.raises(ValueError, match="names no reasoning-gym task"):
        reasoning_gym_reward("q", "<answer>1</answer>", [1], [2], answer="1", metadata={})
    with pytest.raises(ValueError, match="has no task 'no_such_task'"):
        reasoning_gym_reward("q", "<answer>1</answer>", [1], [2], answer="1", source_dataset="no_such_task")


# --- RewardPool ----------------------------------------------------------------------------


def test_pool_scores_in_order_passes_every_field_and_serves_async():
    with RewardPool("reward_fixtures:length_reward", num_workers=2, timeout_s=30) as pool:
        calls = [_call("x", completion_ids=list(range(n)), bonus=10 * n) for n in range(6)]
        assert pool.score_many(calls) == [11.0 * n for n in range(6)]

        async def score_all():
            return await asyncio.gather(*(pool.score(**call) for call in calls))

        assert asyncio.run(score_all()) == [11.0 * n for n in range(6)]
        assert pool.score_many([]) == []
        with pytest.raises(ValueError, match="picklable"):
            pool.submit(**_call("x", bonus=lambda: 1))
        assert pool.stats.calls == 12 and pool.stats.errors == 0


def test_pool_counts_crashes_and_timeouts_scores_error_value_and_keeps_working(caplog):
    caplog.set_level(logging.WARNING, logger="laden.rl.rewards")
    completions = ["a", "crash", "hang", "exit", "nan", "none", "crash", "a", "b"]
    with RewardPool(SCRIPTED, num_workers=2, timeout_s=1.0, error_value=-1.0) as pool:
        scores = pool.score_many([_call(c) for c in completions])
        assert scores == [1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0, 0.0]
        stats = pool.stats
        assert (stats.calls, stats.errors, stats.timeouts, stats.worker_restarts) == (9, 5, 1, 2)
        # The killed and the dead worker were replaced: both slots score correctly again.
        assert pool.score_many([_call(c) for c in ["a", "b", "a", "a"]]) == [1.0, 0.0, 1.0, 1.0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3, warnings  # once per kind: error, timeout, worker death
    assert sum("scripted crash" in w for w in warnings) == 1
    assert sum("ran past timeout_s=1.0" in w for w in warnings) == 1
    assert sum("died (exit code 3)" in w for w in warnings) == 1


def test_pool_raises_when_asked_kills_the_rewards_subprocesses_and_keeps_working(tmp_path):
    pid_file = tmp_path / "child.pid"
    with RewardPool(SCRIPTED, num_workers=1, timeout_s=1.0, on_error="raise") as pool:
        with pytest.raises(RewardError, match="scripted crash"):
            pool.score_many([_call("crash")])
        with pytest.raises(RewardTimeoutError, match="ran past timeout_s"):
            asyncio.run(pool.score(**_call("hang_with_child", pid_file=str(pid_file))))
        assert _ends_within(int(pid_file.read_text()), timeout_s=10)
        assert pool.score_many([_call("a"), _call("b")]) == [1.0, 0.0]
        assert (pool.stats.errors, pool.stats.timeouts) == (1, 1)


def _ends_within(pid: int, timeout_s: float) -> bool:
    """Whether process `pid` is gone (or a zombie) before `timeout_s` runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.01)  # SIGKILL was sent; the kernel tears the process down asynchronously
    return False


def test_close_ends_workers_and_fails_unscored_calls():
    pool = RewardPool(SCRIPTED, num_workers=1, timeout_s=60)
    assert pool.score_many([_call("a")]) == [1.0]
    stuck = pool.submit(**_call("hang"))
    queued = pool.submit(**_call("a"))
    processes = [w.process for w in pool._dispatcher._workers]
    pool.close()
    pool.close()  # idempotent
    for future in (stuck, queued):
        with pytest.raises(RuntimeError, match="closed before this reward was scored"):
            future.result(timeout=10)
    assert not any(p.is_alive() for p in processes)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(**_call("a"))


def test_pool_settings_are_checked_all_at_once():
    with pytest.raises(ValueError) as info:
        RewardPool(SCRIPTED, num_workers=0, timeout_s=0, on_error="ignore", error_value=float("nan"))  # type: ignore[arg-type]
    for field in ("num_workers=0", "timeout_s=0", "on_error='ignore'", "error_value=nan"):
        assert field in str(info.value)
    with pytest.raises(ValueError, match="no module named"):
        RewardPool("no_such_module_xyz:score")
