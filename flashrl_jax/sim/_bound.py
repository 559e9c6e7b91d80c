"""The queue-scheduling generation-time bound (ROLL Flash, Proposition 1), as pure functions.

Why: the bound says *why* queue scheduling and asynchrony help, and it is cheap to check. With K
workers and Q samples whose generation times g_i lie in [0, L] with mean μ, greedy list scheduling
(a worker takes the next sample the moment it is free) finishes by

    makespan ≤ Q·μ/K + (1 − 1/K)·L  ≤  Q·μ/K + L,

because the last sample to finish, j, starts no later than the moment every worker was busy with
other samples: K·s_j ≤ Σ_{i≠j} g_i = Q·μ − g_j, so s_j + g_j ≤ Q·μ/K + (1 − 1/K)·g_j. A batch
barrier that runs waves of K samples pays the *maximum of every wave*, up to ⌈Q/K⌉·L. With async
ratio α the rollout may run (1+α) batches ahead, so the tail is paid once per (1+α) steps and the
per-step bound becomes Q·μ/K + L/(1+α). The derivation is in docs/simulator.md.
"""

from __future__ import annotations

import heapq

import numpy as np


def list_schedule_makespan(durations, workers: int) -> float:
  """Makespan of greedy list scheduling: each sample, in order, goes to the first free worker."""
  if workers < 1:
    raise ValueError(f"workers must be >= 1, got {workers}")
  free = [0.0] * workers
  end = 0.0
  for d in np.asarray(durations, dtype=np.float64).ravel():
    start = heapq.heappop(free)
    heapq.heappush(free, start + d)
    end = max(end, start + d)
  return end


def barrier_makespan(durations, workers: int) -> float:
  """Makespan of batch-level rollout: waves of `workers` samples, each wave waits for its longest."""
  if workers < 1:
    raise ValueError(f"workers must be >= 1, got {workers}")
  d = np.asarray(durations, dtype=np.float64).ravel()
  return float(sum(d[i:i + workers].max() for i in range(0, d.size, workers)))


def queue_bound(durations, workers: int, max_len: float | None = None) -> float:
  """Q·μ/K + L, with L the largest possible generation time (default: the largest duration)."""
  d = np.asarray(durations, dtype=np.float64).ravel()
  tail = float(d.max()) if max_len is None else float(max_len)
  return float(d.sum()) / workers + tail


def amortised_bound(mean: float, samples_per_step: int, workers: int, max_len: float,
                    alpha: int) -> float:
  """Per-step generation-time bound with async ratio α: Q·μ/K + L/(1+α)."""
  if alpha < 0:
    raise ValueError(f"alpha must be >= 0, got {alpha}")
  return samples_per_step * mean / workers + max_len / (1 + alpha)
