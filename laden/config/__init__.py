"""laden's configuration: the dataclass tree, YAML + override loading, validation, allocation modes.

`load_config(path, overrides, job=...)` is the entry point; it reports every problem at
once in one `ConfigError`. Importing this package pulls in only pyyaml and the standard
library, so the CLI can parse and check a config without importing torch.
"""

from laden.config.alloc import (
    BACKEND_DIMS,
    IMPLEMENTED_BACKENDS,
    AllocationMode,
    check_alloc,
    head_rule_errors,
    valid_head_sizes,
)
from laden.config.docs import config_reference_markdown, field_docs, missing_docstrings
from laden.config.loader import (
    ConfigError,
    config_from_dict,
    config_to_dict,
    dump_config,
    format_config,
    load_config,
)
from laden.config.schema import (
    ActorConfig,
    CheckpointConfig,
    ClusterConfig,
    DatasetConfig,
    FSDPConfig,
    GenerationConfig,
    LadenConfig,
    MicroBatchSpec,
    NativeConfig,
    OptimizerConfig,
    RolloutConfig,
    RoundPipeConfig,
    SGLangConfig,
    VLLMConfig,
    run_dir,
)
from laden.config.validate import validate_config
from laden.config.validate_model import validate_against_model

__all__ = [
    "BACKEND_DIMS",
    "IMPLEMENTED_BACKENDS",
    "ActorConfig",
    "AllocationMode",
    "CheckpointConfig",
    "ClusterConfig",
    "ConfigError",
    "DatasetConfig",
    "FSDPConfig",
    "GenerationConfig",
    "LadenConfig",
    "MicroBatchSpec",
    "NativeConfig",
    "OptimizerConfig",
    "RolloutConfig",
    "RoundPipeConfig",
    "SGLangConfig",
    "VLLMConfig",
    "check_alloc",
    "config_from_dict",
    "config_reference_markdown",
    "config_to_dict",
    "dump_config",
    "field_docs",
    "format_config",
    "head_rule_errors",
    "load_config",
    "missing_docstrings",
    "run_dir",
    "valid_head_sizes",
    "validate_against_model",
    "validate_config",
]
