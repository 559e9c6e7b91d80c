"""The device mesh (`data`, `fsdp`, `tensor`), parsed from a flag such as `data:1,fsdp:4,tensor:2`.

Why: the same trainer runs on 1 CPU device, 8 fake CPU devices, a GPU or a multi-host TPU slice only
by changing this one string. Bad strings fail here, with a message that says what to type, instead
of as a reshape error deep inside `jax.make_mesh`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh

AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the three mesh axes; their product must equal the number of devices used.

  `data` replicates the model and splits the batch, `fsdp` splits both the batch and the parameters
  (ZeRO-3 style), `tensor` splits heads / MLP / vocabulary inside each layer (Megatron style).
  """

  data: int = 1
  fsdp: int = 1
  tensor: int = 1

  def __post_init__(self):
    for axis in AXES:
      size = getattr(self, axis)
      if not isinstance(size, int) or size < 1:
        raise ValueError(f"Mesh axis {axis!r} must be a positive integer, got {size!r}.")

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(getattr(self, axis) for axis in AXES)

  @property
  def num_devices(self) -> int:
    return math.prod(self.shape)

  @classmethod
  def parse(cls, spec: str) -> "MeshConfig":
    """Parses `"data:1,fsdp:4,tensor:2"`; omitted axes are 1, `""` is a single device."""
    sizes: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
      name, sep, value = item.partition(":")
      name = name.strip()
      if not sep:
        raise ValueError(f"Bad mesh spec {spec!r}: {item!r} is not 'axis:size' "
                         f"(example: 'data:1,fsdp:4,tensor:2').")
      if name not in AXES:
        raise ValueError(f"Bad mesh spec {spec!r}: unknown axis {name!r}; axes are {', '.join(AXES)}.")
      if name in sizes:
        raise ValueError(f"Bad mesh spec {spec!r}: axis {name!r} given twice.")
      try:
        sizes[name] = int(value)
      except ValueError:
        raise ValueError(f"Bad mesh spec {spec!r}: size of {name!r} must be an integer, "
                         f"got {value.strip()!r}.") from None
    return cls(**sizes)

  def __str__(self) -> str:
    return ",".join(f"{axis}:{getattr(self, axis)}" for axis in AXES)


def make_mesh(config: MeshConfig | str, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over `devices` (default: every device of every process) with auto axis types."""
  if isinstance(config, str):
    config = MeshConfig.parse(config)
  devices = list(jax.devices() if devices is None else devices)
  if config.num_devices != len(devices):
    raise ValueError(f"Mesh {config} needs {config.num_devices} devices "
                     f"({' x '.join(map(str, config.shape))}) but {len(devices)} are available; "
                     f"the axis sizes must multiply to the device count.")
  # Auto axes: shardings propagate from the jit in/out shardings and the rules' constraints, the
  # way every parameter and activation in the model is annotated.
  return jax.make_mesh(config.shape, AXES, axis_types=(AxisType.Auto,) * len(AXES),
                       devices=devices)
