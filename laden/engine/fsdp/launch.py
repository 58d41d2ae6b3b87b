"""`init_distributed` under its former path, for the importers outside the engines that still read it here
(`laden.engine.runtime`, `laden.rollout.native.backend`); it lives in `laden.engine.parallel.launch`."""

from laden.engine.parallel.launch import init_distributed

__all__ = ["init_distributed"]
