"""The simulator's validation plumbing: a calibration becomes the simulated run (checked against a
hand-computed step), the calibration's fits, the layouts it measures, and the paper-scale entry."""

import asyncio
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from experiments import _calibration, _calibration_fits, _cpu_time, _measured_runs
from experiments.benchmarks import sim_vs_measured
from flashrl_jax import sim
from flashrl_jax.scheduling import PauseMode

REPO = pathlib.Path(__file__).resolve().parents[1]


def _calibration_of(length: int, step_s: float, train_s: float) -> dict:
  """A calibration as `_calibration.measure` writes it, with round numbers."""
  return {
      "rollout": {"workers": 2, "slots": 8, "decode_active": [1, 8],
                  "decode_step_s": [step_s, step_s], "request_s": 0.0, "latency_s": 0.02,
                  "reward_s": 0.01, "prompt_tokens": 12.0, "length_groups": [[length] * 4] * 3,
                  "handoff": {"idle": {"pause_s": 0.01, "load_s": 0.05, "resume_s": 0.01},
                              "busy": {"pause_s": 0.02, "load_s": 0.05, "resume_s": 0.01}}},
      "trainer": {"alone": {"train_tokens": [100, 200], "train_s": [train_s, train_s],
                            "export_s": 0.1}},
      "interference": {"train_beside_rollout": 1.0, "rollout_beside_train": 1.0},
  }


def test_sync_prediction_is_the_hand_computed_step():
  # Every response 50 tokens at 4 ms a step: 0.2 s of decode, then latency + reward 0.03 s, the
  # train step 0.5 s, export 0.1 s and the idle handoff 0.07 s; 4 prompts x 4 responses a step.
  cal = _calibration_of(length=50, step_s=0.004, train_s=0.5)
  config = sim_vs_measured.sim_config(cal, "sync", 0, batch_size=4, group_size=4,
                                      pause_mode=PauseMode.ABORT, steps=6, warmup=2)
  assert (config.workers, config.slots, config.prompt_tokens) == (2, 8, 12)
  step = 50 * 0.004 + 0.03 + 0.5 + 0.1 + 0.07
  assert sim.simulate(config, seed=0).samples_per_s == pytest.approx(16 / step, rel=1e-6)
  # The load probes' rescaling: rollout costs (decode, latency, handoff) by one factor, the
  # trainer's (train step, export) by the other.
  slower = sim_vs_measured.sim_config(cal, "sync", 0, batch_size=4, group_size=4,
                                      pause_mode=PauseMode.ABORT, steps=6, warmup=2,
                                      rollout_slowdown=2.0, train_slowdown=3.0)
  step = 2 * (50 * 0.004 + 0.03 + 0.07) + 3 * (0.5 + 0.1)
  assert sim.simulate(slower, seed=0).samples_per_s == pytest.approx(16 / step, rel=1e-6)


def test_bracketing_calibrations_move_each_cost_with_the_machine_and_pool_the_lengths():
  # Tried: the calibration before the runs and the one after, with every cost of the second 1.5x
  # (train 3x) and its policy's responses 10 tokens longer.
  before = _calibration_of(length=50, step_s=0.004, train_s=0.1)
  after = _calibration_of(length=60, step_s=0.006, train_s=0.3)
  after["rollout"]["handoff"]["idle"]["load_s"] = 0.08
  after["rollout"]["note"] = "only in the second"
  mid = _calibration_fits.blended(before, after, 0.25)
  assert mid["rollout"]["decode_step_s"] == pytest.approx([0.0045, 0.0045])
  assert mid["trainer"]["alone"]["train_s"] == pytest.approx([0.15, 0.15])
  assert mid["rollout"]["handoff"]["idle"]["load_s"] == pytest.approx(0.0575)
  assert mid["rollout"]["workers"] == 2 and isinstance(mid["rollout"]["workers"], int)
  assert mid["rollout"]["decode_active"] == [1, 8]
  assert "note" not in mid["rollout"]  # what only one of the two measured is not invented
  # Both samples of the one initial policy: six groups, three of each length, never 52.5 tokens.
  assert sorted(g[0] for g in mid["rollout"]["length_groups"]) == [50] * 3 + [60] * 3
  assert _calibration_fits.blended(before, after, 1.0)["rollout"]["decode_step_s"] == [0.006] * 2
  assert before["rollout"]["decode_step_s"] == [0.004] * 2  # the inputs are left as they were
  with pytest.raises(ValueError, match="weight"):
    _calibration_fits.blended(before, after, 1.5)
  # The blended calibration is the simulated run's: the sync step at the costs halfway.
  same = _calibration_of(length=50, step_s=0.008, train_s=0.7)
  halfway = _calibration_fits.blended(_calibration_of(length=50, step_s=0.004, train_s=0.5),
                                      same, 0.5)
  config = sim_vs_measured.sim_config(halfway, "sync", 0, batch_size=4, group_size=4,
                                      pause_mode=PauseMode.ABORT, steps=6, warmup=2)
  step = 50 * 0.006 + 0.03 + 0.6 + 0.1 + 0.07
  assert sim.simulate(config, seed=0).samples_per_s == pytest.approx(16 / step, rel=1e-6)


