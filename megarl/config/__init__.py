"""Typed configuration: the schema tree and its YAML/override loader."""

from megarl.config.loader import ConfigError, load_config, to_yaml, validate
from megarl.config.schema import (
    AlgorithmConfig,
    DataConfig,
    LayoutsConfig,
    LoggingConfig,
    MegarlConfig,
    ModelConfig,
    OffloadConfig,
    OptimizerConfig,
    ParallelConfig,
    RolloutLayoutConfig,
    TrainerConfig,
)

__all__ = [
    "AlgorithmConfig", "ConfigError", "DataConfig", "LayoutsConfig", "LoggingConfig",
    "MegarlConfig", "ModelConfig", "OffloadConfig", "OptimizerConfig", "ParallelConfig", "RolloutLayoutConfig",
    "TrainerConfig", "load_config", "to_yaml", "validate",
]
