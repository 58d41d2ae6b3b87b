"""`laden rl` with the example agents (examples/math_agents): one step of each end to end on the tiny model, and
each agent learning: the tiny model, first taught the agent's tool format by a short `laden sft`
(examples/math_agents/tiny_run.py), raises its training reward and its held-out accuracy by GRPO with the agent,
every tool call answered by the calculator or every code block run in the sandbox."""

from __future__ import annotations

import json

import pytest
from repo_paths import ASSETS, ROOT
from rl_runs import tiny_rl_config

from laden.rl.trainer import run_rl

pytestmark = pytest.mark.usefixtures("one_thread")

AGENTS = {"calculator": "math_agents.calculator:CalculatorAgent", "tir": "math_agents.tir:TIRAgent"}


@pytest.fixture(autouse=True)
def _examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    for name in ("OPENAI_BASE_URL", "OPENAI_API_KEY"):  # inline agent workflows set them; put them back after
        monkeypatch.setenv(name, "unset")


def sums(tmp_path):
    """The embedded SFT job's single-digit sums as RL rows (`prompt`, `answer`): its 80 training sums, and its 20
    held-out ones."""
    paths = {}
    for split in ("train", "valid"):
        rows = [json.loads(line) for line in (ASSETS / f"sft_tiny_{split}.jsonl").read_text().splitlines()]
        paths[split] = tmp_path / f"sums_{split}.jsonl"
        paths[split].write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["completion"]}) + "\n"
                                        for r in rows))  # fmt: skip
    return paths


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_one_step_of_laden_rl_with_an_example_agent(agent, tmp_path):
    data = sums(tmp_path)
    result = run_rl(tiny_rl_config(
        tmp_path, f"workflow={AGENTS[agent]}", "agent_run_args={system_prompt: null, max_tokens: 8}", "max_turns=2",
        "export_style=concat", "rollout.agent.tool_call_parser=hermes", f"train_dataset.path={data['train']}",
        f"valid_dataset.path={data['valid']}", "total_train_steps=1", "train_dataset.batch_size=2",
        "gconfig.n_samples=2", "gconfig.max_new_tokens=8", "train_dataset.max_length=96",
        "valid_dataset.max_length=96", "checkpoint.export_hf=false",
    ), progress=False)  # fmt: skip
    assert result.num_steps == 1 and result.completions == 2 * 2  # concat: one sequence per run
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evaluations] == [0, 1] and all(
        r["eval/completions"] == 20 for r in evaluations
    )
    assert 0.0 <= result.rewards[0] <= 1.0


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_an_example_agent_learns_on_the_tiny_model(agent, tmp_path):
    """examples/math_agents/tiny_run.py as a user runs it: `laden sft` teaches the tiny model the agent's tool
    format (half of its traces use the tool), then `laden rl` with the agent raises the training reward and the
    held-out accuracy (temperature 1, 100 problems none of which is a training problem)."""
    from math_agents.tiny_run import run

    summary = run(agent, tmp_path, progress=False)
    print(summary.text())
    assert summary.held_out_overlap == 0
    first, last = sum(summary.rewards[:3]) / 3, sum(summary.rewards[-3:]) / 3
    assert last >= first + 0.1, summary.rewards
    before, after = summary.held_out
    assert after >= before + 0.1, summary.held_out


def test_the_warm_start_traces_show_the_sandbox_output_as_the_tir_agent_does():
    from math_agents.tiny_run import tool_turns
    from math_agents.tir import code_block

    from laden.tools.sandbox import run_python

    call, output = tool_turns("tir", 37, 45)
    assert run_python(code_block(call["content"])).text() == output["content"] == "1665"
