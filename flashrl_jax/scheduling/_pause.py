"""`PauseMode`: what requests in flight do while the rollout servers load new weights.

Why here: the mode is both a protocol value (SGLang's `/pause_generation` `mode`, sent by the fleet
and honoured by our engine) and a cost the scheduler pays (the simulator charges a re-prefill for
the modes that drop the KV cache). One enum, with the cost semantics stated once.
"""

from __future__ import annotations

import enum


class PauseMode(enum.Enum):
  ABORT = "abort"        # in-flight requests return partial output (finish reason abort)
  RETRACT = "retract"    # requests go back to the server's queue and are recomputed on continue
  IN_PLACE = "in_place"  # requests keep their KV state and resume on continue

  @property
  def reprefills_in_flight(self) -> bool:
    """Whether each in-flight request pays a prefill of its prompt + partial output on resume.

    ABORT: the client re-submits prompt + partial output as a continuation; RETRACT: the server
    recomputes it; IN_PLACE keeps the KV cache (the tokens after the update come from the new
    weights over a cache written by the old ones: per-token versions record it).
    """
    return self is not PauseMode.IN_PLACE