def test_a_run_sits_between_its_calibrations_by_its_midpoint():
  weight = _calibration_fits.bracket_weight
  assert weight(140.0, 160.0, before=100.0, after=300.0) == pytest.approx(0.25)
  assert weight(0.0, 50.0, before=100.0, after=300.0) == 0.0  # before the first: the first's
  assert weight(400.0, 500.0, before=100.0, after=300.0) == 1.0
  with pytest.raises(ValueError):
    weight(140.0, 160.0, before=300.0, after=300.0)


def test_async_prediction_uses_the_async_layout_and_the_bound():
  cal = _calibration_of(length=50, step_s=0.004, train_s=0.05)
  config = sim_vs_measured.sim_config(cal, "async", 2, batch_size=4, group_size=4,
                                      pause_mode=PauseMode.IN_PLACE, steps=8, warmup=3)
  assert config.train_gpus == 1 and config.training.alpha == 2
  assert config.training.behind  # as the controller's loop does at α >= 1
  on_policy = sim_vs_measured.sim_config(cal, "async", 0, batch_size=4, group_size=4,
                                         pause_mode=PauseMode.IN_PLACE, steps=8, warmup=3)
  assert not on_policy.training.behind  # α = 0 publishes before the next step
  result = sim.simulate(config, seed=0)
  # Generation-bound (training is short): two workers of 8 slots turn 16 responses of 50 tokens
  # over in 0.2 s plus latencies, and async overlaps the rest.
  assert 16 / (0.2 + 0.03 + 0.05 + 0.1 + 0.08) < result.samples_per_s < 16 / 0.2
  assert max(result.staleness_hist) <= 2


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=9))
def test_decode_steps_are_fitted_non_decreasing(values):
  fitted = _calibration_fits.nondecreasing(values, floor=-10.0)
  assert all(b >= a - 1e-12 for a, b in zip(fitted, fitted[1:]))
  assert sum(fitted) == pytest.approx(sum(values))  # pooling keeps the mean of each block
  if all(b >= a for a, b in zip(values, values[1:])):
    assert fitted == pytest.approx(values)


def test_layouts_follow_the_runs_placement():
  path = str(REPO / "experiments/configs/bench_rlvr.py")
  sync = _calibration.layout(_calibration.load_config(path, mode="sync", async_ratio=0), [0, 1])
  assert sync.server_cpus == ((0,), (1,)) and sync.client_cpus is None
  assert len(sync.workers) == 2
  split = _calibration.load_config(path, mode="async", async_ratio=2)
  async_ = _calibration.layout(split, [0, 1])
  # The event loop runs beside the learner process (None: on the trainer's cores), as in a run.
  assert async_.server_cpus == ((0,),) and async_.client_cpus is None  # one server per core
  assert async_.train_cpus == (1,) and len(async_.workers) == 1
  # Two servers on the one rollout core are one worker (their slots summed).
  shared = _calibration.layout(
      split.replace(rollout=dataclasses.replace(split.rollout, num_servers=2)), [0, 1])
  assert shared.server_cpus == ((0,), (0,)) and len(shared.workers) == 1
  in_process = _calibration.layout(split.replace(learner_process=False), [0, 1])
  assert in_process.client_cpus == (0,)
  # The layouts the calibration measures and a pass's train probes go to, by the split asked for.
  for name, split_, train in (("sync", None, (0, 1, 2)), ("async", (1, 1), (1,)),
                              ("async", (1, 2), (1, 2))):
    config = _calibration.layout_config(path, name, split_)
    assert _calibration.layout(config, [0, 1, 2]).train_cpus == train, (name, split_)
  cores = sorted(os.sched_getaffinity(0))  # this process's, as the probes get them
  assert _calibration.train_cores(path, "sync", (1, 1)) == cores  # sync ignores the split
  if len(cores) >= 2:
    assert _calibration.train_cores(path, "async", (1, 1)) == cores[1:2]


