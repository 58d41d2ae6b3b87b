"""laden: fine-tune and RL-tune language models bigger than the GPU, without OOM crashes.

The library API of the pipeline trainer (`RoundPipe`, `RoundPipeRunConfig`,
`ModelExecutePlan`) is importable from the top level; it is loaded lazily so that
`import laden` stays cheap for the CLI.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "RoundPipe": "laden.engine.roundpipe",
    "RoundPipeRunConfig": "laden.engine.roundpipe",
    "ModelExecutePlan": "laden.engine.roundpipe",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'laden' has no attribute {name!r}")


__all__ = ["RoundPipe", "RoundPipeRunConfig", "ModelExecutePlan", "__version__"]
