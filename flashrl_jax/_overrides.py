"""Overrides of a frozen, typed config tree by dotted field paths: the one way anything changes one.

Why one mechanism: command-line flags and experiment sweeps both change fields of the same typed
config; if each maps its own names to fields by hand they drift, and a misspelt field is silently
ignored. Here a change is `{"rollout.num_servers": 4, "train.loss": {"name": "ppo"}}`:

- the path is checked against the dataclass fields at every level (a typo fails, naming the
  fields that exist and the closest one): the config is locked;
- the value is converted to the field's annotated type (strings from a command line become ints,
  floats, bools, enums, tuples; `none` clears an optional field) and validated by the config's own
  `__post_init__`;
- a dict for a config-typed field is a whole new value (`train.loss={"name": "ppo"}` is a fresh
  `LossConfig` with its own defaults, not the old one's); a path into it changes one field.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import json
import types
import typing
from collections.abc import Mapping
from typing import Any

from flashrl_jax._enums import parse_enum


class OverrideError(ValueError):
  """A path that names no field, or a value that cannot be the field's type."""


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _fields(cls: type) -> dict[str, Any]:
  hints = _hints(cls)
  return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _optional(tp) -> tuple[Any, bool]:
  """(the type without `None`, whether `None` is allowed)."""
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1:
      return args[0], len(args) < len(typing.get_args(tp))
  return tp, False


def _config_class(tp) -> type | None:
  tp, _ = _optional(tp)
  return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _unknown(path: str, name: str, cls: type) -> OverrideError:
  names = sorted(_fields(cls))
  close = difflib.get_close_matches(name, names, n=1)
  hint = f" (did you mean {close[0]!r}?)" if close else ""
  path = path.rstrip(".")
  where = f"{path} ({cls.__name__})" if path else cls.__name__
  return OverrideError(f"{where} has no field {name!r}{hint}; fields: {', '.join(names)}.")


def field_type(cls: type, path: str) -> Any:
  """The annotated type of the field at dotted `path` of config class `cls`, without `| None`
  (validates the path)."""
  tp: Any = cls
  done = []
  for name in path.split("."):
    sub = _config_class(tp)
    if sub is None:
      raise OverrideError(f"{'.'.join(done)} is a value, not a config section: no field {name!r}.")
    fields = _fields(sub)
    if name not in fields:
      raise _unknown(".".join(done), name, sub)
    tp = fields[name]
    done.append(name)
  return _optional(tp)[0]


def coerce(value: Any, tp: Any, path: str) -> Any:
  """`value` as the annotated type `tp` (command-line strings parsed; Python values checked)."""
  inner, nullable = _optional(tp)
  if value is None or (nullable and isinstance(value, str) and value.lower() in ("none", "null")):
    if nullable:
      return None
    raise OverrideError(f"{path} cannot be None.")
  config = _config_class(inner)
  if config is not None:
    if isinstance(value, config):
      return value
    if isinstance(value, str) and value.lstrip().startswith("{"):
      value = json.loads(value)
    if not isinstance(value, Mapping):
      raise OverrideError(f"{path} is a config section ({config.__name__}): set its fields "
                          f"({path}.<field>=...) or give a whole one as a dict.")
    return _build(config, value, path)
  if isinstance(inner, type) and issubclass(inner, enum.Enum):
    try:
      return parse_enum(inner, value, path)
    except ValueError as error:
      raise OverrideError(str(error)) from None
  origin = typing.get_origin(inner)
  if origin is tuple:
    args = typing.get_args(inner)
    item = args[0] if args else Any
    if isinstance(value, str):
      value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
      raise OverrideError(f"{path} is a list, got {value!r}.")
    return tuple(coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value))
  if inner is bool:
    if isinstance(value, bool):
      return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
      return value.lower() in ("true", "1", "yes")
    raise OverrideError(f"{path} is true or false, got {value!r}.")
  if inner is int or inner is float:
    kind = "an integer" if inner is int else "a number"
    if isinstance(value, str):
      try:
        return inner(value)
      except ValueError:
        raise OverrideError(f"{path} is {kind}, got {value!r}.") from None
    if isinstance(value, bool) or not isinstance(value, (int, float) if inner is float else int):
      raise OverrideError(f"{path} is {kind}, got {value!r}.")
    return inner(value)
  if inner is str and not isinstance(value, str):
    raise OverrideError(f"{path} is a string, got {value!r}.")
  return value


def _build(cls: type, values: Mapping[str, Any], path: str) -> Any:
  fields = _fields(cls)
  for name in values:
    if name not in fields:
      raise _unknown(path, name, cls)
  kwargs = {name: coerce(v, fields[name], f"{path}.{name}") for name, v in values.items()}
  try:
    return cls(**kwargs)
  except (TypeError, ValueError) as error:
    raise OverrideError(f"{path}: {error}") from None


def apply_overrides(config: Any, overrides: Mapping[str, Any], *, _path: str = "") -> Any:
  """`config` with every `path: value` of `overrides` applied (a new frozen config; validated).

  Within one call a whole section is set before the paths into it, whatever the order given.
  """
  direct: dict[str, Any] = {}
  nested: dict[str, dict[str, Any]] = {}
  cls = type(config)
  fields = _fields(cls)
  for key, value in overrides.items():
    name, _, rest = key.partition(".")
    if name not in fields:
      raise _unknown(_path, name, cls)
    if rest:
      nested.setdefault(name, {})[rest] = value
    else:
      direct[name] = coerce(value, fields[name], _path + name)
  changes = dict(direct)
  for name, sub in nested.items():
    current = changes.get(name, getattr(config, name))
    if current is None:
      raise OverrideError(f"{_path + name} is None in this config, so {_path + name}.{next(iter(sub))} "
                          "cannot be set (set the whole section, or use a config that has it).")
    if not dataclasses.is_dataclass(current):
      raise OverrideError(f"{_path + name} is a value, not a config section.")
    changes[name] = apply_overrides(current, sub, _path=f"{_path}{name}.")
  if not changes:
    return config
  try:
    return dataclasses.replace(config, **changes)
  except (TypeError, ValueError) as error:
    if isinstance(error, OverrideError):
      raise
    raise OverrideError(str(error)) from None


def parse_assignment(text: str) -> tuple[str, str]:
  """`"rollout.num_servers=4"` -> `("rollout.num_servers", "4")`."""
  path, sep, value = text.partition("=")
  if not sep or not path.strip():
    raise OverrideError(f"an override is 'path.to.field=value', got {text!r}.")
  return path.strip(), value
