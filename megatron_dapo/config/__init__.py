"""Typed configuration: one dataclass tree (schema.py, schema_rollout.py, schema_algorithm.py, root.py),
YAML/dotlist loading (loader.py)."""

from megatron_dapo.config.errors import ConfigError
from megatron_dapo.config.loader import (
           from_dict,
           ignored_keys,
           load_config,
           load_config_cli,
           to_dict,
           to_yaml,
)
from megatron_dapo.config.root import Config, resolve_rollout_correction

__all__ = ["Config", "ConfigError", "from_dict", "ignored_keys", "load_config", "load_config_cli",
           "resolve_rollout_correction", "to_dict", "to_yaml"]
