"""The shared scheduling policy: the admission room, the length law (fits, clipped means, the
synthetic tasks' draws unchanged), the pause modes' costs, and that it imports without JAX."""

import hashlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from flashrl_jax import envs
from flashrl_jax.scheduling import (LengthDistribution, LengthLaw, PauseMode, StalenessBound,
                                    fit_lengths)


@settings(max_examples=200, deadline=None)
@given(alpha=st.integers(0, 5), batch=st.integers(1, 6), outstanding=st.integers(0, 40),
       next_consume=st.integers(0, 6), lag=st.integers(0, 3))
def test_dispatch_room_counts_what_may_dispatch_admits_one_by_one(alpha, batch, outstanding,
                                                                  next_consume, lag):
  # The simulator issues `dispatch_room` prompts at once; the controller asks `may_dispatch` per
  # prompt. Both must admit exactly the same number.
  bound = StalenessBound(alpha, batch)
  published = max(next_consume - lag, 0)
  admitted, o = 0, outstanding
  while bound.may_dispatch(o, next_consume, published):
    admitted, o = admitted + 1, o + 1
  assert bound.dispatch_room(outstanding, next_consume, published) == admitted


def test_synthetic_tasks_draw_the_same_problems_as_before_the_move():
  # Warm-start caches are keyed by these problems (experiments/warmstart.py `task_key`): the law's
  # move into `scheduling` must not change a single draw. Hashes recorded from the pre-move code.
  from experiments.configs.bench_rlvr import bench_task
  from experiments.configs.repeat import repeat_task
  pareto = envs.SyntheticConfig(task=envs.SyntheticTask.COUNT, lengths=LengthDistribution(
      law=LengthLaw.PARETO, median=6, alpha=1.3, max_len=64))
  expected = ["03c302cdf3546c3398817e2a5d20d5a601a1ae5e3e8f6bf58a636e05168c8e92",
              "8227033470431a2c0048f04f96a8783dd063f675229e751c64607240a36d0aca",
              "f636f7b1a408d96d1644c042faca991a3dbfabf5474b27186ae1ede7ce4f54dc"]
  for task, digest in zip((bench_task(), repeat_task(), pareto), expected):
    problems = envs.generate_synthetic(task, num=256, seed=0)
    text = "\n".join(f"{p.prompt}|{p.answer}" for p in problems)
    assert hashlib.sha256(text.encode()).hexdigest() == digest


def test_fit_lengths_recovers_lognormal_and_pareto_and_correlation():
  rng = np.random.default_rng(0)
  truth = LengthDistribution(median=np.exp(6.0), sigma=0.8, max_len=10**7, prompt_corr=0.5)
  lengths = truth.sample_groups(rng, truth.prompt_factors(rng, 2000), 8)
  fit = fit_lengths(lengths, max_len=10**7)
  assert np.log(fit.median) == pytest.approx(6.0, abs=0.05)
  assert fit.sigma == pytest.approx(0.8, rel=0.05)
  assert fit.prompt_corr == pytest.approx(0.5, abs=0.06)
  pareto = LengthDistribution(LengthLaw.PARETO, median=100.0 * 2 ** (1 / 2.5), alpha=2.5,
                              max_len=10**9)
  assert pareto.pareto_scale == pytest.approx(100.0)
  fit = fit_lengths(pareto.sample(rng, 20000), LengthLaw.PARETO)
  assert fit.alpha == pytest.approx(2.5, rel=0.06)
  with pytest.raises(ValueError, match="at least two"):
    fit_lengths([0, 5])


@pytest.mark.parametrize("law, median, shape", [("lognormal", None, 1.0), ("pareto", 700.0, 1.5),
                                                ("constant", 300.0, 0.0)])
def test_clipped_mean_matches_draws_of_both_samplers(law, median, shape):
  if law == "lognormal":
    model = LengthDistribution.with_mean(8192, sigma=shape, max_len=32768)
    assert model.mean() == pytest.approx(8192, rel=1e-6)
  else:
    model = LengthDistribution(law, median=median, alpha=shape or 1.0, max_len=32768)
  rng = np.random.default_rng(1)
  for draws in (model.sample(rng, 50000), model.sample_groups(rng, model.prompt_factors(rng, 50000), 1)):
    assert draws.max() <= 32768 and draws.min() >= 1
    assert draws.mean() == pytest.approx(model.mean(), rel=0.02)


def test_bad_length_laws_fail_when_built():
  for bad in (dict(median=0), dict(sigma=-1), dict(min_len=5, max_len=4), dict(prompt_corr=1.0),
              dict(law="zipf")):
    with pytest.raises(ValueError):
      LengthDistribution(**bad)


def test_pause_modes_say_which_ones_recompute_in_flight_requests():
  assert [m.reprefills_in_flight for m in PauseMode] == [True, True, False]
  assert PauseMode("in_place") is PauseMode.IN_PLACE  # the wire value of /pause_generation


def test_scheduling_imports_without_jax():
  probe = ("import sys\nsys.modules['jax'] = None\nimport flashrl_jax.scheduling\n"
           "print(sorted(m for m, v in sys.modules.items() if v is not None and m.split('.')[0] in ('jax', 'flax', 'scipy')))")
  out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                       check=True)
  assert out.stdout.strip() == "[]"
