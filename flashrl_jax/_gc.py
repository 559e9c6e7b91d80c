"""Keeping the garbage collector's full collections out of a run's steps.

A process that has imported JAX and built its programs holds a few million Python objects, and
CPython's oldest-generation collection walks all of them: measured in a long-tail benchmark run
(experiments.benchmarks.async_vs_sync, 2-core CPU), 100-300 ms pauses in a rollout server during
the run and train-step spikes of 0.1-0.24 s (against 0.03-0.05 s) every ten-odd steps. Nothing
built before serving ever becomes garbage, so it is moved out of the collector's view once, when
start-up is done (`gc.freeze`, which the Python docs suggest for this); objects made later are
still collected as usual.
"""

import gc


def freeze_startup_objects() -> None:
  """Collects what start-up left behind, then exempts every surviving object from later
  collections (call once, after warm-up and before the first request or step)."""
  gc.collect()
  gc.freeze()
