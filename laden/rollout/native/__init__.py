"""The embedded rollout engine (`rollout.backend: native:d1`): paged KV cache, continuous batching,
device-side sampling, CUDA graphs of the decode step, weights updated in place."""

from laden.rollout.native.engine import NativeEngine

__all__ = ["NativeEngine"]
