"""AReaL's agentic example configs (copies under `tests/support/areal_configs/`) load in laden, their agent settings in
laden's fields, or are refused naming what they need; an example's agent is swapped for one of your own."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from repo_paths import ROOT

from laden.config import ConfigError, load_config
from laden.rl.agent import AgentWorkflow, build_workflow
from laden.rl.agent.loading import check_workflow_imports
from laden.rollout import SamplingParams

AREAL = ROOT / "tests" / "support" / "areal_configs"
PATHS = [f"actor.path={ROOT / 'laden' / 'assets' / 'tiny'}", "train_dataset.path=train.jsonl",
         "valid_dataset.path=valid.jsonl"]  # fmt: skip


def load(name, *overrides):
    return load_config(AREAL / name, [*PATHS, *overrides], job="rl")


def test_the_agent_workflow_example_names_areals_math_agent_and_says_what_it_needs():
    cfg = load("agent_workflow_config.yaml")
    assert cfg.workflow == cfg.eval_workflow == "areal.workflow.openai.math_agent.MathAgent"
    agent = cfg.rollout.agent
    assert (agent.mode, agent.tool_call_parser, agent.export_style, agent.turn_discount) == (
        "inline", "qwen25", "individual", 1.0)  # fmt: skip
    if importlib.util.find_spec("aiohttp") is not None:
        pytest.skip("aiohttp is installed here: the areal package may import")
    with pytest.raises(ValueError, match="areal") as err:
        check_workflow_imports(cfg)
    if importlib.util.find_spec("areal") is not None:  # installed without its requirements
        assert "it imports the missing module 'aiohttp'; install it (pip install aiohttp" in str(err.value)
        assert "set workflow to an agent class of your own" in str(err.value)


def test_the_multi_turn_example_runs_an_agent_of_your_own_with_its_settings(tiny_tokenizer):
    cfg = load("gsm8k_grpo_mt.yaml", "workflow=agent_fixtures:LetterAgent")
    assert cfg.agent_run_args == {"max_turns": 2} and cfg.rollout.agent.export_style == "concat"
    workflow = build_workflow(
        cfg, tokenizer=tiny_tokenizer, sampling=SamplingParams(), n_samples=4, reward=None
    )
    assert isinstance(workflow, AgentWorkflow)
    assert workflow.agent.max_turns == 2 and workflow.export_style == "concat" and workflow.n_samples == 4


def test_the_openai_agents_example_loads_and_needs_the_agents_sdk():
    cfg = load("openai_agents_config.yaml")
    assert cfg.agent_builder_path == "areal.workflow.openai_agent.math_agent.build_math_agent"
    assert cfg.reward_fn == cfg.reward_fn_path == "areal.reward.gsm8k.gsm8k_reward_fn"
    needs = "needs the openai-agents package .*pip install openai-agents"
    if importlib.util.find_spec("agents") is not None:  # then the builder's own module is what is missing
        if importlib.util.find_spec("aiohttp") is not None:
            pytest.skip("aiohttp is installed here: the areal package may import")
        needs = "agent_builder_path='areal.workflow.openai_agent.math_agent.build_math_agent': cannot import"
    with pytest.raises(ValueError, match=needs):
        check_workflow_imports(cfg)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "tir_math_config.yaml",
            r"tir=\{.*AReaL's tool-integrated-reasoning workflow .*the areal package.*agent_run_args",
        ),
        ("tau2_config_1.7b_airline.yaml", r"econfig=\{.*needs the tau2-bench package"),
    ],
)
def test_examples_whose_agents_laden_lacks_are_refused_naming_what_they_need(name, message):
    with pytest.raises(ConfigError, match=message):
        load(name)


def test_a_module_that_lacks_a_package_is_named(tmp_path, monkeypatch):
    (tmp_path / "needs_pkg_agent.py").write_text("import no_such_package_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load("gsm8k_grpo_mt.yaml", "workflow=needs_pkg_agent:Agent")
    with pytest.raises(
        ValueError, match=r"workflow='needs_pkg_agent:Agent': cannot import 'needs_pkg_agent': it imports the missing "
        r"module 'no_such_package_xyz'; install it \(pip install no_such_package_xyz",
    ):  # fmt: skip
        check_workflow_imports(cfg)
    sys.modules.pop("needs_pkg_agent", None)
