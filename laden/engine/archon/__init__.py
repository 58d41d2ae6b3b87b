"""The `archon` engine: pipeline stages over `torch.distributed.pipelining`, FSDP2 within each stage,
Mixture-of-Experts layers over expert-parallel ranks (`laden.engine.archon.engine`)."""

from laden.engine.archon.engine import ArchonEngine
from laden.engine.archon.factory import build_archon_engine

__all__ = ["ArchonEngine", "build_archon_engine"]
