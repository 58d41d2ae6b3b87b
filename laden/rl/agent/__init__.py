"""Agentic RL: agents (AReaL's `async def run(self, data, **extra_kwargs)`) trained through an OpenAI-compatible
endpoint that records their calls as tokens (`laden.rollout.openai_server`); see docs/agents.md."""

from laden.rl.agent.export import Sample, export_calls
from laden.rl.agent.loading import build_workflow, is_agent_class
from laden.rl.agent.workflow import AgentWorkflow

__all__ = ["AgentWorkflow", "Sample", "build_workflow", "export_calls", "is_agent_class"]