def test_measured_throughput_skips_the_warmup(tmp_path):
  lines = [{"num_samples": n, "time/step_s": s, "time/train_s": train,
            "time/wait_data_s": w, "response_length_max": 9, "response_length_mean": length}
           for n, s, w, length, train in ((16, 30.0, 29.0, 50.0, 1.5), (16, 1.0, 0.2, 3.0, 0.1),
                                          (32, 2.0, 1.4, 6.0, 1.2), (16, 1.0, 0.2, 3.0, 0.1))]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  got = _measured_runs.measured(str(tmp_path), warmup=1)
  assert got["samples_per_s"] == pytest.approx(64 / 4.0)
  assert got["wait_s"] == pytest.approx(0.6)  # the warm-up step's 29 s is not in the mean
  # Per response, not per step, and without the warm-up's 50-token responses.
  assert got["mean_response"] == pytest.approx((16 * 3 + 32 * 6 + 16 * 3) / 64)
  assert got["compile_steps"] == [3]  # step 3 trained > 1 s; the warm-up's compile is not flagged


def test_the_calibrations_mean_response_is_over_every_sampled_response():
  calibration = {"rollout": {"length_groups": [[2, 4], [30, 30], [8, 6]]}}
  assert sim_vs_measured.calibrated_mean_response(calibration) == pytest.approx(80 / 6)


def test_simulate_entry_point_writes_tables_and_plots(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "experiments.simulate", "--gpus=4,8", "--alphas=2",
       "--batch_prompts=4", "--group_size=2", "--slots=4", "--mean_len=300", "--max_len=2000",
       "--steps=2", "--seq_lens=300", "--seq_gpus=8", "--split_gpus=8", "--split_train=2,4",
       "--mech_gpus=4", "--mech_batches=4", f"--out={tmp_path}"],
      capture_output=True, text=True, check=True, timeout=120, cwd=REPO).stdout
  assert out.strip().splitlines()[-1].startswith("sim_async_speedup_at_8_gpus: ")
  for name in ("scaling.json", "scaling.csv", "scaling.png", "seqlen.csv", "seqlen.png",
               "split.csv", "mechanisms.csv"):
    assert (tmp_path / name).stat().st_size > 0
  rows = json.loads((tmp_path / "scaling.json").read_text())
  assert {(r["gpus"], r["mode"]) for r in rows} == {(4, "sync"), (4, "async"), (8, "sync"),
                                                     (8, "async")}
  assert np.isfinite([r["speedup_vs_sync"] for r in rows]).all()


def test_cpu_times_follow_a_process_tree():
  # A child found under its parent, its CPU time read from the kernel and growing with its work;
  # a process that is gone counts nothing (the run's servers stop before the last reading).
  child = subprocess.Popen([sys.executable, "-c", "while True: sum(i * i for i in range(10**5))"])
  learner = None
  try:
    own, descendants = _cpu_time.processes(os.getpid())
    assert own == [os.getpid()] and child.pid in descendants
    # A run's learner process (found by its command line) is the trainer side, not a server.
    learner = subprocess.Popen([sys.executable, "-c", f"# {_cpu_time.LEARNER_MARK}\n"
                                "import time; time.sleep(600)"])
    trainer, descendants = _cpu_time.processes(os.getpid())
    assert trainer == [learner.pid] and child.pid in descendants  # (and any other child of pytest)
    assert learner.pid not in descendants
    first = _cpu_time.cpu_times([child.pid])
    deadline = time.monotonic() + 60
    while _cpu_time.cpu_times([child.pid])[0] <= first[0] and time.monotonic() < deadline:
      time.sleep(0.05)
    later = _cpu_time.cpu_times([child.pid])
    assert later[0] > first[0] and later[1] >= first[1]
    assert _cpu_time.contention(first, later) >= 1.0
  finally:
    for proc in (child, learner):
      if proc is not None:
        proc.kill()
        proc.wait()
  assert _cpu_time.cpu_times([child.pid]) == (0.0, 0.0)
  assert _cpu_time.contention((1.0, 1.0), (1.0, 5.0)) == 1.0  # no CPU time: nothing to scale


def test_train_fit_ignores_a_compiling_step():
  # 0.05 s + 1e-5 s/token, one step 3.2 s (a compilation mid-measurement, as seen in a real
  # calibration): the fit is the line, not a flat 0.3 s.
  tokens = [1000, 1500, 2000, 2500, 3000, 1200, 1800]
  seconds = [0.05 + 1e-5 * x for x in tokens]
  seconds[2] = 3.2
  (lo, hi), fit = _calibration_fits.fit_train(tokens, seconds)
  assert (lo, hi) == (1000, 3000)
  assert fit == pytest.approx([0.06, 0.08], rel=1e-6)


