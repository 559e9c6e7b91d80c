"""The calibration's fits: pure functions from measured numbers to the simulator's parameters.

Kept apart from the microbenchmarks (`experiments/_calibration.py`) so each rule is tested on
hand-set numbers (tests/test_sim_vs_measured.py) without a server or a trainer.
"""

from __future__ import annotations

import statistics

import numpy as np


def stream_request_s(server_s: float, before: list[dict[str, float]],
                     after: list[dict[str, float]], active: list[int], step_s: list[float],
                     requests: int) -> float:
  """Server seconds per request of a stream whose servers were on a CPU `server_s` seconds (all
  their threads, summed), beyond its decode steps priced by the static table (`active`, `step_s`)
  at each server's mean live requests over the window (`before`/`after`: the servers'
  `decode_steps`, `busy_slot_steps` counters). CPU time, not wall time: a server waiting for the
  next request (the lanes' round trips, the client's scoring) costs a run nothing."""
  if requests < 1:
    raise ValueError("a stream window without a finished request prices nothing")
  decoding = 0.0
  for b, a in zip(before, after, strict=True):
    steps = a["decode_steps"] - b["decode_steps"]
    if steps:
      live = (a["busy_slot_steps"] - b["busy_slot_steps"]) / steps
      decoding += steps * float(np.interp(live, active, step_s))
  return max(server_s - decoding, 0.0) / requests


def stream_point(server_s: float, before: list[dict[str, float]],
                 after: list[dict[str, float]], servers_per_worker: int = 1
                 ) -> tuple[float, float]:
  """(live requests per worker step, server CPU seconds per worker step) of a stream window whose
  servers were on a CPU `server_s` seconds (all their threads, summed): everything the servers
  did, spread over the token steps they made. A worker whose core holds k servers advances its
  requests by one token when each of them has made a step, so its step holds k servers' steps.
  CPU time, not wall time: a server waiting for the next request costs a run nothing."""
  steps = sum(a["decode_steps"] - b["decode_steps"] for b, a in zip(before, after, strict=True))
  busy = sum(a["busy_slot_steps"] - b["busy_slot_steps"]
             for b, a in zip(before, after, strict=True))
  if steps <= 0:
    raise ValueError("a stream window without a decode step prices nothing")
  return servers_per_worker * busy / steps, servers_per_worker * server_s / steps


def paired_factor(beside: list[float], alone: list[float]) -> float:
  """How much slower the same steps ran beside the other side: the median of the per-step ratios
  (step i of both lists trained the same batch), at least 1."""
  if len(beside) != len(alone) or not alone:
    raise ValueError(f"need the same steps both ways, got {len(beside)} and {len(alone)}")
  return max(median([b / a for b, a in zip(beside, alone, strict=True)]), 1.0)


def median(values) -> float:
  return float(statistics.median(values))


def nondecreasing(values: list[float], floor: float = 1e-6) -> list[float]:
  """Least-squares non-decreasing fit (pool adjacent violators): a decode step never gets cheaper
  with more live requests, so a dip is timing noise of the shared machine, averaged away here."""
  blocks: list[list[float]] = []  # [mean, weight]
  for v in values:
    blocks.append([v, 1.0])
    while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
      (m1, w1), (m2, w2) = blocks[-2], blocks.pop()
      blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2]
  return [max(m, floor) for m, w in blocks for _ in range(int(w))]


def fit_train(tokens, seconds) -> tuple[tuple[int, int], list[float]]:
  """Train-step seconds at the fewest and most tokens measured: a Theil-Sen line (the median of
  the pairwise slopes, kept >= 0, through the median residual), without the steps that took over
  3x the median (a compilation or a descheduled thread: a 3-5 s step among 0.05 s ones, seen),
  which a run's step pays once if at all. Medians, not least squares: two of twelve steps slowed
  1.7x and 2.9x by the shared machine tilted a least-squares line to 0.032-0.073 s where the
  other ten lay on 0.026-0.059 s (a calibration of 2026-11-26)."""
  t, s = np.asarray(tokens, float), np.asarray(seconds, float)
  typical = s <= 3 * np.median(s)
  t, s = t[typical], s[typical]
  i, j = np.triu_indices(len(t), k=1)
  apart = t[j] != t[i]
  slope = (max(float(np.median((s[j] - s[i])[apart] / (t[j] - t[i])[apart])), 0.0)
           if apart.any() else 0.0)
  intercept = float(np.median(s - slope * t))
  lo, hi = int(t.min()), max(int(t.max()), int(t.min()) + 1)
  return (lo, hi), [max(intercept + slope * x, 0.0) for x in (lo, hi)]


def blended(before: dict, after: dict, weight: float) -> dict:
  """Two calibrations of one layout, taken before and after a regime's runs, as a run `weight` of
  the way between them sees the machine (0: before, 1: after): each measured number moves
  linearly from one to the other (dicts key by key, lists of equal length entry by entry); a number
  measured the same both times, a string, and anything the two do not both hold keep `before`'s.
  The length groups are both samples of the one initial policy: they are pooled, not blended.

  Why: a pass on this shared machine takes half an hour and the machine's speed drifts within it
  (docs/simulator.md); the calibrations on either side of the runs bracket that drift, as a
  measurement bracketed by two standards."""
  if not 0.0 <= weight <= 1.0:
    raise ValueError(f"weight must be in [0, 1], got {weight}")
  out = _blend(before, after, weight)
  ro_before, ro_after = before.get("rollout", {}), after.get("rollout", {})
  if "length_groups" in ro_before and "length_groups" in ro_after:
    out["rollout"]["length_groups"] = ro_before["length_groups"] + ro_after["length_groups"]
  return out


def _blend(before, after, weight: float):
  if isinstance(before, bool) or isinstance(after, bool):
    return before
  if isinstance(before, (int, float)) and isinstance(after, (int, float)):
    return before if before == after else before + weight * (after - before)
  if isinstance(before, dict) and isinstance(after, dict):
    return {k: _blend(v, after[k], weight) if k in after else v for k, v in before.items()}
  if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
    return [_blend(b, a, weight) for b, a in zip(before, after)]
  return before


def bracket_weight(start: float, end: float, before: float, after: float) -> float:
  """Where a run from `start` to `end` sits between calibrations centred at `before` and `after`
  (all wall-clock seconds): its midpoint's fraction of the way, clipped to [0, 1]."""
  if after <= before:
    raise ValueError("the second calibration must come after the first")
  return float(np.clip(((start + end) / 2 - before) / (after - before), 0.0, 1.0))
