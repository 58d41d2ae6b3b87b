"""laden: fine-tune and RL-tune language models bigger than the GPU, without OOM crashes.

The library API of the pipeline trainer (`laden.roundpipe`: `RoundPipe`, `RoundPipeRunConfig`,
`ModelExecutePlan`, `GradScaler`, `OptimizerCtx`, the recompute helpers) is importable from the
top level; it is loaded lazily so that `import laden` stays cheap for the CLI.
"""

from __future__ import annotations

__version__ = "0.1.0"

_API_NAMES = (  # the names of `laden.roundpipe` (its `__all__`), imported on first use
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
)


def __getattr__(name: str):
    import importlib

    if name in _API_NAMES:
        return getattr(importlib.import_module("laden.roundpipe"), name)
    if name == "optim":  # `laden.optim.Adam` after a bare `import laden`, as with the API it mirrors
        return importlib.import_module("laden.optim")
    raise AttributeError(f"module 'laden' has no attribute {name!r}")


__all__ = ["__version__", *_API_NAMES]
