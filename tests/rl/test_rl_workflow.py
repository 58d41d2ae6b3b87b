"""Rollout workflows on the native engine (CPU, a tiny random Qwen3, the char tokenizer).

Rewards here are plain functions written in the test (fraction of a letter, constants, "right
once the feedback was given"); the `RewardPool` cases use `reward_fixtures.length_reward`,
which spawned workers can import, and make it raise by passing a non-numeric `bonus` field.
"""

from __future__ import annotations

import asyncio
import copy
import threading

import pytest

from laden.rl.reward_pool import RewardPool
from laden.rl.workflow import (
    MultiTurnWorkflow,
    RLVRWorkflow,
    RolloutWorkflow,
    Trajectory,
    feedback_separator_ids,
    load_workflow,
    render_prompt,
    reward_fields,
)
from laden.rollout import SamplingParams
from laden.rollout.native import NativeEngine

pytestmark = pytest.mark.usefixtures("one_thread")

SAMPLING = SamplingParams(max_new_tokens=8, temperature=1.0)
FEEDBACK = "Wrong, again."


class RecordingEngine:
    """The native engine, remembering every request it was given (composition, not a subclass)."""

    def __init__(self, inner: NativeEngine) -> None:
        self.inner = inner
        self.requests: list = []

    def generate(self, requests):
        self.requests.extend(requests)
        return self.inner.generate(requests)


def run_episode(workflow, model, tokenizer, data):
    """`workflow.arun_episode` on a fresh native engine; returns (trajectories, requests issued)."""
    engine = RecordingEngine(NativeEngine(model, tokenizer, max_model_len=192, max_concurrent=8))

    async def episode():
        try:
            return await workflow.arun_episode(engine, data)
        finally:
            await engine.inner.close()

    return asyncio.run(episode()), engine.requests


def fraction_of_a(prompt, completion, prompt_ids, completion_ids, **fields):
    return completion.count("a") / max(len(completion), 1)


def chat_ids(tokenizer, text: str) -> tuple[int, ...]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tuple(tokenizer(rendered, add_special_tokens=False)["input_ids"])


# --- RLVR -------------------------------------------------------------------------------------


def test_rlvr_returns_n_scored_trajectories_from_one_request(tiny_model, tiny_tokenizer):
    calls = []

    def reward(**kwargs):
        calls.append(kwargs)
        return fraction_of_a(**kwargs)

    workflow = RLVRWorkflow(tokenizer=tiny_tokenizer, sampling=SAMPLING, n_samples=4, reward=reward)
    trajs, requests = run_episode(
        workflow, tiny_model, tiny_tokenizer, {"prompt": "say aaa", "answer": "aaa"}
    )

    assert isinstance(workflow, RolloutWorkflow)
    assert len(requests) == 1 and requests[0].n_samples == 4  # one prefill for the group
    assert [t.sample_index for t in trajs] == [0, 1, 2, 3]
    assert {t.group_id for t in trajs} == {requests[0].rid}
    for t in trajs:
        completion = tiny_tokenizer.decode(t.completion_ids, skip_special_tokens=True)
        assert t.prompt_ids == chat_ids(tiny_tokenizer, "say aaa")
        assert 1 <= len(t.completion_ids) <= SAMPLING.max_new_tokens
        assert len(t.logprobs) == len(t.versions) == len(t.completion_ids)
        assert all(lp <= 0 for lp in t.logprobs) and t.min_version == 0
        assert t.reward == pytest.approx(completion.count("a") / max(len(completion), 1))
        assert t.info["completion"] == completion and t.info["data"] == {"answer": "aaa"}
        assert t.has_eos == (t.stop_reason == "stop")
    assert len(calls) == 4
    assert all(c["answer"] == "aaa" and "prompt" in c and c["prompt"].endswith("assistant\n") for c in calls)


