"""laden: fine-tune and RL-tune language models bigger than the GPU, without OOM crashes.

The library API of the pipeline trainer (`RoundPipe`, `RoundPipeRunConfig`,
`ModelExecutePlan`, `GradScaler`, `OptimizerCtx`, the recompute helpers) is importable from the top level; it is loaded lazily so that
`import laden` stays cheap for the CLI.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "RoundPipe": "laden.engine.roundpipe",
    "RoundPipeRunConfig": "laden.engine.roundpipe",
    "ModelExecutePlan": "laden.engine.roundpipe",
    "GradScaler": "laden.engine.roundpipe.grad_scaler",
    "OptimizerCtx": "laden.engine.roundpipe.context",
    "save_for_recompute": "laden.engine.roundpipe.context",
    "doing_recompute": "laden.engine.roundpipe.context",
    "get_recompute_data": "laden.engine.roundpipe.context",
    "ModelTimer": "laden.engine.roundpipe.timer",
    "wrap_model_to_roundpipe": "laden.engine.roundpipe.wrapper",
    "AutoRoundPipe": "laden.engine.roundpipe.wrapper",
}


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "optim":  # `laden.optim.Adam` after a bare `import laden`, as with the API it mirrors
        return importlib.import_module("laden.optim")
    raise AttributeError(f"module 'laden' has no attribute {name!r}")


__all__ = [
    "AutoRoundPipe",
    "GradScaler",
    "ModelExecutePlan",
    "ModelTimer",
    "OptimizerCtx",
    "RoundPipe",
    "RoundPipeRunConfig",
    "__version__",
    "doing_recompute",
    "get_recompute_data",
    "save_for_recompute",
    "wrap_model_to_roundpipe",
]
