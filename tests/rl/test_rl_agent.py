"""Agent workflows (`laden.rl.agent`): AReaL's export styles checked token by token against hand-built
sequences, reward assignment and turn discount, an agent run over the native engine, and `laden rl` with an
agent that completes its steps."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from agent_fixtures import EnvAgent, LetterAgent, share_of_a
from rl_runs import ASSETS, tiny_rl_config

from laden.cli import main
from laden.rl.agent import AgentWorkflow, export_calls
from laden.rl.agent.loading import build_workflow, is_agent_class
from laden.rl.batches import pack_trajectories
from laden.rl.trainer import run_rl
from laden.rl.workflow import RLVRWorkflow
from laden.rollout import SamplingParams
from laden.rollout.native import NativeEngine
from laden.rollout.openai_server import Interaction, OpenAIEndpoint, Session

pytestmark = pytest.mark.usefixtures("one_thread")


def call(cid, prompt, completion, *, parent=None, version=1, reward=None):
    return Interaction(
        id=cid, api="chat", prompt_ids=list(prompt), completion_ids=list(completion), parent=parent,
        logprobs=[-0.1 * (i + 1) for i in range(len(completion))], versions=[version] * len(completion),
        stop_reason="stop", output_message={"role": "assistant", "content": cid}, reward=reward,
    )  # fmt: skip


def two_turns():
    """Turn 1: prompt [1 2 3] answers [4 5 9]; turn 2's prompt extends it with [6 7] and answers [8 9]."""
    first = call("c1", [1, 2, 3], [4, 5, 9], version=1, reward=0.0)
    second = call("c2", [1, 2, 3, 4, 5, 9, 6, 7], [8, 9], parent=first, version=2, reward=1.0)
    return first, second


def test_individual_export_is_one_sample_per_call():
    first, second = two_turns()
    a, b = export_calls([first, second], "individual")
    assert (a.prompt_ids, a.completion_ids, a.loss_mask, a.reward) == ([1, 2, 3], [4, 5, 9], [1, 1, 1], 0.0)
    assert (b.prompt_ids, b.completion_ids, b.loss_mask, b.reward) == (
        [1, 2, 3, 4, 5, 9, 6, 7],
        [8, 9],
        [1, 1],
        1.0,
    )
    assert b.versions == [2, 2] and b.logprobs == pytest.approx([-0.1, -0.2])


def test_concat_export_is_the_conversation_trained_on_the_model_turns_only():
    first, second = two_turns()
    (sample,) = export_calls([first, second], "concat")
    assert sample.prompt_ids == [1, 2, 3]
    assert sample.completion_ids == [4, 5, 9, 6, 7, 8, 9]
    assert sample.loss_mask == [1, 1, 1, 0, 0, 1, 1]  # the user turn [6 7] is never trained on
    assert sample.logprobs == pytest.approx([-0.1, -0.2, -0.3, 0.0, 0.0, -0.1, -0.2])
    assert sample.versions == [1, 1, 1, -1, -1, 2, 2]
    assert sample.reward == 1.0 and sample.call_ids == ["c1", "c2"]


def test_concat_export_of_a_branching_conversation_is_one_sample_per_leaf():
    first, second = two_turns()
    other = call("c3", [1, 2, 3, 4, 5, 9, 7], [5], parent=first, version=2, reward=0.5)
    leaves = export_calls([first, second, other], "concat")
    assert [s.call_ids for s in leaves] == [["c1", "c2"], ["c1", "c3"]]
    assert leaves[1].completion_ids == [4, 5, 9, 7, 5] and leaves[1].loss_mask == [1, 1, 1, 0, 1]


def test_concat_export_falls_back_as_areal_does_when_the_prompt_does_not_extend_the_parent():
    first, _ = two_turns()
    rerendered = call("c2", [1, 2, 3, 4, 5, 6, 7], [8, 9], parent=first, reward=1.0)  # [9] re-tokenised away
    (sample,) = export_calls([first, rerendered], "concat")
    assert sample.prompt_ids == [1, 2, 3, 4, 5, 6, 7] and sample.completion_ids == [8, 9]
    assert sample.loss_mask == [1, 1] and sample.call_ids == ["c2"]


