"""The `fsdp` actor backend: FSDP2 data, tensor and Ulysses context parallel training.

`FSDPEngine` is the engine (also laden's single-process engine: `fsdp:d1` without torchrun
runs it without a process group); `init_distributed` and `build_device_mesh` start the
process group from torchrun's environment and lay out the `(dp, cp, tp)` mesh;
`build_fsdp_engine` maps the resolved `actor.*` config onto the engine.
"""

from laden.engine.fsdp.engine import FSDPEngine
from laden.engine.fsdp.factory import build_fsdp_engine
from laden.engine.fsdp.launch import ParallelMesh, build_device_mesh, init_distributed

__all__ = ["FSDPEngine", "ParallelMesh", "build_device_mesh", "build_fsdp_engine", "init_distributed"]