def test_train_fit_is_not_tilted_by_slowed_steps():
  # A real calibration's twelve steps (2026-11-26): ten on the micro-batch ladder, two slowed by
  # the shared machine (880 tokens 0.075 s, 2582 tokens 0.123 s, both under the 3x cut). The fit
  # follows the ten: under 0.029 s at 880 tokens and about 0.06 s at 2796 (least squares gave
  # 0.032 and 0.073).
  tokens = [1168, 1670, 2582, 2568, 2796, 1765, 1896, 1114, 880, 1618, 1772, 1734]
  seconds = [0.026, 0.04, 0.123, 0.059, 0.059, 0.044, 0.04, 0.026, 0.075, 0.043, 0.042, 0.043]
  (lo, hi), fit = _calibration_fits.fit_train(tokens, seconds)
  assert (lo, hi) == (880, 2796)
  assert 0.015 < fit[0] < 0.029 and 0.055 < fit[1] < 0.066
  # Steps that all took the same time whatever their tokens: a flat line, not a negative slope.
  assert _calibration_fits.fit_train([1000, 2000, 3000], [0.05, 0.05, 0.04])[1] == \
      pytest.approx([0.05, 0.05])


class _BurstLearner:
  """A learner slowed for three updates in a row (as a calibration's steps were, about a second
  at a time), recording what it was given."""

  def __init__(self, slow: range):
    self.batches, self.policy_version, self.slow = [], 0, slow

  def update(self, batch):
    if len(self.batches) in self.slow:
      time.sleep(0.3)
    self.batches.append([(t.prompt_ids.tolist(), t.response_ids.tolist()) for t in batch])
    self.policy_version += 1

  def export(self):
    pass

  def collect_garbage(self):
    pass


def test_each_train_batch_runs_once_per_pass_and_keeps_its_fastest_time():
  bench = object.__new__(_calibration._Bench)
  bench.config = _calibration.load_config(str(REPO / "experiments/configs/bench_rlvr_longtail.py"))
  bench.learner, bench.vocab_size = _BurstLearner(slow=range(1, 4)), 100
  groups = [[3, 5], [40, 44], [7, 7]]
  out = asyncio.run(bench.train(groups, 6.0, 3, busy=False))
  batches = bench.learner.batches
  assert _calibration._TRAIN_PASSES == 3 and len(batches) == 9
  assert batches[:3] == batches[3:6] == batches[6:]  # the same three batches in every pass
  assert batches[0] != batches[1] != batches[2]  # each a new draw
  # Updates 1-3 (batch 1 and 2 of the first pass, batch 0 of the second) were slowed: a batch run
  # twice in a row would have kept a slowed time for batch 1; a pass apart, none is kept.
  assert all(s < 0.25 for s in out["raw_seconds"]), out["raw_seconds"]
  assert out["raw_tokens"] == [sum(len(p) + len(r) for p, r in b) for b in batches[:3]]


def test_bursts_release_a_batch_of_groups_after_each_handoff_and_wait_for_them():
  bench = object.__new__(_calibration._Bench)
  bench.config = _calibration.load_config(str(REPO / "experiments/configs/bench_rlvr_longtail.py"))
  bench.prompts, bench._count = [object()] * 5, 0
  sent, published = [], []

  async def one(sampling, sample=None, prompt_tokens=None):
    sent.append((time.perf_counter(), sampling.max_new_tokens))
    await asyncio.sleep(0.15)  # longer than the period: bursts overlap, as in a run
    return sampling.max_new_tokens

  class Fleet:
    version = 7  # what the fleet serves: each handoff must publish a newer one

    async def publish(self, path, version):
      published.append((time.perf_counter(), version))
      self.version = version

  bench.one, bench.fleet = one, Fleet()
  b, n = bench.config.batch_size, bench.config.group_size
  start = time.perf_counter()
  requests = asyncio.run(bench._bursts_for(0.1, 0.25, [[3, 9], [40, 44]], np.random.default_rng(0),
                                           handoffs=True))
  waited = time.perf_counter() - start
  assert requests == len(sent) == 3 * b * n  # releases at 0, 0.1 and 0.2 s
  times = sorted(t - start for t, _ in sent)
  for k in range(3):  # each burst's requests leave together, a period after the last burst
    burst = times[k * b * n:(k + 1) * b * n]
    assert burst[-1] - burst[0] < 0.05 and abs(burst[0] - 0.1 * k) < 0.05
    assert published[k][0] - start <= burst[0]  # its handoff first
  assert [v for _, v in published] == [8, 9, 10]  # each handoff the next version the fleet lacks
  assert waited >= 0.2 + 0.15  # every request of the last burst came back
  assert {tokens for _, tokens in sent} <= {3, 9, 40, 44}  # the policy's own groups' lengths