def test_a_float_reward_goes_to_the_last_call_and_the_discount_propagates_back():
    session = Session("k")
    for i in range(3):
        session.add(call(f"c{i}", [1], [2]))
    session.assign(1.0)
    session.apply_reward_discount(0.5)
    assert [c.reward for c in session.completed()] == [0.25, 0.5, 1.0]
    with pytest.raises(RuntimeError, match="already discounted"):
        session.apply_reward_discount(0.5)


def test_a_dict_reward_is_assigned_per_completion_then_discounted():
    session = Session("k")
    for i in range(3):
        session.add(call(f"c{i}", [1], [2]))
    session.assign({"c0": 1.0, "c2": 2.0})
    session.apply_reward_discount(0.9)
    assert [c.reward for c in session.completed()] == pytest.approx([1.0 + 0.9 * 0.9 * 2.0, 0.9 * 2.0, 2.0])
    with pytest.raises(KeyError, match="'nope' is not a call of this episode"):
        session.assign({"nope": 1.0})


def test_a_dict_reward_for_an_unanswered_call_is_reported_as_dropped(caplog):
    session = Session("k")
    session.add(call("c0", [1], [2]))
    session.add(Interaction(id="c1", api="chat", prompt_ids=[1]))  # failed: never answered
    with caplog.at_level("WARNING"):
        session.assign({"c0": 1.0, "c1": 5.0})
    assert "rewards for 1 unanswered call(s) (c1) are dropped" in caplog.text
    assert [c.id for c in session.completed()] == ["c0"] and session.completed()[0].reward == 1.0
    with pytest.raises(TypeError, match="must return a number"):
        session.assign("high")


def test_a_loss_mask_reaches_the_packed_labels(tiny_tokenizer):
    first, second = two_turns()
    (sample,) = export_calls([first, second], "concat")
    from laden.rl.workflow import Trajectory

    traj = Trajectory(prompt_ids=tuple(sample.prompt_ids), completion_ids=sample.completion_ids,
                      logprobs=sample.logprobs, versions=sample.versions, reward=1.0, stop_reason="stop",
                      group_id="g", sample_index=0, loss_mask=sample.loss_mask)  # fmt: skip
    assert traj.min_version == 1 and traj.model_versions == [1, 1, 1, 2, 2]
    (mb,), _ = pack_trajectories([traj], {}, max_tokens_per_mb=64, n_mbs=1, algorithm="ffd", device="cpu")
    ids = [*sample.prompt_ids, *sample.completion_ids]
    trained = [ids[i + 1] for i, label in enumerate(mb.labels.flatten().tolist()) if label != -100]
    assert trained == [4, 5, 9, 8, 9]


def run_agent(workflow, model, tokenizer, rows):
    async def main():
        engine = NativeEngine(model, tokenizer, max_model_len=128, max_concurrent=8)
        try:
            return await asyncio.gather(*(workflow.arun_episode(engine, row) for row in rows))
        finally:
            await workflow.aclose()
            await engine.close()

    return asyncio.run(asyncio.wait_for(main(), timeout=120))  # the timeout only guards against a hang


