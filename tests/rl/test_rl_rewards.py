"""Rewards: loading by import path, the math-verify and reasoning-gym built-ins, `RewardPool`,
the four calling conventions (`laden.rl.reward_styles`), weighted functions and start-up checks.

The pool tests spawn real worker processes (up to a second or so each to start), so pools are
shared through module-scoped fixtures; the rewards live in `reward_fixtures*.py` modules so that
workers can import them (`reward_fixtures_styles.py`: one function per style).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import re
import time

import pytest

from laden.rl.reward_pool import RewardError, RewardPool, RewardTimeoutError
from laden.rl.reward_styles import (
    RAW_PROMPT_KEY,
    STYLE_SIGNATURES,
    RewardCallError,
    RewardSetupError,
    RewardSpec,
    detect_style,
    load_reward_fn,
    load_rewards,
    missing_fields,
)
from laden.rl.rewards import letter_reward, math_reward, reasoning_gym_reward

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
        ("", "reward_fn='' is empty, not an import path"),
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
    caplog.set_level(logging.WARNING, logger="laden.rl.reward_dispatch")
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
        RewardPool(
            SCRIPTED,
            num_workers=0,
            timeout_s=0,
            on_error="ignore",  # type: ignore[arg-type]
            error_value=float("nan"),
            import_timeout_s=0,
        )
    for field in (
        "num_workers=0",
        "timeout_s=0",
        "on_error='ignore'",
        "error_value=nan",
        "import_timeout_s=0",
    ):
        assert field in str(info.value)
    with pytest.raises(ValueError) as info:
        RewardSpec(fn="scripted_reward", weight=float("inf"), style="openai")  # type: ignore[arg-type]
    for field in ("not an import path", "weight=inf", "style='openai'"):
        assert field in str(info.value)
    with pytest.raises(ValueError, match="non-empty list of RewardSpec"):
        RewardPool([])


def _outcomes(pool, calls):
    """`pool.score_outcome` of every call, concurrently."""

    async def score_all():
        return await asyncio.gather(*(pool.score_outcome(**call) for call in calls))

    return asyncio.run(score_all())


def _same(parts, expected):
    """Equal dicts of floats, NaN equal to NaN."""
    return parts.keys() == expected.keys() and all(
        (math.isnan(v) and math.isnan(expected[k])) or v == pytest.approx(expected[k])
        for k, v in parts.items()
    )


@pytest.fixture(scope="module")
def scripted_pool():
    with RewardPool(SCRIPTED, num_workers=1, timeout_s=30, on_error="raise", error_value=-1.0) as pool:
        yield pool


def test_strings_and_bools_are_failures_and_numpy_scalars_convert(scripted_pool):
    errors_before = scripted_pool.stats.errors
    text, flag, np32 = _outcomes(scripted_pool, [_call("str"), _call("bool"), _call("np32")])
    assert (text.value, flag.value, np32.value) == (-1.0, -1.0, 0.5)
    assert "returned '1.0': a string is not a reward" in text.error
    assert "returned True: a bool is not a reward" in flag.error
    assert np32.error is None and np32.parts == {"scripted_reward": 0.5}
    assert scripted_pool.stats.errors == errors_before + 2
    with pytest.raises(RewardError, match="returned '1.0'"):
        scripted_pool.score_many([_call("str")])  # `score` raises (on_error="raise"); `score_outcome` never


def test_score_outcome_carries_the_error_text_of_a_raising_reward(scripted_pool):
    (outcome,) = _outcomes(scripted_pool, [_call("crash")])
    # what it raised, then where, one line a frame (the reward's own frames, no traceback header)
    assert "raised ValueError: scripted crash\n  at " in outcome.error and "Traceback" not in outcome.error
    assert re.search(r"  at .*\.py:\d+ in scripted_reward", outcome.error), outcome.error
    assert outcome.value == -1.0 and math.isnan(outcome.parts["scripted_reward"])


# --- recycling workers ---------------------------------------------------------------------


def test_a_leaking_worker_is_recycled_past_max_rss_and_every_call_scores(caplog):
    from reward_fixtures import LEAK_BYTES

    caplog.set_level(logging.INFO, logger="laden.rl.reward_dispatch")
    max_rss_gb = 0.2
    with RewardPool(SCRIPTED, num_workers=1, timeout_s=30, on_error="raise", max_rss_gb=max_rss_gb) as pool:
        held = pool.score_many([_call("leak")] * 8)  # one worker: one call at a time, in order
        stats = pool.stats
    # Each value is the number of leaks the answering worker holds: a fresh worker starts at 1 again.
    assert held[0] == 1.0 and all(b in (a + 1, 1.0) for a, b in zip(held, held[1:])), held
    assert held.count(1.0) >= 2, held  # recycled at least once...
    assert max(held) * LEAK_BYTES <= max_rss_gb * 2**30 + LEAK_BYTES  # ...never one leak past the bound
    assert stats.errors == 0 and stats.worker_restarts == 0
    assert stats.worker_recycles >= held.count(1.0) - 1
    logged = [r for r in caplog.records if "past max_rss_gb=0.2" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.WARNING  # once, however many recycles


def test_a_worker_is_recycled_after_max_calls_per_worker(caplog):
    caplog.set_level(logging.INFO, logger="laden.rl.reward_dispatch")
    with RewardPool(SCRIPTED, num_workers=1, timeout_s=30, max_calls_per_worker=3, max_rss_gb=None) as pool:
        pids = pool.score_many([_call("pid")] * 7)
        assert pool.stats.worker_recycles == 2 and pool.stats.errors == 0
    assert [pids.count(pid) for pid in dict.fromkeys(pids)] == [3, 3, 1]
    infos = [r for r in caplog.records if "max_calls_per_worker=3" in r.getMessage()]
    assert len(infos) == 1 and infos[0].levelno == logging.INFO


def test_a_memory_error_retires_its_worker_and_the_next_call_scores():
    with RewardPool(SCRIPTED, num_workers=1, timeout_s=30, error_value=-1.0) as pool:
        (before,) = pool.score_many([_call("pid")])
        (failed,) = _outcomes(pool, [_call("oom")])
        (after,) = pool.score_many([_call("pid")])
        stats = pool.stats
    assert failed.value == -1.0 and "MemoryError" in failed.error
    assert after not in (before, -1.0)  # scored, by a fresh worker
    assert (stats.errors, stats.worker_recycles, stats.worker_restarts) == (1, 1, 0)


def test_recycling_settings_are_checked():
    with pytest.raises(ValueError) as info:
        RewardPool(SCRIPTED, max_calls_per_worker=0, max_rss_gb=-1.0)
    assert "max_calls_per_worker=0" in str(info.value) and "max_rss_gb=-1.0" in str(info.value)


# --- reward styles -------------------------------------------------------------------------

STYLE_FUNCTIONS = {
    "laden_style": "laden",
    "areal_style": "areal",
    "trl_text_style": "trl",
    "trl_chat_style": "trl",
    "verl_style": "verl",
    "verl_dict_style": "verl",
}
"""The functions of `reward_fixtures_styles` and the style `auto` must detect for each."""


@pytest.fixture(scope="module")
def styles_pool():
    specs = [RewardSpec(fn=f"reward_fixtures_styles:{name}") for name in STYLE_FUNCTIONS]
    with RewardPool(specs, num_workers=2, timeout_s=30) as pool:
        yield pool


def _style_call(completion, answer, prompt_kind):
    """A row with every style's fields; the raw prompt absent, a string, or chat turns."""
    call = _call(completion, answer, data_source="arith", reward_model={"ground_truth": answer})
    call["extra_info"] = {"split": "train"}
    if prompt_kind != "absent":
        call[RAW_PROMPT_KEY] = [{"role": "user", "content": "p"}] if prompt_kind == "chat" else "p"
    return call