def test_sync_rounds_hand_over_to_idle_servers_then_await_a_whole_batch():
  bench = object.__new__(_calibration._Bench)
  bench.config = _calibration.load_config(str(REPO / "experiments/configs/bench_rlvr_longtail.py"))
  bench.prompts, bench._count = [object()] * 5, 0
  events = []  # ("publish" | "send" | "done", time)

  async def one(sampling, sample=None, prompt_tokens=None):
    events.append(("send", time.perf_counter()))
    await asyncio.sleep(0.05 if sampling.max_new_tokens < 10 else 0.12)  # a long tail
    events.append(("done", time.perf_counter()))
    return sampling.max_new_tokens

  class Fleet:
    version = 3

    async def publish(self, path, version, idle=False):
      assert idle and version == self.version + 1  # as a sync step's handoff
      events.append(("publish", time.perf_counter()))
      self.version = version

  bench.one, bench.fleet = one, Fleet()
  b, n = bench.config.batch_size, bench.config.group_size
  requests = asyncio.run(bench._rounds_for(0.2, [[3, 9], [40, 44]], np.random.default_rng(0)))
  publishes = [t for kind, t in events if kind == "publish"]
  assert len(publishes) >= 2 and requests == len(publishes) * b * n
  for k, start in enumerate(publishes):  # each round: every request sent after its handoff, and
    # the next handoff only after the round's last request is back (the batch barrier)
    end = publishes[k + 1] if k + 1 < len(publishes) else float("inf")
    sent = [t for kind, t in events if kind == "send" and start <= t < end]
    done = [t for kind, t in events if kind == "done" and start <= t <= end]
    assert len(sent) == len(done) == b * n


def test_sync_runs_are_referenced_at_the_decodes_contention_and_priced_by_the_rounds():
  # The sync rounds price a request in the servers' CPU seconds, beside the client scoring on
  # their cores (contention 1.4 there); the decode table was timed at the decode's contention
  # (1.1), so a sync run's servers are compared with the decode's, rounds or not.
  Contention = sim_vs_measured.Contention
  cal = _calibration_of(length=50, step_s=0.004, train_s=0.1)
  cal["rollout"]["contention"], cal["trainer"]["alone"]["contention"] = 1.1, 1.05
  cal["rollout"]["rounds"] = {"request_s": 0.0007, "contention": 1.4}
  assert sim_vs_measured.reference_contention(cal, "sync") == Contention(1.1, 1.05)


def test_a_stream_counts_every_lanes_requests():
  # Lanes finish groups while others await theirs: each group's requests must be counted once.
  # (With `requests += await ...` each lane wrote back the count it read before awaiting, and
  # 8 lanes reported ~45 requests/s where their server answered ~345: the bursts were paced by it.)
  bench = object.__new__(_calibration._Bench)
  finished = []

  async def group(groups, rng):
    await asyncio.sleep(float(rng.uniform(0.001, 0.01)))  # lanes interleave
    finished.append(2)
    return 2

  bench._group = group
  requests = asyncio.run(bench._stream_for(8, 0.2, None, np.random.default_rng(0)))
  assert len(finished) > 8 * 10  # every lane made many groups
  assert requests == sum(finished)


def test_contention_over_two_phases_is_the_wall_weighted_harmonic_mean():
  # 1 s of wall time at contention 1 (1 s on a CPU) and 1 s at 2 (0.5 s on a CPU): 2 s of wall
  # time for 1.5 s of CPU time, 4/3 (the arithmetic mean would say 1.5).
  assert sim_vs_measured.mixed_contention(1.0, 2.0, 0.5) == pytest.approx(2.0 / 1.5)
  assert sim_vs_measured.mixed_contention(1.5, 3.0, 0.0) == 1.5
  assert sim_vs_measured.mixed_contention(1.5, 3.0, 1.0) == pytest.approx(3.0)
  with pytest.raises(ValueError, match="beside_fraction"):
    sim_vs_measured.mixed_contention(1.0, 2.0, 1.5)


def _async_calibration(servers_sharing: float, trainer_sharing: float) -> dict:
  """A calibration in the async layout: measured alone at contention 1.5 (servers) and 1.2
  (trainer), and beside the other side at `*_sharing` times that."""
  cal = _calibration_of(length=50, step_s=0.004, train_s=0.05)
  cal["rollout"]["contention"] = 1.5
  cal["rollout"]["beside_train"] = {"factor": 1.3, "contention_alone": 2.0,
                                    "contention_beside": 2.0 * servers_sharing}
  cal["trainer"]["alone"]["contention"] = 1.2
  cal["trainer"]["beside_rollout"] = {"contention": 1.2 * trainer_sharing}
  cal["interference"] = {"train_beside_rollout": 2.0, "rollout_beside_train": 1.3}
  return cal


def _async_predictor(cal: dict):
  """Two seeds of the real simulator on `cal`, async α = 2, its costs rescaled by a contention."""
  knobs = ("async", 2, 4, 4, PauseMode.IN_PLACE, 12, 4)

  def predict(slowdown):
    config = sim_vs_measured.sim_config(cal, *knobs, rollout_slowdown=slowdown.servers,
                                        train_slowdown=slowdown.trainer)
    return [sim.simulate(config, seed=s) for s in range(2)]

  return predict


