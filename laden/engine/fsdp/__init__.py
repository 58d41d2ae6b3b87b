"""The `fsdp` actor backend: FSDP2 data, tensor and Ulysses context parallel training.

`FSDPEngine` is the engine (also laden's single-process engine: `fsdp:d1` without torchrun
runs it without a process group); `build_fsdp_engine` maps the resolved `actor.*` config onto
the engine. The process group and the `(dp, cp, tp)` mesh it runs on, its tensor-parallel
plans, Ulysses context parallel and offload are shared with the archon engine and live in
`laden.engine.parallel`.
"""

from laden.engine.fsdp.engine import FSDPEngine
from laden.engine.fsdp.factory import build_fsdp_engine

__all__ = ["FSDPEngine", "build_fsdp_engine"]
