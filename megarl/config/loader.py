"""Compose a MegarlConfig from YAML files and ``key=value`` overrides, checked against the schema.

Unknown keys, values of the wrong type, values outside a field's declared bounds (see
``schema.bounded``) and values a choice field (``schema.Choice``) does not allow raise :class:`ConfigError` naming the full key; a YAML syntax error names the
file and line.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import typing
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, Type, TypeVar

from megarl.config.schema import Choice, MegarlConfig

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value or key a user must change."""


@functools.lru_cache(maxsize=None)
def _field_types(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _choice_of(schema: type, key: str) -> Optional[Type[Choice]]:
    """The Choice enum of field ``key`` (``a.b.c``) of ``schema``, or None."""
    cls: object = schema
    for part in key.split("."):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return None
        cls = _field_types(cls).get(part)
    if typing.get_origin(cls) in (typing.Union, list):  # Optional[Choice], List[Choice]
        cls = next((a for a in typing.get_args(cls) if a is not type(None)), None)
    return cls if isinstance(cls, type) and issubclass(cls, Choice) else None


def _bad_choice(key: str, value, choice: Type[Choice]) -> str:
    return f"{key}='{value}' must be one of {choice.allowed()}"


# Keys that were replaced: what to type instead.
RENAMED = {
    "logging.mlflow": "logging.backends lists the trackers: logging.mlflow=false is logging.backends=[console]",
    "logging.tensorboard": "logging.backends lists the trackers: logging.tensorboard=true is "
                           "logging.backends=[console,mlflow,tensorboard]",
}


def _explain(exc: OmegaConfBaseException, source: str, schema: type = MegarlConfig) -> ConfigError:
    key = getattr(exc, "full_key", None) or "?"
    if key in RENAMED:
        return ConfigError(f"{source}: config key '{key}' is gone: {RENAMED[key]}")
    choice = _choice_of(schema, key)
    if choice is not None and getattr(exc, "value", None) is not None:  # a value the choice does not allow
        return ConfigError(_bad_choice(key, exc.value, choice))
    msg = getattr(exc, "msg", None) or str(exc)
    first = str(msg).splitlines()[0]
    return ConfigError(f"{source}: config key '{key}': {first}")


def _load_yaml(path: Path):
    import yaml
    from omegaconf import OmegaConf

    try:
        return OmegaConf.load(path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: invalid YAML: {_problem(exc)}") from None


def _problem(exc: yaml.YAMLError) -> str:
    return getattr(exc, "problem", None) or str(exc).splitlines()[0]


_BOUNDS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="), "lt": (operator.lt, "<")}


def validate(cfg) -> None:
    """Check every field's declared bounds (``schema.bounded``) and every choice field's value
    (a config built in code may hold any string) over the tree; one ConfigError lists every field
    out of bounds. NaN and infinity are out of any bounds."""
    problems = list(_out_of_bounds(cfg, ""))
    if problems:
        raise ConfigError("; ".join(problems))


def _out_of_bounds(cfg, prefix: str) -> Iterator[str]:
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _out_of_bounds(value, key + ".")
            continue
        choice = _choice_of(type(cfg), f.name)
        bad = [v for v in (value if isinstance(value, list) else [value]) if v is not None and v not in tuple(choice or ())]
        if choice is not None and bad:
            yield _bad_choice(key, bad[0], choice)
            continue
        bounds = f.metadata.get("bounds")
        if value is None or not bounds:
            continue
        if not math.isfinite(value) or not all(_BOUNDS[op][0](value, limit) for op, limit in bounds.items()):
            wanted = " and ".join(f"{_BOUNDS[op][1]} {limit:g}" for op, limit in bounds.items())
            yield f"{key}={value} must be {wanted}"


def load_config(
    yaml_files: Sequence[str | Path] = (),
    overrides: Iterable[str] = (),
    schema: Type[T] = MegarlConfig,
) -> T:
    """Merge ``yaml_files`` (in order) then ``overrides`` (``a.b=value``) onto the schema defaults.

    Returns a plain dataclass instance (``OmegaConf.to_object``), so code downstream sees typed
    attributes, not a DictConfig.
    """
    # omegaconf and yaml load here, not with the package: every worker process imports the schema
    # and none composes a config (0.5 s of each one's start-up)
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = OmegaConf.structured(schema)
    for path in yaml_files:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            cfg = OmegaConf.merge(cfg, _load_yaml(path))
        except OmegaConfBaseException as exc:
            raise _explain(exc, str(path), schema) from None
    overrides = list(overrides)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
        out = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise _explain(exc, "override", schema) from None
    except yaml.YAMLError:  # an override's value is parsed as YAML too: name the one that fails
        for item in overrides:
            try:
                OmegaConf.from_dotlist([item])
            except yaml.YAMLError as exc:
                raise ConfigError(f"override '{item}': invalid YAML value: {_problem(exc)}") from None
        raise
    validate(out)
    return out


def to_yaml(cfg) -> str:
    """The config as YAML text (round-trips through :func:`load_config`); choices are written as
    the values users type (``token-mean``), not their enum names."""
    from omegaconf import OmegaConf

    plain = dataclasses.asdict(cfg, dict_factory=lambda pairs: {k: v.value if isinstance(v, Choice) else v
                                                                 for k, v in pairs})
    return OmegaConf.to_yaml(OmegaConf.create(plain))