def test_async_reference_holds_the_sharing_for_the_time_it_is_shared():
  Contention, Overlap = sim_vs_measured.Contention, sim_vs_measured.Overlap
  cal = _async_calibration(servers_sharing=1.5, trainer_sharing=2.0)
  # Sync is rescaled against the contention the costs were measured at, alone.
  assert sim_vs_measured.reference_contention(cal, "sync") == Contention(1.5, 1.2)
  always = sim_vs_measured.reference_contention(cal, "async", Overlap(1.0, 1.0))
  assert always == Contention(pytest.approx(1.5 * 1.5), pytest.approx(1.2 * 2.0))
  # The servers beside training half the time: 1.5 * (1 / (0.5 / 1 + 0.5 / 1.5)).
  half = sim_vs_measured.reference_contention(cal, "async", Overlap(1.0, 0.5))
  assert half.servers == pytest.approx(1.5 * 1.2) and half.trainer == pytest.approx(2.4)
  # Less contention beside than alone (noise) is no sharing, not a speed-up.
  calm = sim_vs_measured.reference_contention(_async_calibration(0.8, 0.9), "async",
                                              Overlap(1.0, 1.0))
  assert calm == Contention(1.5, 1.2)
  with pytest.raises(ValueError, match="overlap"):
    sim_vs_measured.reference_contention(cal, "async")
  # A calibration that measured no interference is referenced alone, as sync.
  unshared = _calibration_of(length=50, step_s=0.004, train_s=0.05)
  unshared["rollout"]["contention"], unshared["trainer"]["alone"]["contention"] = 1.5, 1.2
  assert sim_vs_measured.reference_contention(unshared, "async", Overlap(1.0, 1.0)) == \
      Contention(1.5, 1.2)


def test_a_streams_request_cost_is_its_server_time_beyond_the_priced_decode_steps():
  table = ([1, 2, 4, 8], [1e-4, 2e-4, 3e-4, 5e-4])
  # Two servers on a CPU 4 s together: 1000 steps at 6 live (4e-4 s each, interpolated) and 500
  # at 2 live (2e-4 s): 0.4 + 0.1 s of decode leaves 3.5 s for 100 requests.
  before = [{"decode_steps": 10, "busy_slot_steps": 60}, {"decode_steps": 0, "busy_slot_steps": 0}]
  after = [{"decode_steps": 1010, "busy_slot_steps": 6060},
           {"decode_steps": 500, "busy_slot_steps": 1000}]
  assert _calibration_fits.stream_request_s(4.0, before, after, *table, requests=100) == \
      pytest.approx(0.035)
  # A server that decoded nothing adds all its CPU time; more decode than CPU is not negative.
  idle = [{"decode_steps": 5, "busy_slot_steps": 5}]
  assert _calibration_fits.stream_request_s(1.0, idle, idle, *table, requests=10) == pytest.approx(0.1)
  busy = [{"decode_steps": 10_000, "busy_slot_steps": 80_000}]
  assert _calibration_fits.stream_request_s(1.0, idle, busy, *table, requests=10) == 0.0
  with pytest.raises(ValueError, match="without a finished request"):
    _calibration_fits.stream_request_s(1.0, idle, idle, *table, requests=0)


def test_a_stream_point_is_the_servers_cpu_time_per_worker_step():
  # Two servers, one per worker, on a CPU 2 s together over 1000 + 1000 steps at 6 and 2 live.
  before = [{"decode_steps": 10, "busy_slot_steps": 60}, {"decode_steps": 0, "busy_slot_steps": 0}]
  after = [{"decode_steps": 1010, "busy_slot_steps": 6060},
           {"decode_steps": 1000, "busy_slot_steps": 2000}]
  assert _calibration_fits.stream_point(2.0, before, after) == (pytest.approx(4.0), pytest.approx(1e-3))
  # Both servers on one core (one worker): its requests advance a token per two server steps.
  assert _calibration_fits.stream_point(2.0, before, after, servers_per_worker=2) == \
      (pytest.approx(8.0), pytest.approx(2e-3))
  with pytest.raises(ValueError, match="without a decode step"):
    _calibration_fits.stream_point(1.0, before, before)


