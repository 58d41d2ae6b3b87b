"""Rollout engines: the `RolloutEngine` protocol, the embedded `native` engine, vLLM and SGLang servers."""

from laden.rollout.base import GenerationRequest, GenerationResult, RolloutEngine, SamplingParams, StopReason

__all__ = ["GenerationRequest", "GenerationResult", "RolloutEngine", "SamplingParams", "StopReason"]