def test_every_style_scores_the_same_rows_as_the_reference(styles_pool):
    info = styles_pool.wait_ready()
    assert info.names == list(STYLE_FUNCTIONS) and info.styles == list(STYLE_FUNCTIONS.values())
    rows = [
        (c, a, kind) for c, a in [("7", "7"), ("12", "21"), ("", "3")] for kind in ("absent", "text", "chat")
    ]
    outcomes = _outcomes(styles_pool, [_style_call(*row) for row in rows])
    for (completion, answer, kind), outcome in zip(rows, outcomes):
        reference = float(completion == answer) + 0.1 * len(completion)
        expected = dict.fromkeys(STYLE_FUNCTIONS, reference)
        expected["trl_text_style" if kind == "chat" else "trl_chat_style"] = math.nan  # TRL's None
        assert outcome.error is None, outcome.error
        assert _same(outcome.parts, expected), (completion, answer, kind, outcome.parts)
        assert outcome.value == pytest.approx(5 * reference)  # the NaN part is left out of the sum


def test_required_fields_come_from_the_signatures(styles_pool):
    info = styles_pool.wait_ready()  # computed in the worker: this process never imports the functions
    verl = [("data_source",), ("ground_truth", "reward_model.ground_truth", "answer")]
    assert info.required_fields == {
        "laden_style": [("answer",)],
        "areal_style": [],
        "trl_text_style": [("answer",)],
        "trl_chat_style": [],
        "verl_style": verl,
        "verl_dict_style": verl,
    }
    assert missing_fields(info, {"prompt": "p", "answer": "1", "data_source": "d"}) == []
    assert missing_fields(info, {"answer": "1", "reward_model": {"ground_truth": "1"}}) == ["data_source"]
    assert missing_fields(info, {"data_source": "d", "answer": None, "reward_model": {"style": "rule"}}) == [
        "answer",
        "ground_truth|reward_model.ground_truth|answer",
    ]