def test_async_steps_are_priced_by_the_stream_and_sync_steps_by_the_batches():
  # The stream's table holds its requests' work, so async adds no request cost; sync keeps the
  # static table and the batch's request cost. A calibration without a stream table (written
  # before it) prices async as sync.
  cal = _calibration_of(length=50, step_s=0.004, train_s=0.05)
  cal["rollout"]["request_s"] = 0.01
  knobs = (4, 4, PauseMode.IN_PLACE, 8, 3)
  old = sim_vs_measured.sim_config(cal, "async", 2, *knobs).cost
  assert (old.decode.step_time(4), old.request_s) == (pytest.approx(0.004), 0.01)
  cal["rollout"]["stream"] = {"active": [1.5, 6.0], "step_s": [0.001, 0.003], "contention": 1.0,
                              "request_s": 0.02}
  stream = sim_vs_measured.sim_config(cal, "async", 2, *knobs, rollout_slowdown=2.0).cost
  assert stream.request_s == 0.0
  assert stream.decode.step_time(1) == pytest.approx(0.002)  # flat below the first point
  assert stream.decode.step_time(3) == pytest.approx(2 * (0.001 + 0.002 * 1.5 / 4.5))
  sync = sim_vs_measured.sim_config(cal, "sync", 0, *knobs).cost
  assert (sync.decode.step_time(4), sync.request_s) == (pytest.approx(0.004), 0.01)
  # With bursts measured, async is the static table plus the bursts' cost per request, rescaled
  # like every rollout cost; sync is unchanged.
  cal["rollout"]["bursts"] = {"request_s": 0.005, "contention": 1.0}
  bursts = sim_vs_measured.sim_config(cal, "async", 2, *knobs, rollout_slowdown=2.0).cost
  assert (bursts.decode.step_time(4), bursts.request_s) == (pytest.approx(0.008), 0.01)
  sync = sim_vs_measured.sim_config(cal, "sync", 0, *knobs).cost
  assert (sync.decode.step_time(4), sync.request_s) == (pytest.approx(0.004), 0.01)


def test_async_servers_are_referenced_at_the_contention_of_the_calibrations_stream():
  # A server's own threads wait for one another in a stream of requests (contention 1.8 here)
  # more than over static decode batches (1.5): an async run is a stream, so its servers are
  # compared with the stream, the sync layout's with the batches; the trainer's side is as before.
  Contention, Overlap = sim_vs_measured.Contention, sim_vs_measured.Overlap
  cal = _async_calibration(servers_sharing=1.5, trainer_sharing=2.0)
  cal["rollout"]["stream"] = {"request_s": 0.001, "contention": 1.8}
  assert sim_vs_measured.reference_contention(cal, "sync") == Contention(1.5, 1.2)
  always = sim_vs_measured.reference_contention(cal, "async", Overlap(1.0, 1.0))
  assert always == Contention(pytest.approx(1.8 * 1.5), pytest.approx(1.2 * 2.0))
  alone = sim_vs_measured.reference_contention(cal, "async", Overlap(0.0, 0.0))
  assert alone == Contention(pytest.approx(1.8), pytest.approx(1.2))
  # Bursts price the async requests when measured: their contention is the reference.
  cal["rollout"]["bursts"] = {"request_s": 0.001, "contention": 1.6}
  alone = sim_vs_measured.reference_contention(cal, "async", Overlap(0.0, 0.0))
  assert alone == Contention(pytest.approx(1.6), pytest.approx(1.2))
  assert sim_vs_measured.reference_contention(cal, "sync") == Contention(1.5, 1.2)


def test_an_async_run_that_meets_only_the_calibrated_sharing_is_not_rescaled():
  # The run's contention is the calibration's beside the other side, nothing else: the
  # interference factors charge that sharing already, so the prediction must stay (close to) the
  # unscaled one, while the alone-only reference charges it a second time.
  cal = _async_calibration(servers_sharing=1.5, trainer_sharing=2.0)
  predict = _async_predictor(cal)
  unscaled = predict(sim_vs_measured.Contention(1.0, 1.0))
  overlap = sim_vs_measured.Overlap.of(unscaled)
  assert 0.0 < overlap.rollout_beside_train < overlap.train_beside_rollout <= 1.0
  # The run's servers beside training for the share of their time the simulation says.
  run = sim_vs_measured.reference_contention(cal, "async", overlap)
  results, slowdown = sim_vs_measured.rescaled_prediction(cal, run, predict, overlap)
  assert slowdown.servers == pytest.approx(1.0, abs=0.03)
  assert slowdown.trainer == pytest.approx(1.0, abs=0.03)

  def rate(results):
    return np.mean([r.samples_per_s for r in results])

  assert rate(results) == pytest.approx(rate(unscaled), rel=0.03)
  twice = predict(run / sim_vs_measured.reference_contention(cal, "sync"))
  assert rate(twice) < 0.9 * rate(unscaled)


