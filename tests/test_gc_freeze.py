"""`freeze_startup_objects`: what start-up built leaves the collector's oldest generation (whose full
collections walked it for 100-300 ms mid-run), while garbage made later is still collected."""

import gc
import weakref

from flashrl_jax._gc import freeze_startup_objects


class _Node:
  pass


def test_startup_objects_leave_the_oldest_generation_and_later_cycles_are_still_collected():
  startup = [{"i": i} for i in range(20000)]  # long-lived objects of a process's start-up
  gc.collect()
  assert len(gc.get_objects(generation=2)) > 20000
  try:
    freeze_startup_objects()
    assert gc.get_freeze_count() > 20000
    assert len(gc.get_objects(generation=2)) < 1000
    cycle = _Node()
    cycle.self = cycle  # only the cycle collector can free it
    alive = weakref.ref(cycle)
    del cycle
    gc.collect()
    assert alive() is None
  finally:
    gc.unfreeze()
  del startup