@pytest.mark.parametrize(
    ("fn", "required"),
    [
        (math_reward, [("answer",)]),
        (letter_reward, [("letter",)]),
        (reasoning_gym_reward, []),
        ("reward_fixtures_styles:kwargs_only", []),
    ],
)
def test_required_fields_of_the_builtins_and_a_kwargs_only_function(fn, required):
    spec = fn if isinstance(fn, str) else f"laden.rl.rewards:{fn.__name__}"
    info = load_rewards([RewardSpec(fn=spec)]).info()
    assert info.styles == ["laden"] and list(info.required_fields.values()) == [required]


@pytest.mark.parametrize(
    ("name", "style"), [*STYLE_FUNCTIONS.items(), ("kwargs_only", "laden"), ("takes_one_completion", "laden")]
)
def test_auto_detection_reads_the_parameter_names(name, style):
    assert detect_style(load_reward_fn(f"reward_fixtures_styles:{name}")) == style


@pytest.mark.parametrize(
    ("name", "style", "message"),
    [
        (
            "laden_style",
            "trl",
            r"cannot take a trl-style call \(as set\): missing a required argument: 'prompt'",
        ),
        ("trl_text_style", "laden", "cannot take a laden-style call .*'prompts'"),
        ("areal_style", "verl", "cannot take a verl-style call"),
        ("verl_style", "trl", "cannot take a trl-style call"),
        (
            "takes_one_completion",
            "auto",
            r"cannot take a laden-style call \(detected from its parameter names\)",
        ),
    ],
)
def test_a_style_the_signature_cannot_take_is_an_error_naming_the_style(name, style, message):
    with pytest.raises(RewardSetupError, match=message) as info:
        load_rewards([RewardSpec(fn=f"reward_fixtures_styles:{name}", style=style)])
    expected = "laden" if style == "auto" else style
    assert f"a {expected} reward is {STYLE_SIGNATURES[expected]}" in str(info.value)


def test_a_signature_that_fits_no_style_names_the_four_forms():
    with pytest.raises(
        RewardSetupError, match=r"fits_no_style\(x, y\) fits none of the four reward forms"
    ) as info:
        load_rewards([RewardSpec(fn="reward_fixtures_styles:fits_no_style")])
    for style, signature in STYLE_SIGNATURES.items():
        assert f"{style}: {signature}" in str(info.value)


def test_a_forced_style_the_signature_can_take_is_used():
    # AReaL calls positionally, so a laden-style function works as an AReaL one.
    reward = load_rewards([RewardSpec(fn="reward_fixtures_styles:laden_style", style="areal")])
    assert reward.info().styles == ["areal"]
    assert reward.score(_call("ab", "ab")) == (pytest.approx(1.2), {"laden_style": pytest.approx(1.2)})


