"""The example agents (examples/math_agents): the calculator agent's tool calls and retries, the TIR agent's
sandboxed code turns, each run through laden's endpoint over a scripted engine (exact replies, so every turn
and reward is known), and the example configs that name them."""

from __future__ import annotations

import asyncio
import json

import pytest
from agent_fixtures import ScriptedEngine
from repo_paths import ROOT

from laden.config import load_config
from laden.rl.agent import AgentWorkflow
from laden.rollout import SamplingParams

EXAMPLES = ROOT / "examples"


@pytest.fixture(autouse=True)
def _examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    for name in ("OPENAI_BASE_URL", "OPENAI_API_KEY"):  # inline agent workflows set them; put them back after
        monkeypatch.setenv(name, "unset")


def run_scripted(agent, tokenizer, replies: list[str], row: dict) -> tuple[list, ScriptedEngine]:
    """One run of `agent` on `row` whose model calls are answered, in order, by `replies` (each ended by the
    end-of-turn token, as a model stops); the trajectories (individual export) and the engine's record."""
    eos = tokenizer.eos_token_id
    engine = ScriptedEngine([[*tokenizer.encode(r, add_special_tokens=False), eos] for r in replies])
    workflow = AgentWorkflow(agent=agent, tokenizer=tokenizer, sampling=SamplingParams(max_new_tokens=64),
                             n_samples=1, tool_call_parser="hermes", turn_discount=1.0)  # fmt: skip

    async def main():
        try:
            return await workflow.arun_episode(engine, row)
        finally:
            await workflow.aclose()

    trajs = asyncio.run(asyncio.wait_for(main(), timeout=120))  # the timeout only guards against a hang
    assert not engine.outputs, "every scripted reply was asked for"
    return trajs, engine


def prompt_text(tokenizer, engine, i: int) -> str:
    return tokenizer.decode(list(engine.requests[i].input_ids))


def tool_call(expression: str) -> str:
    return (
        "<tool_call>"
        + json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        + "</tool_call>"
    )


def test_answers_are_read_and_checked_as_numbers():
    from math_agents.answers import final_answer, is_correct, opening_messages

    assert final_answer("so 3+4 is 7") == "7" and final_answer("it is \\boxed{7/2}, not 9") == "7/2"
    assert final_answer("no digits") is None and final_answer("-12.5 then 1 / 4") == "1/4"
    assert is_correct("7/2", "3.5") and is_correct("10", 10) and not is_correct("11", "10")
    assert not is_correct(None, "1") and is_correct("x", " x ")  # a reference that is not a number: text
    assert opening_messages({"prompt": "3+4="}, "sys") == [{"role": "system", "content": "sys"},
                                                           {"role": "user", "content": "3+4="}]  # fmt: skip
    assert opening_messages({"messages": [{"role": "system", "content": "own"}]}, "sys") == [
        {"role": "system", "content": "own"}
    ]
    with pytest.raises(KeyError, match="none of 'messages', 'prompt' or 'question'"):
        opening_messages({"q": 1}, None)

    from math_agents.answers import endpoint_client

    client = endpoint_client({"base_url": "http://127.0.0.1:1/v1", "api_key": "k"})
    assert client.timeout == 600.0 and client.max_retries == 0  # a busy endpoint's slow connect is no failure


def test_the_calculator_tool_answers_each_call_or_says_what_is_wrong():
    from math_agents.calculator import call_calculator

    assert call_calculator("calculator", '{"expression": "(12 + 7) * 3"}') == "57"
    assert call_calculator("calculator", '{"expression": "open(1)"}').startswith("error: only numbers")
    assert call_calculator("search", "{}").startswith("error: no tool named 'search'")
    assert call_calculator("calculator", "3+4").startswith("error: the arguments are not JSON")
    assert call_calculator("calculator", "{}").startswith("error: expected a non-empty arithmetic expression")


def test_the_calculator_agent_calls_the_tool_then_answers(tiny_tokenizer):
    from math_agents.calculator import CalculatorAgent

    agent = CalculatorAgent(system_prompt=None)
    trajs, engine = run_scripted(agent, tiny_tokenizer, [tool_call("38 * 41"), "It is \\boxed{1558}."],
                                 {"prompt": "What is 38 * 41?", "answer": "1558"})  # fmt: skip
    assert len(trajs) == 2 and [t.reward for t in trajs] == [
        1.0,
        1.0,
    ]  # correct: 1 on the last call, discount 1
    second = prompt_text(tiny_tokenizer, engine, 1)
    assert second.endswith("<|im_start|>tool\n1558<|im_end|>\n<|im_start|>assistant\n")  # the tool's answer