def test_request_ids_are_unique_across_episodes_and_workflows(tiny_model, tiny_tokenizer):
    a = RLVRWorkflow(tokenizer=tiny_tokenizer, sampling=SAMPLING, n_samples=1, reward=fraction_of_a)
    b = RLVRWorkflow(tokenizer=tiny_tokenizer, sampling=SAMPLING, n_samples=1, reward=fraction_of_a)
    engine = RecordingEngine(NativeEngine(tiny_model, tiny_tokenizer, max_model_len=192, max_concurrent=8))

    async def episodes():
        try:
            return await asyncio.gather(*(w.arun_episode(engine, {"prompt": "x"}) for w in (a, a, b, b)))
        finally:
            await engine.inner.close()

    groups = asyncio.run(episodes())
    assert len({r.rid for r in engine.requests}) == 4
    assert len({g[0].group_id for g in groups}) == 4


def test_dynamic_sampling_rejects_a_prompt_whose_rewards_are_all_equal(tiny_model, tiny_tokenizer):
    def constant(**kwargs):
        return 0.5

    kw = dict(tokenizer=tiny_tokenizer, sampling=SAMPLING, n_samples=3, reward=constant)
    rejected, _ = run_episode(
        RLVRWorkflow(**kw, dynamic_sampling=True), tiny_model, tiny_tokenizer, {"prompt": "q"}
    )
    kept, _ = run_episode(RLVRWorkflow(**kw), tiny_model, tiny_tokenizer, {"prompt": "q"})
    assert rejected is None
    assert [t.reward for t in kept] == [0.5, 0.5, 0.5]


def test_async_and_threaded_rewards_are_awaited(tiny_model, tiny_tokenizer):
    threads = []

    async def async_reward(**kwargs):
        await asyncio.sleep(0)
        return 1.0

    def threaded_reward(**kwargs):
        threads.append(threading.current_thread())
        return 2.0

    kw = dict(tokenizer=tiny_tokenizer, sampling=SAMPLING, n_samples=2)
    trajs, _ = run_episode(
        RLVRWorkflow(**kw, reward=async_reward), tiny_model, tiny_tokenizer, {"prompt": "q"}
    )
    assert [t.reward for t in trajs] == [1.0, 1.0]
    workflow = RLVRWorkflow(**kw, reward=threaded_reward, reward_in_thread=True)
    trajs, _ = run_episode(workflow, tiny_model, tiny_tokenizer, {"prompt": "q"})
    assert [t.reward for t in trajs] == [2.0, 2.0]
    assert threads and all(t is not threading.main_thread() for t in threads)


def test_a_plain_reward_function_that_raises_reaches_the_caller(tiny_model, tiny_tokenizer):
    def broken(**kwargs):
        raise ZeroDivisionError("broken reward")

    workflow = RLVRWorkflow(tokenizer=tiny_tokenizer, sampling=SAMPLING, n_samples=2, reward=broken)
    with pytest.raises(ZeroDivisionError, match="broken reward"):
        run_episode(workflow, tiny_model, tiny_tokenizer, {"prompt": "q"})


@pytest.fixture(scope="module")
def length_pool():
    with RewardPool("reward_fixtures:length_reward", num_workers=1, timeout_s=30, on_error="zero") as pool:
        yield pool


def test_reward_pool_gets_the_data_fields(length_pool, tiny_model, tiny_tokenizer):
    workflow = RLVRWorkflow(tokenizer=tiny_tokenizer, sampling=SAMPLING, n_samples=2, reward=length_pool)
    trajs, _ = run_episode(workflow, tiny_model, tiny_tokenizer, {"prompt": "q", "bonus": 100})
    assert [t.reward for t in trajs] == [len(t.completion_ids) + 100.0 for t in trajs]


