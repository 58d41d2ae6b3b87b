"""The embedded rollout engine (`rollout.backend: native:d1`): paged KV cache, continuous batching,
device-side sampling, CUDA graphs of the decode step, weights updated in place; tensor parallel over
t processes (`native:d1t2`, `laden.rollout.native.tensor_parallel`)."""

from laden.rollout.native.engine import NativeEngine

__all__ = ["NativeEngine"]