def test_an_agent_episode_exports_concat_sequences_that_extend_its_calls(tiny_model, tiny_tokenizer):
    workflow = AgentWorkflow(agent=LetterAgent(max_turns=2, per_call=True), tokenizer=tiny_tokenizer,
                             sampling=SamplingParams(max_new_tokens=6), n_samples=2, export_style="concat",
                             turn_discount=0.5)  # fmt: skip
    ((a, b),) = run_agent(workflow, tiny_model, tiny_tokenizer, [{"prompt": "say a"}])
    for traj in (a, b):
        mask = traj.loss_mask
        assert traj.group_id == a.group_id and len(traj.info["calls"]) == 2
        first_len = mask.index(0)  # the first answer, then the feedback turn, then the second answer
        gap = mask[first_len:].index(1)
        second = traj.completion_ids[first_len + gap :]
        assert mask == [1] * first_len + [0] * gap + [1] * len(second)
        sep = tiny_tokenizer.decode(traj.completion_ids[first_len : first_len + gap])
        assert sep.endswith("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
        first_text = tiny_tokenizer.decode(traj.completion_ids[:first_len], skip_special_tokens=True)
        second_text = tiny_tokenizer.decode(second, skip_special_tokens=True)
        assert traj.reward == pytest.approx(share_of_a(second_text))
        assert first_text is not None and all(v == 0 for v in traj.model_versions)
    assert [t.sample_index for t in (a, b)] == [0, 1]


def test_an_agent_episode_exports_every_call_individually(tiny_model, tiny_tokenizer, monkeypatch):
    starts = []
    start = OpenAIEndpoint.start

    async def counted(self):
        starts.append(self)
        return await start(self)

    monkeypatch.setattr(OpenAIEndpoint, "start", counted)
    workflow = AgentWorkflow(agent=LetterAgent(max_turns=3), tokenizer=tiny_tokenizer,
                             sampling=SamplingParams(max_new_tokens=6), n_samples=1, turn_discount=1.0)  # fmt: skip
    (*calls,), other = run_agent(
        workflow, tiny_model, tiny_tokenizer, [{"prompt": "say a"}, {"prompt": "say b"}]
    )
    assert len(starts) == 1  # the episodes of a batch start together and share one endpoint
    assert len(other) == 3 and other[0].group_id != calls[0].group_id
    assert len(calls) == 3 and all(t.loss_mask == [1] * len(t.completion_ids) for t in calls)
    assert calls[1].prompt_ids[: len(calls[0].prompt_ids)] == calls[0].prompt_ids
    last = tiny_tokenizer.decode(calls[2].completion_ids, skip_special_tokens=True)
    assert [t.reward for t in calls] == pytest.approx([share_of_a(last)] * 3)  # float reward, discount 1


def test_the_config_names_an_agent_class_or_a_workflow(tmp_path, tiny_tokenizer):
    cfg = tiny_rl_config(tmp_path, "workflow=agent_fixtures:LetterAgent", "agent_run_args={per_call: true}",
                         "max_turns=3", "n_trajs=3", "export_style=concat", "turn_discount=0.9")  # fmt: skip
    assert is_agent_class(LetterAgent) and not is_agent_class(RLVRWorkflow)
    workflow = build_workflow(
        cfg, tokenizer=tiny_tokenizer, sampling=SamplingParams(), n_samples=4, reward=None
    )
    assert isinstance(workflow, AgentWorkflow) and workflow.n_samples == 3
    assert workflow.agent.max_turns == 3 and workflow.agent.per_call
    assert (workflow.export_style, workflow.turn_discount) == ("concat", 0.9)
    evaluation = build_workflow(cfg, tokenizer=tiny_tokenizer, sampling=SamplingParams(), n_samples=1, reward=None,
                                evaluation=True)  # fmt: skip
    assert evaluation.n_samples == 1 and evaluation.evaluation
    bad = tiny_rl_config(tmp_path, "workflow=agent_fixtures:LetterAgent", "agent_run_args={colour: red}")
    with pytest.raises(ValueError, match="constructor refuses them"):
        build_workflow(bad, tokenizer=tiny_tokenizer, sampling=SamplingParams(), n_samples=1, reward=None)


def test_laden_rl_trains_an_agent_for_a_step_and_laden_eval_repeats_its_evaluation(tmp_path, capsys):
    args = ["workflow=agent_fixtures:LetterAgent", "agent_run_args={per_call: true}", "export_style=concat",
            "total_train_steps=1", "train_dataset.batch_size=2", "gconfig.n_samples=2", "gconfig.max_new_tokens=6",
            "turn_discount=0.5", "train_dataset.max_length=120", "valid_dataset.max_length=120"]  # fmt: skip
    result = run_rl(tiny_rl_config(tmp_path, *args), progress=False)
    assert result.num_steps == 1 and len(result.rewards) == 1
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r.get("step") == 1 and "completions" in r)
    assert step["completions"] == 2 * 2  # concat: one sequence per run, two runs per prompt
    logged = next(r for r in rows if r.get("step") == 1 and "eval/accuracy" in r)
    assert logged["eval/completions"] == 16  # the agent ran the held-out evaluation: one run per prompt
    capsys.readouterr()
    overrides = [f"{k}={v}" for k, v in (("actor.path", ASSETS / "tiny"), ("train_dataset.path", ASSETS / "rl_tiny.jsonl"),
                 ("valid_dataset.path", ASSETS / "rl_tiny_valid.jsonl"), ("cluster.fileroot", tmp_path))]  # fmt: skip
    ckpt = result.run_dir / "checkpoints" / "step_1"
    assert (
        main(["eval", "--checkpoint", str(ckpt), "--config", str(ASSETS / "rl_tiny.yaml"), *overrides, *args])
        == 0
    )
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("eval/accuracy", "eval/reward_mean", "eval/response_length", "eval/completions"):
        assert record[key] == logged[key], key  # the same greedy agent runs, outside the run


