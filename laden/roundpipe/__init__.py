"""The RoundPipe-compatible library API, layered over the roundpipe engine
(`laden.engine.roundpipe`).

Code written against RoundPipe runs with only its import changed (`from laden import RoundPipe`,
or from here): `RoundPipe` wraps a model whose weights stay in host memory and streams it through
the GPUs; `RoundPipeRunConfig` holds per-call settings; `ModelExecutePlan` (the engine's) splits
layers into stages. The engine never imports this package: what both need lives in the engine.
"""

from laden.engine.roundpipe.context import (
    OptimizerCtx,
    doing_recompute,
    get_recompute_data,
    save_for_recompute,
)
from laden.engine.roundpipe.plan import ModelExecutePlan
from laden.roundpipe.api import RoundPipe
from laden.roundpipe.grad_scaler import GradScaler
from laden.roundpipe.run_config import RoundPipeRunConfig
from laden.roundpipe.timer import ModelTimer
from laden.roundpipe.wrapper import AutoRoundPipe, wrap_model_to_roundpipe

__all__ = [
    "AutoRoundPipe",
    "GradScaler",
    "ModelExecutePlan",
    "ModelTimer",
    "OptimizerCtx",
    "RoundPipe",
    "RoundPipeRunConfig",
    "doing_recompute",
    "get_recompute_data",
    "save_for_recompute",
    "wrap_model_to_roundpipe",
]
