"""The two predictions sim_vs_measured prints beside its rule since pass AT: the train step's
factor beside rollout from how hard its core was shared (`experiments/_contention_rescaling.py`)
and the regime's pooled machine probes (`experiments/_machine_probe.py`). What is tried, on
hand-set numbers: a run whose trainer met exactly the calibration's alone or beside contention,
one in between, contentions outside the calibrated range (below alone; beyond anything a beside
phase could reach), a calibration without an interference measurement, a fraction of 0 or above 1,
and a pool with one probe far from the others. Since 2026-11-29 also the trainer's contention
factor floored at 1, printed beside the rule through passes AX-AZ and the async rule since (a
trainer that waited less than the reference, one that waited more, the servers' factor either
way; the rule's prediction with it: tests/test_sim_vs_measured.py)."""

import types

import numpy as np
import pytest

from experiments import _machine_probe
from experiments._contention_rescaling import (
    Contention, Overlap, beside_contention, mixed_contention, shared_core_prediction,
    shared_core_train_factor, trainer_floor)


def _calibration(alone: float = 1.2, beside: float = 2.0, factor: float = 2.2) -> dict:
  return {"trainer": {"alone": {"contention": alone}, "beside_rollout": {"contention": beside}},
          "interference": {"train_beside_rollout": factor, "rollout_beside_train": 1.1}}


def test_beside_contention_undoes_the_mix():
  # 30% of the time at 1.2, 70% at 1.8: wall-weighted harmonic mean 1/(0.3/1.2 + 0.7/1.8).
  overall = 1.0 / (0.3 / 1.2 + 0.7 / 1.8)
  assert beside_contention(1.2, overall, 0.7) == pytest.approx(1.8)
  assert mixed_contention(1.2, beside_contention(1.2, 1.5, 0.4), 0.4) == pytest.approx(1.5)
  assert beside_contention(1.2, 1.5, 1.0) == pytest.approx(1.5)  # beside all the time
  # 1.2 for half the time already gives 2.4 overall if the other half took no CPU at all:
  # nothing beside can reach 2.5.
  assert beside_contention(1.2, 2.5, 0.5) == float("inf")
  for bad in (0.0, 1.5):
    with pytest.raises(ValueError, match="beside_fraction"):
      beside_contention(1.2, 1.5, bad)


def test_the_factor_runs_from_no_sharing_to_the_calibrated_sharing():
  cal = _calibration(alone=1.2, beside=2.0, factor=2.2)
  # The run's trainer met the calibration's alone contention: its core was not shared.
  assert shared_core_train_factor(cal, 1.2, 0.8) == pytest.approx(1.0)
  # Beside rollout all the time at the calibration's beside contention: the calibrated factor.
  assert shared_core_train_factor(cal, 2.0, 1.0) == pytest.approx(2.2)
  # 80% beside at 1.6, halfway from 1.2 to 2.0: halfway from 1 to 2.2.
  overall = mixed_contention(1.2, 1.6, 0.8)
  assert shared_core_train_factor(cal, overall, 0.8) == pytest.approx(1.6)
  # Outside the calibrated range: a lighter background is no speed-up below 1, and the client's
  # loop cannot share the core more than the calibration's, which never waits.
  assert shared_core_train_factor(cal, 1.0, 0.8) == pytest.approx(1.0)
  assert shared_core_train_factor(cal, 2.3, 0.9) == pytest.approx(2.2)
  assert shared_core_train_factor(cal, 9.0, 0.5) == pytest.approx(2.2)  # unreachable: the most


def test_without_a_measured_sharing_the_calibrated_factor_stands():
  unshared = _calibration()
  del unshared["trainer"]["beside_rollout"]
  assert shared_core_train_factor(unshared, 1.5, 0.8) == 2.2
  assert shared_core_train_factor(_calibration(beside=1.1), 1.5, 0.8) == 2.2  # noise: no sharing
  assert shared_core_train_factor(_calibration(), 1.5, 0.0) == 2.2  # never beside: not used


def test_the_shared_core_prediction_settles_the_overlap_it_assumes():
  # A stand-in simulator whose train step spends more of its time beside rollout the slower it
  # is beside rollout: the prediction must iterate until the factor and the overlap agree.
  cal = _calibration(alone=1.2, beside=2.0, factor=2.2)
  seen = []

  def predict(interference):
    factor = interference["train_beside_rollout"]
    seen.append((factor, interference["rollout_beside_train"]))
    beside = min(0.5 + 0.2 * factor, 1.0)
    # What Overlap.of reads of a simulated run.
    return [types.SimpleNamespace(train_beside_rollout=beside, rollout_beside_train=0.9)]

  results, factor = shared_core_prediction(cal, 1.5, predict, Overlap(0.5, 0.9))
  assert all(rollout == 1.1 for _, rollout in seen)  # the servers' factor is left alone
  assert len(seen) >= 2
  # The fixed point: the overlap the last prediction showed gives (nearly) the factor it used.
  assert shared_core_train_factor(cal, 1.5, results[0].train_beside_rollout) == \
      pytest.approx(factor, abs=0.02)
  assert 1.0 < factor < 2.2


def test_pooled_probes_are_each_cores_median():
  runs = [{"machine_probe_per_core": {"0": 50e-3, "1": 70e-3}},
          {"machine_probe_per_core": {"0": 75e-3, "1": 72e-3}},
          {"machine_probe_per_core": {"0": 48e-3, "1": 66e-3}},  # caught a fast minute
          {"train_probe_per_core": {"0": 1.0}}]  # no decode probe: not pooled
  pool = _machine_probe.pooled(runs)
  assert pool == {"machine_probe_per_core": {"0": 50e-3, "1": 70e-3}}
  assert _machine_probe.pooled(runs, "train_probe") == {"train_probe_per_core": {"0": 1.0}}
  assert _machine_probe.pooled([{}]) == {}
  # Pooled runs against pooled calibrations: the same speed ratio for every run.
  cals = _machine_probe.pooled([{"machine_probe_per_core": {"0": 60e-3, "1": 70e-3}}])
  assert _machine_probe.speed_ratio(pool, cals, [0]) == pytest.approx(50 / 60)
  assert _machine_probe.speed_ratio(pool, cals, [0, 1]) == pytest.approx(np.mean([50 / 60, 1.0]))


def test_the_trainers_factor_is_floored_at_one_and_the_servers_left_alone():
  # Tried: a trainer that met 0.8 of the reference contention (the rule would speed its costs up
  # x0.8: pass AS-AW's balanced async runs), one that met 1.3, and servers faster or slower.
  assert trainer_floor(Contention(1.2, 0.8)) == Contention(1.2, 1.0)
  assert trainer_floor(Contention(0.7, 0.8)) == Contention(0.7, 1.0)  # the servers' may go below 1
  assert trainer_floor(Contention(0.9, 1.3)) == Contention(0.9, 1.3)
