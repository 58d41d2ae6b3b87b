"""The roundpipe engine: a CPU-resident model streamed through a pool of GPUs, stage by stage.

Config-driven engine (`actor.backend: roundpipe`): `RoundPipeEngine`, `build_roundpipe_engine`;
the stage plan both it and the library API (`laden.roundpipe`) use: `ModelExecutePlan`.
"""

from laden.engine.roundpipe.plan import ModelExecutePlan

__all__ = ["ModelExecutePlan", "RoundPipeEngine", "build_roundpipe_engine"]


def __getattr__(name: str):
    if name in ("RoundPipeEngine", "build_roundpipe_engine"):
        from laden.engine.roundpipe import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'laden.engine.roundpipe' has no attribute {name!r}")
