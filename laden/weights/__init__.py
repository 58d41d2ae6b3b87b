"""Trainer-to-rollout-engine weight updates: a description (`WeightUpdateMeta`) and three transports.

- `disk`: versioned safetensors directories, published atomically (`write_weights`,
  `latest_version`, `read_weights`);
- `xccl`: a broadcast in flat byte buckets over a process group of its own
  (`init_weight_group` in `group`; `send_weights`, `receive_into`, `receive`);
- `inplace`: a colocated engine's tensors overwritten with `copy_` (`fill_in_place`).

A `PartialUpdate` carries only some weights (a LoRA run's adapted projections); disk and in
place accept it and leave the others as they are.

Every transport takes what `TrainEngine.named_weights` yields, one tensor at a time, and none
holds a second copy of the model.
"""

from laden.weights.disk import (
    IncompleteVersionError,
    latest_version,
    list_versions,
    read_weights,
    version_dir,
    write_weights,
)
from laden.weights.group import Collective, WeightGroup, init_weight_group
from laden.weights.inplace import fill_in_place
from laden.weights.meta import (
    WEIGHT_UPDATE_TYPES,
    WeightUpdateMeta,
    WeightUpdateType,
    default_backend,
    free_port,
)
from laden.weights.partial import PartialUpdate
from laden.weights.xccl import (
    IncomingWeights,
    TransferStats,
    WeightSpec,
    receive,
    receive_into,
    send_weights,
    weight_specs,
)

__all__ = [
    "WEIGHT_UPDATE_TYPES",
    "Collective",
    "IncomingWeights",
    "IncompleteVersionError",
    "PartialUpdate",
    "TransferStats",
    "WeightGroup",
    "WeightSpec",
    "WeightUpdateMeta",
    "WeightUpdateType",
    "default_backend",
    "fill_in_place",
    "free_port",
    "init_weight_group",
    "latest_version",
    "list_versions",
    "read_weights",
    "receive",
    "receive_into",
    "send_weights",
    "version_dir",
    "weight_specs",
    "write_weights",
]
