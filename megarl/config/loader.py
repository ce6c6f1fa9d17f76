"""Compose a MegarlConfig from YAML files and ``key=value`` overrides, checked against the schema.

Unknown keys and values of the wrong type raise :class:`ConfigError` naming the full key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence, Type, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megarl.config.schema import MegarlConfig

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value or key a user must change."""


def _explain(exc: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or "?"
    msg = getattr(exc, "msg", None) or str(exc)
    first = str(msg).splitlines()[0]
    return ConfigError(f"{source}: config key '{key}': {first}")


def load_config(
    yaml_files: Sequence[str | Path] = (),
    overrides: Iterable[str] = (),
    schema: Type[T] = MegarlConfig,
) -> T:
    """Merge ``yaml_files`` (in order) then ``overrides`` (``a.b=value``) onto the schema defaults.

    Returns a plain dataclass instance (``OmegaConf.to_object``), so code downstream sees typed
    attributes, not a DictConfig.
    """
    cfg = OmegaConf.structured(schema)
    for path in yaml_files:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.load(path))
        except OmegaConfBaseException as exc:
            raise _explain(exc, str(path)) from None
    overrides = list(overrides)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise _explain(exc, "override") from None


def to_yaml(cfg) -> str:
    """The config as YAML text (round-trips through :func:`load_config`)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
