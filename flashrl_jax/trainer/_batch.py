"""Trajectories -> fixed-shape packed micro-batches, on the host, before anything touches a device.

Why: RL responses vary wildly in length. Padding every sequence to the longest wastes most of the
compute on padding, and a shape per batch recompiles per step. Instead trajectories (prompt +
response) are packed into rows of a fixed token budget (segment ids keep them from attending to each
other, positions restart per segment), rows are grouped into micro-batches of a fixed number of rows,
and the number of micro-batches is rounded up to the next count of a short ladder (powers of two
and their halfway points: 1, 2, 3, 4, 6, 8, 12, ...): a handful of shapes ever compile, and a step
pays for at most a third more micro-batches than it fills (a power of two alone wastes up to half).

The loss does not see rows. Each row also carries `S` sequence slots `[S, L]` (L = max response
length) holding, for every response token, the column of the row whose hidden state predicts it. The
trainer gathers hidden states row by row into that view (a row-local gather: rows are split over
devices, so no device ever needs another's activations), so losses, sequence-level aggregations,
GSPO's sequence ratio and advantages work exactly as on an unpacked `[B, T]` batch.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import numpy as np

from flashrl_jax._ladder import halfway_ladder
from flashrl_jax.trainer._config import BatchConfig


@dataclasses.dataclass(frozen=True)
class Trajectory:
  """One sampled response, as the rollout side reports it.

  Attributes:
    sample_id: unique id of this sample (for bookkeeping only).
    prompt_ids: `[P]` int prompt tokens (P >= 1); never trained on.
    response_ids: `[R]` int sampled tokens (everything the model generated, EOS included).
    behavior_logp: `[R]` float log-probs the rollout engine reported for `response_ids` (at the
      rollout temperature). Off-policy corrections are taken against these.
    reward: the scalar reward of the whole response.
    group_id: samples sharing a group id answered the same prompt (GRPO/RLOO baselines).
    behavior_version: `[R]` int policy version that generated each response token (a response can
      span a weight update); a scalar broadcasts.
    start_version: policy version when generation started.
    response_mask: optional `[R]` bool, False for tokens not trained on (e.g. tool outputs).
  """

  sample_id: int
  prompt_ids: np.ndarray
  response_ids: np.ndarray
  behavior_logp: np.ndarray
  reward: float
  group_id: int
  behavior_version: np.ndarray | int = 0
  start_version: int = 0
  response_mask: np.ndarray | None = None

  @property
  def num_tokens(self) -> int:
    return len(self.prompt_ids) + len(self.response_ids)


@flax.struct.dataclass
class Batch:
  """One RL step's data. Leading axes `[K, M]`: K minibatches of M micro-batches of R rows.

  Packed rows `[K, M, R, T]`: `input_ids`, `positions`, `segment_ids` (0 = padding), `targets` (the
  next token in the same segment, else 0). Sequence slots `[K, M, R, S, L]`: `token_index` (the
  column of row r whose hidden state predicts response token j), `loss_mask`, `behavior_logp`,
  `behavior_version`. Per slot `[K, M, R, S]`: `rewards`, `group_ids` (padding slots get unique
  negative ids, so their advantage is 0), `sample_mask`, `start_version`.
  """

  input_ids: jax.Array
  positions: jax.Array
  segment_ids: jax.Array
  targets: jax.Array
  token_index: jax.Array
  loss_mask: jax.Array
  behavior_logp: jax.Array
  behavior_version: jax.Array
  rewards: jax.Array
  group_ids: jax.Array
  sample_mask: jax.Array
  start_version: jax.Array

  @property
  def num_minibatches(self) -> int:
    return self.input_ids.shape[0]

  @property
  def micro_batches(self) -> int:
    return self.input_ids.shape[1]


# Logical axis names of each field, for the batch's shardings (rows and sequences split over batch).
BATCH_AXES = Batch(
    input_ids=(None, None, "batch", "length"), positions=(None, None, "batch", "length"),
    segment_ids=(None, None, "batch", "length"), targets=(None, None, "batch", "length"),
    token_index=(None, None, "batch", None, None), loss_mask=(None, None, "batch", None, None),
    behavior_logp=(None, None, "batch", None, None),
    behavior_version=(None, None, "batch", None, None), rewards=(None, None, "batch", None),
    group_ids=(None, None, "batch", None), sample_mask=(None, None, "batch", None),
    start_version=(None, None, "batch", None))


def _check(t: Trajectory, config: BatchConfig) -> None:
  p, r = len(t.prompt_ids), len(t.response_ids)
  if p < 1:
    raise ValueError(f"Trajectory {t.sample_id}: empty prompt (the first response token needs one).")
  if np.shape(t.behavior_logp) != (r,):
    raise ValueError(f"Trajectory {t.sample_id}: behavior_logp has shape "
                     f"{np.shape(t.behavior_logp)}, expected ({r},) like response_ids.")
  if np.ndim(t.behavior_version) and np.shape(t.behavior_version) != (r,):
    raise ValueError(f"Trajectory {t.sample_id}: behavior_version has shape "
                     f"{np.shape(t.behavior_version)}, expected () or ({r},).")
  if t.response_mask is not None and np.shape(t.response_mask) != (r,):
    raise ValueError(f"Trajectory {t.sample_id}: response_mask has shape "
                     f"{np.shape(t.response_mask)}, expected ({r},).")
  if t.group_id < 0:
    raise ValueError(f"Trajectory {t.sample_id}: group_id must be >= 0, got {t.group_id}.")
  if r > config.max_response_length:
    raise ValueError(f"Trajectory {t.sample_id}: {r} response tokens > max_response_length="
                     f"{config.max_response_length}.")
  if p + r > config.row_length:
    raise ValueError(f"Trajectory {t.sample_id}: {p + r} tokens do not fit in row_length="
                     f"{config.row_length}.")


def _assign(lengths: list[int], config: BatchConfig, one_per_row: bool
            ) -> list[list[tuple[int, int, int, int]]]:
  """First-fit decreasing: per micro-batch, a list of (trajectory, row, slot, column offset)."""
  per_row = 1 if one_per_row else config.sequences_per_row
  micro: list[tuple[list[int], list[int], list]] = []  # (row fill, row slots used, placements)
  for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
    n = lengths[i]
    for fill, slots, placed in micro:
      row = next((k for k in range(config.rows)
                  if slots[k] < per_row and fill[k] + n <= config.row_length), None)
      if row is not None:
        break
    else:
      fill, slots, placed = [0] * config.rows, [0] * config.rows, []
      micro.append((fill, slots, placed))
      row = 0
    placed.append((i, row, slots[row], fill[row]))
    fill[row] += n
    slots[row] += 1
  return [placed for _, _, placed in micro]


def pack(trajectories: list[Trajectory], config: BatchConfig, num_minibatches: int = 1, *,
         one_per_row: bool = False, min_micro_batches: int = 1) -> Batch:
  """Packs trajectories into a host (NumPy) `Batch` of `num_minibatches` minibatches.

  Trajectories are split into contiguous, nearly equal minibatches in the given order; each is
  packed first-fit-decreasing. The micro-batch count M is the largest any minibatch needs (at least
  `min_micro_batches`), rounded up to `micro_batch_ladder`. `one_per_row` disables packing (tests,
  baselines).
  """
  if len(trajectories) < num_minibatches:
    raise ValueError(f"{len(trajectories)} trajectories cannot fill {num_minibatches} minibatches.")
  for t in trajectories:
    _check(t, config)
  splits = np.array_split(np.arange(len(trajectories)), num_minibatches)
  plans = [[[(int(split[i]), row, slot, off) for i, row, slot, off in placed]
            for placed in _assign([trajectories[j].num_tokens for j in split], config, one_per_row)]
           for split in splits]
  needed = max(max(len(p) for p in plans), min_micro_batches)
  return _fill(trajectories, plans, config, micro_batch_ladder(needed)[-1])


def micro_batch_ladder(needed: int) -> list[int]:
  """The micro-batch counts a step may compile for, ascending, up to the first one >= `needed`:
  `halfway_ladder`'s powers of two and the halfway points between them (1, 2, 3, 4, 6, 8, 12, ...;
  the rollout engine's decode batches climb the same one).

  Why not every count: each is one compilation (seconds on a CPU, all done before step 1). Why not
  powers of two only: a step of 2.1 micro-batches' worth of tokens would compute 4, and the train
  step's time is what async RL overlaps with rollout.
  """
  if needed < 1:
    raise ValueError(f"needed must be >= 1, got {needed}.")
  counts = []
  for count in halfway_ladder():
    counts.append(count)
    if count >= needed:
      return counts


def _fill(trajectories, plans, config: BatchConfig, m: int) -> Batch:
  k, rows, t = len(plans), config.rows, config.row_length
  s, length = config.sequences_per_row, config.max_response_length
  z = lambda *shape, dtype=np.int32: np.zeros((k, m, rows) + shape, dtype)
  b = dict(input_ids=z(t), positions=z(t), segment_ids=z(t), targets=z(t),
           token_index=z(s, length), loss_mask=z(s, length, dtype=bool),
           behavior_logp=z(s, length, dtype=np.float32), behavior_version=z(s, length),
           rewards=z(s, dtype=np.float32), group_ids=z(s), sample_mask=z(s, dtype=bool),
           start_version=z(s))
  # Unique negative ids: a padding slot is a group of one, whose advantage every estimator zeroes.
  b["group_ids"][:] = -1 - np.arange(b["group_ids"].size).reshape(b["group_ids"].shape)
  for ki, plan in enumerate(plans):
    for mi, placed in enumerate(plan):
      for i, row, slot, off in placed:
        tr = trajectories[i]
        p, r = len(tr.prompt_ids), len(tr.response_ids)
        ids = np.concatenate([tr.prompt_ids, tr.response_ids]).astype(np.int32)
        at = (ki, mi, row)
        b["input_ids"][at][off:off + p + r] = ids
        b["positions"][at][off:off + p + r] = np.arange(p + r)
        b["segment_ids"][at][off:off + p + r] = slot + 1
        b["targets"][at][off:off + p + r - 1] = ids[1:]
        # Response token j sits at column off + p + j; the hidden state before it predicts it.
        b["token_index"][at][slot, :r] = off + p - 1 + np.arange(r)
        mask = np.ones(r, bool) if tr.response_mask is None else np.asarray(tr.response_mask, bool)
        b["loss_mask"][at][slot, :r] = mask
        b["behavior_logp"][at][slot, :r] = tr.behavior_logp
        b["behavior_version"][at][slot, :r] = tr.behavior_version
        b["rewards"][at][slot] = tr.reward
        b["group_ids"][at][slot] = tr.group_id
        b["sample_mask"][at][slot] = True
        b["start_version"][at][slot] = tr.start_version
  return Batch(**b)


def batch_stats(batch: Batch) -> dict[str, float]:
  """Host-side counts of a packed batch: real tokens, response tokens, padding fraction."""
  seg = np.asarray(batch.segment_ids)
  real = int((seg != 0).sum())
  return {"tokens": real, "response_tokens": int(np.asarray(batch.loss_mask).sum()),
          "samples": int(np.asarray(batch.sample_mask).sum()),
          "padding_fraction": 1.0 - real / seg.size}


def random_trajectories(rng: np.random.Generator, n: int, *, vocab_size: int,
                        prompt_lengths: tuple[int, int], response_lengths: tuple[int, int],
                        group_size: int = 4, version: int = 0) -> list[Trajectory]:
  """Random trajectories with GRPO groups (tests, demos, benchmarks)."""
  out = []
  for i in range(n):
    p = int(rng.integers(*prompt_lengths, endpoint=True))
    r = int(rng.integers(*response_lengths, endpoint=True))
    out.append(Trajectory(
        sample_id=i, prompt_ids=rng.integers(3, vocab_size, p), response_ids=rng.integers(
            3, vocab_size, r), behavior_logp=-rng.uniform(0.5, 5.0, r).astype(np.float32),
        reward=float(rng.integers(0, 2)), group_id=i // group_size, behavior_version=version,
        start_version=version))
  return out