def test_an_async_run_whose_trainer_waited_less_than_the_reference_trains_at_calibrated_speed():
  # The async rule since 2026-11-29 (`trainer_floor`). Tried: a run whose trainer's process met
  # 0.8 of the reference contention (what the slow mode's balanced async runs met), one that met
  # 1.3, the servers at the reference each time; the real simulator, a trainer-bound layout
  # (a train step of 0.2 s alone, 0.4 s beside rollout, against 0.2 s of decode per response).
  from experiments._contention_rescaling import floored_prediction
  cal = _async_calibration(servers_sharing=1.5, trainer_sharing=2.0)
  cal["trainer"]["alone"]["train_s"] = [0.2, 0.2]
  predict = _async_predictor(cal)

  def rate(results):
    return np.mean([r.samples_per_s for r in results])

  overlap = sim_vs_measured.Overlap.of(predict(sim_vs_measured.Contention(1.0, 1.0)))
  reference = sim_vs_measured.reference_contention(cal, "async", overlap)
  at_reference, _ = floored_prediction(cal, reference, predict, overlap)
  calm = sim_vs_measured.Contention(reference.servers, 0.8 * reference.trainer)
  rule, unfloored = floored_prediction(cal, calm, predict, overlap)
  assert unfloored.slowdown.trainer < 0.9  # (below 0.8: the reference moves with the overlap)
  assert rule.slowdown == sim_vs_measured.Contention(unfloored.slowdown.servers, 1.0)
  assert rate(rule.results) == pytest.approx(rate(at_reference.results), rel=0.03)
  assert rate(unfloored.results) > 1.1 * rate(rule.results)  # trainer-bound: x0.8 shows
  busy = sim_vs_measured.Contention(reference.servers, 1.3 * reference.trainer)
  rule, unfloored = floored_prediction(cal, busy, predict, overlap)
  assert rule == unfloored and rule.slowdown.trainer > 1.1
  assert rate(rule.results) < 0.9 * rate(at_reference.results)


def test_a_runs_decode_iteration_is_compared_at_the_calibrated_step_per_worker():
  cal = _calibration_of(length=50, step_s=0.004, train_s=0.05)
  cal["rollout"]["decode_step_s"] = [0.001, 0.008]  # at 1 and 8 live requests per worker
  # Two servers, each its own worker: 4.5 live each.
  assert sim_vs_measured.calibrated_step_s(cal, 4.5, servers=2) == pytest.approx(0.0045)
  # Two servers sharing one core are one worker: 2 live each is 4 on the worker.
  cal["rollout"]["workers"] = 1
  assert sim_vs_measured.calibrated_step_s(cal, 2.0, servers=2) == pytest.approx(0.004)


def test_an_interference_factor_is_the_median_of_paired_step_ratios():
  # Steps i of both lists trained the same batch: batch sizes differ a lot (0.02 s vs 0.06 s),
  # so the ratio of the two lists' medians would mix which batches fell in the middle.
  alone = [0.02, 0.06, 0.03, 0.05, 0.04]
  beside = [0.03, 0.09, 0.045, 0.05, 0.06]  # x1.5 but one step x1.0
  assert _calibration_fits.paired_factor(beside, alone) == pytest.approx(1.5)
  assert _calibration_fits.paired_factor([0.01, 0.02], [0.02, 0.04]) == 1.0  # never a speed-up
  with pytest.raises(ValueError, match="same steps"):
    _calibration_fits.paired_factor([0.1], [0.1, 0.2])


def test_a_runs_cost_per_request_is_its_servers_cpu_beyond_the_static_table(tmp_path):
  # Two servers (one worker each) on a CPU 2 s together over the window, 1000 decode steps each at
  # 4 live; the static table prices a step at 4 live 0.2 + 3/7 * 0.2 ms. 40 samples were trained
  # in the window's records (the 3rd to the 12th: 4 a record), the record before it not counted.
  from experiments._server_profile import Snapshot, server_window
  metrics = tmp_path / "metrics.jsonl"
  metrics.write_text("".join(json.dumps({"num_samples": 4}) + "\n" for _ in range(14)))
  zero = {"decode_steps": 0.0, "busy_slot_steps": 0.0, "decode_s": 0.0}
  after = {"decode_steps": 2000.0, "busy_slot_steps": 8000.0, "decode_s": 0.5}
  reads = {2: (10.0, Snapshot(0.0, 2, zero, 2)), 7: (11.0, None),
           12: (12.0, Snapshot(1.0, 12, after, 2)), 13: (12.5, Snapshot(1.1, 13, after, 1))}
  window = server_window(reads, str(metrics))
  assert (window["server_cpu_s"], window["requests"], window["servers"]) == (2.0, 40, 2)
  cal = _calibration_of(length=50, step_s=0.0002, train_s=0.05)
  cal["rollout"]["decode_step_s"] = [0.0002, 0.0004]
  step = 0.0002 + 3 / 7 * 0.0002
  assert _measured_runs.run_request_s(cal, window) == pytest.approx((2.0 - 2000 * step) / 40)
  # A read whose servers did not all answer (a restart) is not a window's end; none is no window.
  assert server_window({2: (1.0, Snapshot(0.0, 2, zero, 1))}, str(metrics)) is None
  assert _measured_runs.run_request_s(cal, None) is None