def test_a_reward_that_raises_in_a_pool_with_on_error_zero_scores_zero(
    length_pool, tiny_model, tiny_tokenizer
):
    errors_before = length_pool.stats.errors
    workflow = RLVRWorkflow(tokenizer=tiny_tokenizer, sampling=SAMPLING, n_samples=2, reward=length_pool)
    # `len(completion_ids) + "x"` raises TypeError inside the worker
    trajs, _ = run_episode(workflow, tiny_model, tiny_tokenizer, {"prompt": "q", "bonus": "x"})
    assert [t.reward for t in trajs] == [0.0, 0.0]
    assert length_pool.stats.errors == errors_before + 2


# --- prompts and reward fields ----------------------------------------------------------------


def test_messages_and_prompt_keys_render_the_same_chat(tiny_tokenizer):
    from_messages = render_prompt({"messages": [{"role": "user", "content": "hi"}]}, tiny_tokenizer)
    from_prompt = render_prompt({"prompt": "hi"}, tiny_tokenizer)
    assert from_messages.ids == from_prompt.ids == chat_ids(tiny_tokenizer, "hi")
    assert (from_messages.key, from_prompt.key) == ("messages", "prompt")
    assert from_prompt.text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # both present: messages wins; an explicit key picks the column
    both = {"messages": [{"role": "user", "content": "hi"}], "prompt": "other"}
    assert render_prompt(both, tiny_tokenizer).ids == from_messages.ids
    assert render_prompt({"question": "hi"}, tiny_tokenizer, prompt_key="question").ids == from_prompt.ids


def test_messages_key_end_to_end_matches_prompt_key(tiny_model, tiny_tokenizer):
    workflow = RLVRWorkflow(tokenizer=tiny_tokenizer, sampling=SAMPLING, n_samples=1, reward=fraction_of_a)
    data = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    (traj,), _ = run_episode(workflow, tiny_model, tiny_tokenizer, data)
    expected = tiny_tokenizer.apply_chat_template(
        data["messages"], tokenize=False, add_generation_prompt=True
    )
    assert tiny_tokenizer.decode(traj.prompt_ids) == expected
    assert traj.info["data"] == {}


def test_a_prompt_without_a_chat_template_is_encoded_raw(tiny_tokenizer):
    raw = copy.deepcopy(tiny_tokenizer)
    raw.chat_template = None
    prompt = render_prompt({"prompt": "hi there"}, raw)
    assert prompt.text == "hi there"
    assert list(prompt.ids) == raw("hi there")["input_ids"]
    with pytest.raises(ValueError, match="no chat template"):
        render_prompt({"messages": [{"role": "user", "content": "hi"}]}, raw)


@pytest.mark.parametrize(
    ("data", "key", "message"),
    [
        ({"question": "q"}, None, r"no 'messages' or 'prompt' field .*\['question'\]"),
        ({"prompt": "q"}, "question", "no 'question' field"),
        ({"prompt": 3}, None, "must be a string or a list of"),
    ],
)
def test_prompt_errors_say_what_to_fix(tiny_tokenizer, data, key, message):
    with pytest.raises(ValueError, match=message):
        render_prompt(data, tiny_tokenizer, prompt_key=key)


def test_reward_fields_drop_the_prompt_fields_and_refuse_clashes():
    data = {"messages": [], "prompt": "p", "question": "q", "answer": 1}
    assert reward_fields(data, "question") == {"answer": 1}
    with pytest.raises(ValueError, match=r"\['completion'\] clash"):
        reward_fields({"prompt": "p", "completion": "c"}, "prompt")


# --- multi-turn -------------------------------------------------------------------------------


def right_after_feedback(prompt, completion, prompt_ids, completion_ids, **fields):
    """Wrong on the first try, right once the conversation holds the feedback turn."""
    return 1.0 if FEEDBACK in prompt else 0.0


