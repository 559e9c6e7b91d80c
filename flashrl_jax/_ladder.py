"""The ladder of compiled sizes shared by the trainer's micro-batch counts and the rollout engine's
decode batches: powers of two and the halfway points between them (1, 2, 3, 4, 6, 8, 12, 16, ...).

Why one ladder: each size is one compiled program (seconds on a CPU, all built before the first
step), and padding a size up to the next power of two alone wastes up to half of the computed
rows; the halfway points bound that waste at a third for one extra program per octave.
"""

from __future__ import annotations

import itertools
from typing import Iterator


def halfway_ladder() -> Iterator[int]:
  """1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ... without end."""
  yield 1
  for power in (2 ** k for k in itertools.count(1)):
    yield power
    yield power + power // 2