@pytest.fixture(autouse=True)
def _openai_environment(monkeypatch):
    """Inline agent workflows set OPENAI_BASE_URL and OPENAI_API_KEY in this process; put them back after."""
    for name in ("OPENAI_BASE_URL", "OPENAI_API_KEY"):
        monkeypatch.setenv(name, "unset")


def test_subproc_mode_gives_each_run_its_own_environment(tiny_model, tiny_tokenizer):
    workflow = AgentWorkflow(agent=EnvAgent(blocking=True), tokenizer=tiny_tokenizer, n_samples=2,
                             sampling=SamplingParams(max_new_tokens=4), mode="subproc", subproc_max_workers=2)  # fmt: skip
    ((a, b),) = run_agent(workflow, tiny_model, tiny_tokenizer, [{"prompt": "say a"}])
    prompt = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "say a"}], tokenize=False,
                                                add_generation_prompt=True)  # fmt: skip
    for traj in (a, b):
        assert tiny_tokenizer.decode(traj.prompt_ids) == prompt
        text = tiny_tokenizer.decode(traj.completion_ids, skip_special_tokens=True)
        assert traj.reward == pytest.approx(share_of_a(text))


def test_inline_mode_refuses_the_shared_environment_key_and_says_why(tiny_model, tiny_tokenizer, caplog):
    workflow = AgentWorkflow(agent=EnvAgent(blocking=False), tokenizer=tiny_tokenizer,
                             sampling=SamplingParams(max_new_tokens=4))  # fmt: skip
    with caplog.at_level(logging.ERROR, logger="laden.rl"):
        assert run_agent(workflow, tiny_model, tiny_tokenizer, [{"prompt": "say a"}]) == [
            None
        ]  # the row is rejected
    assert workflow.failed_runs == 1
    assert (
        "process-wide OPENAI_API_KEY" in workflow.last_failure
        and "rollout.agent.mode: subproc" in workflow.last_failure
    )
    (record,) = [r for r in caplog.records if r.name == "laden.rl"]
    assert "the row is rejected" in record.getMessage() and record.exc_info is not None  # with its traceback


def test_an_openai_agents_sdk_agent_runs_against_the_endpoint_and_is_scored_by_the_reward(
    tiny_model, tiny_tokenizer
):
    pytest.importorskip("agents")
    from agent_fixtures import text_length_reward

    from laden.rl.agent.openai_agents import OpenAIAgentsRunner

    runner = OpenAIAgentsRunner(
        builder_path="agent_fixtures:build_sdk_agent", builder_kwargs={}, reward=text_length_reward
    )
    workflow = AgentWorkflow(
        agent=runner, tokenizer=tiny_tokenizer, sampling=SamplingParams(max_new_tokens=6), n_samples=2
    )
    ((a, b),) = run_agent(
        workflow, tiny_model, tiny_tokenizer, [{"messages": [{"role": "user", "content": "say a"}]}]
    )
    system = [
        {"role": "system", "content": "Answer with the letter a."},
        {"role": "user", "content": "say a"},
    ]
    prompt = tiny_tokenizer.apply_chat_template(system, tokenize=False, add_generation_prompt=True)
    eos = tiny_tokenizer.eos_token_id
    for traj in (a, b):
        assert tiny_tokenizer.decode(traj.prompt_ids) == prompt  # the SDK's instructions as the system turn
        shown = traj.completion_ids[:-1] if traj.completion_ids[-1:] == [eos] else traj.completion_ids
        assert traj.reward == len(tiny_tokenizer.decode(shown)) > 0  # its final output, scored


def test_a_run_whose_agent_always_fails_stops_naming_the_agents_error(tmp_path):
    args = ["workflow=agent_fixtures:FailingAgent", "total_train_steps=1", "train_dataset.batch_size=2",
            "gconfig.n_samples=2", "valid_dataset=null"]  # fmt: skip
    with pytest.raises(
        RuntimeError, match="the latest failure: agent FailingAgent.run raised KeyError: 'question'"
    ):
        run_rl(tiny_rl_config(tmp_path, *args), progress=False)