def test_multi_turn_retries_a_wrong_answer_with_feedback(tiny_model, tiny_tokenizer):
    workflow = MultiTurnWorkflow(
        tokenizer=tiny_tokenizer, sampling=SAMPLING, n_samples=2, reward=right_after_feedback,
        feedback=FEEDBACK, turn_discount=0.5,
    )  # fmt: skip
    trajs, requests = run_episode(workflow, tiny_model, tiny_tokenizer, {"prompt": "2+2?", "answer": "4"})

    first = chat_ids(tiny_tokenizer, "2+2?")
    assert [(r.input_ids == first, r.n_samples) for r in requests] == [(True, 2), (False, 1), (False, 1)]
    assert [t.sample_index for t in trajs] == [0, 1]
    assert {t.group_id for t in trajs} == {requests[0].rid}
    separator = feedback_separator_ids(tiny_tokenizer, FEEDBACK)
    for t in trajs:
        assert t.info["turn_rewards"] == [0.0, 1.0]
        assert t.reward == 0.5  # 1.0 discounted once
        assert t.prompt_ids[: len(first)] == first  # the conversation, kept as tokens
        assert t.prompt_ids in {r.input_ids for r in requests[1:]}
        # first prompt, first answer, then the feedback turn (its leading end-of-turn token when needed)
        assert t.prompt_ids[len(first) :][1 - len(separator) :] == tuple(separator[1:])
        assert tiny_tokenizer.decode(t.prompt_ids).endswith(
            f"user\n{FEEDBACK}<|im_end|>\n<|im_start|>assistant\n"
        )
        assert len(t.logprobs) == len(t.versions) == len(t.completion_ids)


def test_multi_turn_stops_after_one_turn_when_the_answer_is_right(tiny_model, tiny_tokenizer):
    def always_right(**kwargs):
        return 1.0

    workflow = MultiTurnWorkflow(
        tokenizer=tiny_tokenizer, sampling=SAMPLING, n_samples=2, reward=always_right
    )
    trajs, requests = run_episode(workflow, tiny_model, tiny_tokenizer, {"prompt": "2+2?"})
    assert len(requests) == 1
    for t in trajs:
        assert t.prompt_ids == chat_ids(tiny_tokenizer, "2+2?")
        assert t.info["turn_rewards"] == [1.0] and t.reward == 1.0


def test_multi_turn_gives_up_after_max_turns(tiny_model, tiny_tokenizer):
    def always_wrong(**kwargs):
        return 0.0

    workflow = MultiTurnWorkflow(
        tokenizer=tiny_tokenizer, sampling=SAMPLING, reward=always_wrong, max_turns=3
    )
    (traj,), requests = run_episode(workflow, tiny_model, tiny_tokenizer, {"prompt": "2+2?"})
    assert len(requests) == 3 and traj.info["turn_rewards"] == [0.0, 0.0, 0.0]
    assert tiny_tokenizer.decode(traj.prompt_ids).count("Your answer is wrong. Try again.") == 2


def test_the_feedback_turn_skips_an_end_of_turn_token_the_model_already_generated(tiny_tokenizer):
    workflow = MultiTurnWorkflow(
        tokenizer=tiny_tokenizer, sampling=SAMPLING, reward=fraction_of_a, feedback=FEEDBACK
    )
    separator = tuple(feedback_separator_ids(tiny_tokenizer, FEEDBACK))
    eos = tiny_tokenizer.eos_token_id
    assert separator[0] == eos
    assert (
        tiny_tokenizer.decode(separator)
        == f"<|im_end|>\n<|im_start|>user\n{FEEDBACK}<|im_end|>\n<|im_start|>assistant\n"
    )
    a = tiny_tokenizer.convert_tokens_to_ids("a")
    assert workflow._feedback_ids([a, eos]) == separator[1:]  # stopped on EOS: do not close twice
    assert workflow._feedback_ids([a, a]) == separator  # truncated: the template closes the turn


# --- settings, loading, the trajectory --------------------------------------------------------


