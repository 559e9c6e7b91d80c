"""Strings become enums at the config edge, with an error that names the field and the choices."""

from __future__ import annotations

import enum
from typing import TypeVar

E = TypeVar("E", bound=enum.Enum)


def parse_enum(cls: type[E], value, field: str) -> E:
  """`cls(value)` (an enum member passes through), or a ValueError naming `field` and the choices."""
  try:
    return cls(value)
  except ValueError:
    choices = ", ".join(repr(member.value) for member in cls)
    raise ValueError(f"{field}={value!r} is not one of {choices}.") from None
