"""The roundpipe engine: a CPU-resident model streamed through a pool of GPUs, stage by stage.

Library API (the second seed's names): `RoundPipe`, `RoundPipeRunConfig`, `ModelExecutePlan`.
Config-driven engine (`actor.backend: roundpipe`): `RoundPipeEngine`, `build_roundpipe_engine`.
"""

from laden.engine.roundpipe.api import RoundPipe
from laden.engine.roundpipe.plan import ModelExecutePlan
from laden.engine.roundpipe.run_config import RoundPipeRunConfig

__all__ = ["ModelExecutePlan", "RoundPipe", "RoundPipeEngine", "RoundPipeRunConfig", "build_roundpipe_engine"]


def __getattr__(name: str):
    if name in ("RoundPipeEngine", "build_roundpipe_engine"):
        from laden.engine.roundpipe import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'laden.engine.roundpipe' has no attribute {name!r}")