def test_settings_report_every_problem_at_once(tiny_tokenizer):
    with pytest.raises(ValueError, match=r"n_samples=0 must be .*; reward=42 must be a RewardPool"):
        RLVRWorkflow(tokenizer=tiny_tokenizer, sampling=SAMPLING, n_samples=0, reward=42)
    with pytest.raises(ValueError, match="would reject every prompt"):
        RLVRWorkflow(
            tokenizer=tiny_tokenizer,
            sampling=SAMPLING,
            n_samples=1,
            reward=fraction_of_a,
            dynamic_sampling=True,
        )
    with pytest.raises(ValueError, match=r"max_turns=0 .*turn_discount=2 .*feedback=''"):
        MultiTurnWorkflow(
            tokenizer=tiny_tokenizer,
            sampling=SAMPLING,
            reward=fraction_of_a,
            max_turns=0,
            turn_discount=2,
            feedback="",
        )


def test_load_workflow_builds_by_import_path(tiny_tokenizer):
    workflow = load_workflow(
        "laden.rl.workflow:RLVRWorkflow",
        tokenizer=tiny_tokenizer,
        sampling=SAMPLING,
        n_samples=2,
        reward=fraction_of_a,
    )
    assert isinstance(workflow, RLVRWorkflow) and workflow.n_samples == 2
    dotted = load_workflow(  # AReaL's form of the same path
        "laden.rl.workflow.RLVRWorkflow",
        tokenizer=tiny_tokenizer,
        sampling=SAMPLING,
        n_samples=2,
        reward=fraction_of_a,
    )
    assert isinstance(dotted, RLVRWorkflow)


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        ("RLVRWorkflow", {}, "not an import path"),
        ("no_such_module_xyz:Flow", {}, "cannot import 'no_such_module_xyz'"),
        ("laden.rl.workflow:RLVRWorkflo", {}, "has no attribute 'RLVRWorkflo'"),
        ("laden.rl.workflow:PROMPT_KEYS", {}, "names a tuple, not a class"),
        ("laden.rl.workflow:RLVRWorkflow", {"bogus": 1}, r"does not take the arguments \['bogus'\]"),
        ("builtins:dict", {}, "no `async def arun_episode"),
    ],
)
def test_load_workflow_errors_say_what_to_fix(spec, kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_workflow(spec, **kwargs)


def test_trajectory_checks_its_per_token_lists():
    kw = dict(prompt_ids=(1,), reward=0.0, group_id="g", sample_index=0)
    t = Trajectory(completion_ids=[5, 6], logprobs=[-1.0, -2.0], versions=[3, 2], stop_reason="length", **kw)
    assert t.min_version == 2 and not t.has_eos
    with pytest.raises(ValueError, match="2 completion tokens, 1 log-probs, 2 versions"):
        Trajectory(completion_ids=[5, 6], logprobs=[-1.0], versions=[0, 0], stop_reason="stop", **kw)


def test_multi_turn_stops_before_a_turn_that_would_not_fit(tiny_dir, tiny_tokenizer):
    """A conversation that would outgrow the engine's context ends with its last answer."""
    import asyncio

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from laden.rl.workflow import MultiTurnWorkflow, render_prompt
    from laden.rollout import SamplingParams
    from laden.rollout.native import NativeEngine

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_dir), torch_dtype=torch.float32)
    prompt_len = len(render_prompt({"prompt": "hi"}, tiny_tokenizer).ids)
    engine = NativeEngine(model, tiny_tokenizer, max_concurrent=2, max_model_len=prompt_len + 12)
    wf = MultiTurnWorkflow(
        tokenizer=tiny_tokenizer, sampling=SamplingParams(max_new_tokens=8, ignore_eos=True), reward=lambda **kw: 0.0,
        max_turns=3,
    )  # fmt: skip
    (traj,) = asyncio.run(wf.arun_episode(engine, {"prompt": "hi"}))
    assert traj.info["turn_rewards"] == [0.0]  # the second turn's prompt alone would exceed the context
    assert len(traj.completion_ids) == 8