def test_a_wrong_answer_gets_feedback_and_another_try_up_to_max_turns(tiny_tokenizer):
    from math_agents.calculator import CalculatorAgent

    row = {"prompt": "3+4=", "answer": "7"}
    trajs, engine = run_scripted(CalculatorAgent(max_turns=3, system_prompt=None), tiny_tokenizer,
                                 ["8", "maybe 7"], row)  # fmt: skip
    assert [t.reward for t in trajs] == [1.0, 1.0]
    assert "Your answer (8) is wrong. Try again." in prompt_text(tiny_tokenizer, engine, 1)
    trajs, _ = run_scripted(CalculatorAgent(max_turns=2, system_prompt=None), tiny_tokenizer, ["8", "9"], row)
    assert [t.reward for t in trajs] == [0.0, 0.0]  # two wrong answers and no turn left
    trajs, _ = run_scripted(CalculatorAgent(max_turns=3, system_prompt=None, feedback=False), tiny_tokenizer,
                            ["8"], row)  # fmt: skip
    assert [t.reward for t in trajs] == [0.0]  # without feedback the first answer is final
    with pytest.raises(ValueError, match="max_turns=0 must be at least 1"):
        CalculatorAgent(max_turns=0)


def test_the_tir_agent_runs_the_code_in_the_sandbox_and_scores_the_answer(tiny_tokenizer):
    from math_agents.tir import TIRAgent, code_block

    assert code_block("x\n```python\nprint(1)\n```\n```py\nprint(2)\n```") == "print(1)\n"
    assert code_block("```\nprint(1)\n```") is None
    code = "```python\nimport math\nprint(math.comb(10, 3))\n```"
    trajs, engine = run_scripted(TIRAgent(system_prompt=None), tiny_tokenizer, [code, "\\boxed{120}"],
                                 {"prompt": "How many ways to pick 3 of 10?", "answer": "120"})  # fmt: skip
    assert [t.reward for t in trajs] == [1.0, 1.0]
    assert prompt_text(tiny_tokenizer, engine, 1).endswith(
        "<|im_start|>tool\n120<|im_end|>\n<|im_start|>assistant\n"
    )
    failing = "```python\nprint(1 / 0)\n```"
    trajs, engine = run_scripted(TIRAgent(system_prompt=None, max_turns=2, output_role="user"), tiny_tokenizer,
                                 [failing, "```python\nprint(3 + 4)\n```"], {"prompt": "3+4=", "answer": "7"})  # fmt: skip
    assert "<|im_start|>user\nTraceback" in prompt_text(tiny_tokenizer, engine, 1)  # the error comes back
    assert "ZeroDivisionError: division by zero" in prompt_text(tiny_tokenizer, engine, 1)
    assert [t.reward for t in trajs] == [0.0, 0.0]  # the last turn wrote code: the 7 in it is not an answer


def test_the_tir_agent_stops_code_that_runs_too_long(tiny_tokenizer):
    from math_agents.tir import TIRAgent

    loop = "```python\nwhile True:\n    pass\n```"
    _, engine = run_scripted(TIRAgent(system_prompt=None, timeout=1.0), tiny_tokenizer, [loop, "7"],
                             {"prompt": "3+4=", "answer": "7"})  # fmt: skip
    assert "[timed out: the code ran past its time limit and was stopped]" in prompt_text(
        tiny_tokenizer, engine, 1
    )


@pytest.mark.parametrize("name", ["rl_agent_calculator.yaml", "rl_agent_tir.yaml"])
def test_the_example_configs_load_and_name_an_agent_with_arguments_it_takes(name, tiny_tokenizer):
    from laden.config.usage import fields_without_effect
    from laden.rl.agent.loading import build_workflow, check_workflow_imports

    cfg = load_config(str(EXAMPLES / name), [], job="rl")
    assert fields_without_effect(cfg, job="rl", engine="fsdp") == []
    assert check_workflow_imports(cfg) is False  # an agent: no reward function is called
    workflow = build_workflow(
        cfg, tokenizer=tiny_tokenizer, sampling=SamplingParams(), n_samples=4, reward=None
    )
    assert isinstance(workflow, AgentWorkflow) and workflow.agent.max_turns == cfg.max_turns
