"""The staleness bound as a property: for any interleaving of dispatches, completions (in random
order) and training steps, every consumed group satisfies t - v <= α, at most (1+α)·B groups are
ever outstanding, α = 0 consumes only fresh samples, and no prompt is lost or trained twice. When
the trainer passes the in-flight groups' start versions (as the controller does), it waits for a
group that would otherwise miss its deadline, and nothing is ever dropped."""

import random

from hypothesis import given, settings, strategies as st

from flashrl_jax import envs
from flashrl_jax.controller import Group, PromptSource, Response
from flashrl_jax.scheduling import SampleBuffer, StalenessBound


def _group(index: int, version: int) -> Group:
  g = Group(prompt_index=index, sample=envs.Sample("p", "a"), prompt_ids=[1], n=1,
            dispatched_version=version)
  return g


def _complete(g: Group, version_at_start: int) -> None:
  g.responses.append(Response(sample_id=str(g.prompt_index), output_ids=[3], behavior_logp=[-1.0],
                              token_versions=[version_at_start], start_version=version_at_start,
                              finish_reason="stop"))


@settings(max_examples=60, deadline=None)
@given(alpha=st.integers(0, 4), batch=st.integers(1, 4), seed=st.integers(0, 10_000),
       steps=st.integers(1, 8), wait_for_due=st.booleans())
def test_staleness_bound_holds_for_random_schedules(alpha, batch, seed, steps, wait_for_due):
  rng = random.Random(seed)
  bound = StalenessBound(alpha, batch)
  buffer = SampleBuffer(bound)
  source = PromptSource(envs.SampleListSource([envs.Sample(f"p{i}", "a") for i in range(10)]))
  published = 0  # version the servers run
  trainer_version = 0
  takes = 0
  in_flight: list[Group] = []
  consumed: list[int] = []
  dropped: list[int] = []
  while takes < steps:
    outstanding = len(in_flight) + len(buffer)
    assert outstanding <= bound.max_outstanding
    # Randomly: dispatch, finish one in-flight group (random order = random server delays), or train.
    can_dispatch = bound.may_dispatch(outstanding, takes, published)
    action = rng.choice(["dispatch", "finish", "finish", "train", "publish"])
    stuck = not can_dispatch and not in_flight and len(buffer) < batch
    if action == "publish" or stuck:  # a lagging weight publish lands
      published = trainer_version
    elif action == "dispatch" and can_dispatch:
      index, _ = source.next()
      in_flight.append(_group(index, published))
    elif action == "finish" and in_flight:
      g = in_flight.pop(rng.randrange(len(in_flight)))
      _complete(g, g.dispatched_version)
      buffer.put(g)
    elif action == "train" or not can_dispatch:
      starts = [g.start_version for g in in_flight] if wait_for_due else ()
      result = buffer.take(batch, trainer_version, starts)
      if result is None:
        continue
      for g in result.stale:
        dropped.append(g.prompt_index)
        source.give_back(g.prompt_index)
      if not result.groups:
        continue
      for g in result.groups:
        assert trainer_version - g.start_version <= alpha
        if alpha == 0:
          assert g.start_version == trainer_version
        consumed.append(g.prompt_index)
      takes += 1
      trainer_version += 1
      if rng.random() < 0.8:  # the publish usually lands before more dispatches
        published = trainer_version
      else:
        published = trainer_version - 1
  assert len(consumed) == len(set(consumed)), "a prompt was trained twice"
  if wait_for_due:
    assert not dropped, "a group went stale although the trainer could have waited for it"
  # Every dropped prompt was handed back for re-issue (never silently skipped).
  assert buffer.dropped_stale == len(dropped)
  assert set(dropped) <= set(source.pending_reissue) | set(consumed) | {
      g.prompt_index for g in in_flight} | {g.prompt_index for g in buffer.drain_view()}


