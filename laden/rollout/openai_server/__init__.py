"""An OpenAI-compatible endpoint in front of a rollout engine, recording each episode's calls as tokens."""

from laden.rollout.openai_server.endpoint import OpenAIEndpoint
from laden.rollout.openai_server.session import Interaction, Session

__all__ = ["Interaction", "OpenAIEndpoint", "Session"]
