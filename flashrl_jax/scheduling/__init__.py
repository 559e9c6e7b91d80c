"""flashrl_jax.scheduling: the scheduling policy, one copy, for the controller and the simulator.

Why: the simulator is only worth something if it runs the rules the controller runs. These rules
live here, pure and JAX-free, and both `flashrl_jax.controller` (the real RL loop) and
`flashrl_jax.sim` (the discrete-event model of a cluster) import them, so neither can drift:

- `StalenessBound`: the async ratio α — which groups may be dispatched (admission) and which may be
  trained on (consumption); `SampleBuffer` applies the consumption rule to a FIFO of complete groups.
- `PauseMode`: what in-flight requests do across a weight update (the wire value of SGLang's
  `/pause_generation`, and what each mode costs the rollout).
- `LengthDistribution`: the long-tail law of response lengths (the synthetic tasks' required answer
  lengths, and the simulator's workload), with `fit_lengths` to recover one from measured lengths;
  `EmpiricalLengths` resamples measured groups of lengths as they are.
"""

from flashrl_jax.scheduling._lengths import (EmpiricalLengths, LengthDistribution, LengthLaw,
                                             fit_lengths)
from flashrl_jax.scheduling._pause import PauseMode
from flashrl_jax.scheduling._staleness import Buffered, SampleBuffer, StalenessBound, TakeResult

__all__ = [
    "Buffered", "EmpiricalLengths", "LengthDistribution", "LengthLaw", "PauseMode", "SampleBuffer", "StalenessBound",
    "TakeResult", "fit_lengths",
]