def test_may_dispatch_is_the_cap_when_nothing_is_training():
  bound = StalenessBound(async_ratio=2, batch_size=4)
  assert bound.max_outstanding == 12
  assert bound.may_dispatch(11, next_consume_version=5, published_version=5)
  assert not bound.may_dispatch(12, next_consume_version=5, published_version=5)
  # While version 6 is being trained and published, version-5 generation may run α steps ahead only.
  assert bound.may_dispatch(7, next_consume_version=6, published_version=5)
  assert not bound.may_dispatch(8, next_consume_version=6, published_version=5)


def test_alpha_zero_never_dispatches_while_training():
  bound = StalenessBound(async_ratio=0, batch_size=3)
  assert bound.may_dispatch(0, next_consume_version=1, published_version=1)
  assert not bound.may_dispatch(0, next_consume_version=1, published_version=0)


def test_stale_groups_are_dropped_counted_and_returned():
  bound = StalenessBound(async_ratio=1, batch_size=2)
  buffer = SampleBuffer(bound)
  for i, v in enumerate([0, 3, 3, 1]):
    g = _group(i, v)
    _complete(g, v)
    buffer.put(g)
  result = buffer.take(2, trainer_version=3)
  assert [g.prompt_index for g in result.stale] == [0, 3]
  assert [g.prompt_index for g in result.groups] == [1, 2]
  assert buffer.dropped_stale == 2


def _buffered(bound: StalenessBound, starts: list[int]) -> SampleBuffer:
  buffer = SampleBuffer(bound)
  for i, v in enumerate(starts):
    g = _group(i, v)
    _complete(g, v)
    buffer.put(g)
  return buffer


def test_earliest_deadline_first_and_waiting_for_a_due_group():
  bound = StalenessBound(async_ratio=2, batch_size=2)
  # Completion order 5, 3, 4: the oldest start is consumed first, ties in completion order.
  result = _buffered(bound, [5, 3, 4, 3]).take(2, trainer_version=5)
  assert [g.prompt_index for g in result.groups] == [1, 3]
  # An in-flight group started at 3 is due now (3 + 2 = 5) and the choice holds groups due
  # later: wait for it rather than let it go stale.
  buffer = _buffered(bound, [4, 5])
  assert buffer.take(2, trainer_version=5, in_flight_starts=[3]) is None
  # Due at 6 with 1 take left before then (the one at 6) holding 2: no need to wait.
  assert buffer.take(2, trainer_version=5, in_flight_starts=[4]) is not None
  # Three groups due by 6 in flight: taking two not due until 7 leaves one take (at 6) for three.
  buffer = _buffered(bound, [5, 5])
  assert buffer.take(2, trainer_version=5, in_flight_starts=[4, 4, 4]) is None
  # Waiting cannot help when the choice is already due now: take (the in-flight one goes stale).
  buffer = _buffered(bound, [3, 3])
  result = buffer.take(2, trainer_version=5, in_flight_starts=[3])
  assert [g.prompt_index for g in result.groups] == [0, 1]
  # Already-stale in-flight groups are not waited for.
  assert _buffered(bound, [5, 5]).take(2, trainer_version=5, in_flight_starts=[1]) is not None


def test_incomplete_group_is_refused():
  import pytest
  with pytest.raises(ValueError, match="incomplete"):
    SampleBuffer(StalenessBound(1, 1)).put(Group(0, envs.Sample("p", "a"), [1], n=2))


def test_prompt_source_resume_reissues_in_flight():
  src = PromptSource(envs.SyntheticSource(envs.SyntheticConfig(), seed=3))
  first = [src.next()[0] for _ in range(5)]
  assert first == [0, 1, 2, 3, 4]
  src.give_back(1)
  state = src.state(in_flight=[3, 4])
  again = PromptSource(envs.SyntheticSource(envs.SyntheticConfig(), seed=3))
  again.restore(state)
  assert [again.next()[0] for _ in range(4)] == [1, 3, 4, 5]
  assert again.sample(2) == src.sample(2)