def test_verl_ground_truth_is_the_field_then_reward_model_then_answer():
    reward = load_rewards([RewardSpec(fn="reward_fixtures_styles:verl_dict_style")])

    def score(**fields):
        return reward.score(_call("x", data_source="arith", **fields))[0]

    assert score(ground_truth="x", reward_model={"ground_truth": "y"}, answer="y") == pytest.approx(1.1)
    assert score(ground_truth="y", reward_model={"ground_truth": "x"}, answer="x") == pytest.approx(0.1)
    assert score(reward_model={"ground_truth": "x"}, answer="y") == pytest.approx(1.1)
    assert score(answer="x") == pytest.approx(1.1)
    with pytest.raises(RewardCallError, match="needs the data field data_source"):
        reward.score(_call("x", answer="x"))


# --- several reward functions ----------------------------------------------------------------


@pytest.fixture(scope="module")
def weighted_pool():
    specs = [
        RewardSpec(fn="reward_fixtures_styles:trl_optional", weight=2.0),
        RewardSpec(fn="reward_fixtures_styles:trl_length", weight=-0.5),
        RewardSpec(fn="reward_fixtures_styles:trl_length", weight=0.25, style="trl"),
    ]
    with RewardPool(specs, num_workers=1, timeout_s=30, error_value=-3.0) as pool:
        yield pool


def test_weighted_functions_sum_and_a_none_is_left_out(weighted_pool):
    assert weighted_pool.wait_ready().names == ["trl_optional", "trl_length", "trl_length_2"]
    cases = [("7", "7", [5, 6]), ("7", "8", [5]), ("7", None, [5, 6, 7])]
    outcomes = _outcomes(weighted_pool, [_call(c, a, completion_ids=ids) for c, a, ids in cases])
    for (completion, answer, ids), outcome in zip(cases, outcomes):
        exact = math.nan if answer is None else float(completion == answer)
        parts = {"trl_optional": exact, "trl_length": float(len(ids)), "trl_length_2": float(len(ids))}
        weighted = [w * p for w, p in zip((2.0, -0.5, 0.25), parts.values()) if not math.isnan(p)]
        assert outcome.error is None and _same(outcome.parts, parts)
        assert outcome.value == pytest.approx(sum(weighted))


def test_every_function_returning_none_is_a_failure(weighted_pool):
    errors_before = weighted_pool.stats.errors
    (outcome,) = _outcomes(weighted_pool, [_call("7", None, completion_ids=[])])
    assert "every reward function returned None" in outcome.error and outcome.value == -3.0
    assert all(math.isnan(v) for v in outcome.parts.values())
    assert weighted_pool.stats.errors == errors_before + 1


# --- start-up ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "reward_fixtures_missing:score",
            r"imports the missing module 'not_installed_dep_xyz'; install it \(pip install not_installed_dep_xyz",
        ),
        ("no_such_module_xyz:score", "no module named 'no_such_module_xyz'"),
        ("reward_fixtures_styles:fits_no_style", "fits none of the four reward forms"),
    ],
)
def test_wait_ready_reports_a_reward_that_cannot_load(spec, message):
    pool = RewardPool(spec, num_workers=1)
    with pytest.raises(RewardSetupError, match=message) as info:
        pool.wait_ready()
    assert isinstance(info.value, ValueError)  # the CLI prints it as one line
    with pytest.raises(RuntimeError, match=message):  # the pool is broken, not scoring zeros
        _outcomes(pool, [_call("a")])


@pytest.mark.parametrize(("import_timeout_s", "wait_s"), [(2.0, None), (120.0, 2.0)])
def test_an_import_that_hangs_is_reported_and_its_workers_killed(import_timeout_s, wait_s):
    pool = RewardPool("reward_fixtures_hang:score", num_workers=2, import_timeout_s=import_timeout_s)
    start = time.monotonic()
    with pytest.raises(
        RewardSetupError,
        match=r"importing 'reward_fixtures_hang' has not finished after 2 s: does the module block at import "
        r"\(a server, input\(\), a lock\)\?",
    ):
        pool.wait_ready(wait_s)
    assert time.monotonic() - start < 2.0 + 20  # the hang bound: start-up plus the import timeout
    assert not any(w.process.is_alive() for w in pool._dispatcher._workers)
