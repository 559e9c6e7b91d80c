"""The experiment scripts' bookkeeping, on synthetic metrics: no training run, no server (seconds).

What can silently go wrong in an experiment is the arithmetic after the runs: warm-up steps that
leak into steady-state throughput, seeds averaged into the wrong cell, a band that is not what the
caption says, a calibration that scales the wrong runs, a scheduling policy that does not do what
its name says. Those are checked here; that each script's flags parse is checked by running it
with `--dry_run` in a subprocess (the scripts define overlapping absl flags, so they are never
imported into this process).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import _mechanisms as mech
from experiments import _runs, _summary, plots

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_records(steps: int, *, alpha: int, step_s: float = 0.5, slow_first: float = 30.0,
                 samples: int = 32, eval_every: int = 5, seed: int = 0) -> list[dict]:
  rng = np.random.default_rng(seed)
  records = []
  for i in range(1, steps + 1):
    r = {"step": i, "num_samples": samples, "time/step_s": slow_first if i == 1 else step_s,
         "time/train_s": 0.1, "time/wait_data_s": 0.2, "time/pause_s": 0.01,
         "accuracy": min(1.0, 0.3 + 0.01 * i + 0.05 * rng.standard_normal()),
         "reward_mean": 0.5, "staleness_mean": min(alpha, 1.0), "staleness_max": alpha,
         "response_length_mean": 7.0, "samples_per_s": samples / step_s}
    if i == 1:
      r["eval/initial_expected_accuracy"] = 0.5
    if i % eval_every == 0 or i == steps:
      r["eval/expected_accuracy"] = 0.5 + 0.01 * i
    records.append(r)
  return records


def write_run(out: str, name: str, records: list[dict], overrides: dict) -> _runs.RunSpec:
  workdir = os.path.join(out, name)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump({"wall_s": 99.0, "samples_per_s": 1.0, "counters": {"dropped_stale": 3}}, f)
  return _runs.RunSpec(name, overrides)


def test_timed_seconds_count_what_lies_between_steps():
  """Tried: steps whose stamps leave 0.1 s of bookkeeping (a log, a checkpoint) between them, the
  first step of a run (nothing before it), a record without a stamp (an older run) and a resume
  (its clock starts again, so the gap is negative). The bookkeeping must count where two stamps
  bound it; elsewhere each step's own span stands in, never a negative or too-short gap."""
  spans = [0.5, 0.4, 0.3, 0.2, 0.6]
  clock = [0.5, 1.0, 1.4, None, 0.6]  # 0.1 s between steps 1 and 2; step 5 resumed (clock restarts)
  records = [{"time/step_s": s, **({"time/clock_s": c} if c is not None else {})}
             for s, c in zip(spans, clock)]
  # step 1: its span; step 2: 1.0 - 0.5 (0.1 of bookkeeping); step 3: 1.4 - 1.0 (0.1);
  # step 4: no stamp; step 5: gap 0.6 - None. -> 0.5 + 0.5 + 0.4 + 0.2 + 0.6
  assert _summary.timed_seconds(records, 0) == pytest.approx(2.2)
  assert _summary.timed_seconds(records, 2) == pytest.approx(0.4 + 0.2 + 0.6)
  records[3]["time/clock_s"] = 1.7  # 0.1 of bookkeeping before step 4; step 5 still restarted
  assert _summary.timed_seconds(records, 2) == pytest.approx(0.4 + 0.3 + 0.6)
  # steady_throughput uses the same wall: 5 steps x 32 samples over it.
  for r in records:
    r["num_samples"] = 32
  assert _summary.steady_throughput(records, 0) == pytest.approx(160 / (0.5 + 0.5 + 0.4 + 0.3 + 0.6))


def test_finished_runs_are_reused_and_summarized(tmp_path):
  spec = write_run(str(tmp_path), "a2_s0", fake_records(20, alpha=2),
                   {"mode": "async", "async_ratio": 2, "steps": 20})
  result = _runs.launch(spec, str(tmp_path), log=lambda *_: None)  # no subprocess: reused
  assert result.ok and len(result.records) == 20
  row = _summary.summarize(result, threshold=0.6)
  # α = 2: step 1 (compilation) and the two pre-generated batches are warm-up.
  assert row["warmup_steps"] == 4
  assert row["samples_per_s_steady"] == pytest.approx(32 / 0.5)
  assert row["samples_per_s_median"] == pytest.approx(64.0)
  assert row["initial_eval"] == 0.5 and row["final_eval"] == pytest.approx(0.7)
  assert row["eval_gain"] == pytest.approx(0.2)
  assert row["steps_to_threshold"] == 10  # first evaluation >= 0.6 is at step 10
  assert row["time_to_threshold_s"] == pytest.approx(30.0 + 9 * 0.5)
  assert row["dropped_stale"] == 3 and row["wall_s"] == 99.0


def test_sync_warmup_and_threshold_never_reached(tmp_path):
  spec = write_run(str(tmp_path), "sync_s0", fake_records(10, alpha=0), {"mode": "sync"})
  row = _summary.summarize(_runs.launch(spec, str(tmp_path), log=lambda *_: None), threshold=0.99)
  assert row["warmup_steps"] == 2
  assert row["steps_to_threshold"] is None and row["time_to_threshold_s"] is None


def test_mean_over_seeds_threshold_needs_a_majority():
  rows = [{"ok": True, "samples_per_s_steady": 10.0, "final_eval": 0.6, "steps_to_threshold": 5},
          {"ok": True, "samples_per_s_steady": 20.0, "final_eval": 0.8, "steps_to_threshold": None},
          {"ok": True, "samples_per_s_steady": 30.0, "final_eval": 0.7, "steps_to_threshold": 15}]
  row = _summary.mean_over_seeds(rows)
  assert row["seeds"] == 3 and row["samples_per_s_steady"] == pytest.approx(20.0)
  assert row["final_eval_std"] == pytest.approx(np.std([0.6, 0.8, 0.7]))
  assert row["steps_to_threshold"] == 15  # median of the two hits (2 of 3 seeds reached it)
  rows[2]["steps_to_threshold"] = None
  assert _summary.mean_over_seeds(rows)["steps_to_threshold"] is None


def test_moving_average_is_trailing_and_band_kinds():
  values = np.arange(1.0, 21.0)
  ma = _summary.moving_average(values, 11)
  assert ma[0] == 1.0 and ma[10] == pytest.approx(6.0) and ma[19] == pytest.approx(15.0)
  one = plots.band([values], 11)
  assert one[3] == "window"
  assert one[2][19] - one[0][19] == pytest.approx(values[9:20].std())
  many = plots.band([values, values + 2.0], 11)
  assert many[3] == "seeds"
  np.testing.assert_allclose(many[0], ma + 1.0)
  np.testing.assert_allclose(many[2] - many[0], 1.0)  # std across the two seeds


def test_figures_are_written(tmp_path):
  runs = {"sync": [fake_records(15, alpha=0, seed=s) for s in range(2)],
          "α=2": [fake_records(15, alpha=2, seed=s + 5) for s in range(2)]}
  grid = {"ppo": runs, "cispo": runs}
  for metric in ("accuracy", _summary.EVAL):
    path = plots.ablation_figure(grid, metric, str(tmp_path / f"{metric[:4]}.png"), title="t")
    assert os.path.getsize(path) > 1000
  assert os.path.exists(plots.curves_figure(runs, _summary.EVAL, str(tmp_path / "c.png")))
  path = plots.bars_figure(["sync", "α=2"], {"a": [1.0, 2.0]}, str(tmp_path / "b.png"),
                           ylabel="x", line={"acc": [0.5, 0.6]}, line_label="y")
  assert os.path.exists(path)


def test_tables(tmp_path):
  rows = [{"a": 1.23456, "b": None, "c": True}, {"a": float("nan"), "b": "x"}]
  md = _summary.write_table(rows, [("a", "A"), ("b", "B"), ("c", "C")], str(tmp_path), "t",
                         {"note": 1})
  assert md.splitlines()[0] == "| A | B | C |"
  assert "| 1.23 | — | yes |" in md and "| nan | x | — |" in md
  with open(tmp_path / "t.json") as f:
    assert json.load(f)["note"] == 1


def test_build_config_applies_dotted_overrides():
  spec = _runs.RunSpec("x", {"mode": "sync", "train.loss": {"name": "ppo"}, "steps": 3,
                             "train.optimizer.learning_rate": 1e-4, "task.seed": 7,
                             "rollout.num_servers": 1, "resources.train_devices": 1,
                             "rollout.top_p": 0.9})
  config = _runs.build_config(spec, "/tmp/somewhere")
  assert config.mode.value == "sync" and config.async_ratio == 0 and config.steps == 3
  assert config.train.loss.name.value == "ppo" and config.train.loss.clip_low == 0.2  # fresh
  assert config.train.optimizer.learning_rate == 1e-4 and config.task.seed == 7
  assert config.rollout.num_servers == 1 and config.workdir == "/tmp/somewhere"
  command = spec.command()  # every override has a command-line form: flag or --set
  for part in ("--mode=sync", "--steps=3", "--learning_rate=0.0001", "--set=task.seed=7",
               "--num_rollout_servers=1", "--train_devices=1", "--set=rollout.top_p=0.9",
               """'--set=train.loss={"name": "ppo"}'"""):
    assert part in command, (part, command)


def test_a_misspelt_sweep_field_fails_before_any_run(tmp_path):
  specs = [_runs.RunSpec("ok", {"steps": 2}), _runs.RunSpec("typo", {"rollout.num_server": 2})]
  with pytest.raises(ValueError, match="num_servers"):
    _runs.run_or_print(specs, str(tmp_path), dry_run=True)
  assert not os.listdir(tmp_path)


class FakeServer:
  """Decodes `length` tokens in `length` ms on one of 4 slots; more requests wait in its queue
  (as a real server's do when a batch is split over servers up front)."""

  def __init__(self):
    self.prompts = []
    self.slots = asyncio.Semaphore(4)

  async def generate(self, prompt, length: int) -> int:
    self.prompts.append(prompt)
    async with self.slots:
      await asyncio.sleep(length * 1e-3)
    return length


def play(scheduling: str, placement: str, *, batch=4, n=4, filter_rate=0.0, lengths=None):
  async def make():
    return [FakeServer(), FakeServer()]

  servers = asyncio.run(make())
  pool = mech.Pool(servers, slots=4)
  case = mech.Case(batch, "narrow", scheduling, placement)

  async def reward():
    await asyncio.sleep(0)

  lengths_for = lengths or (lambda i: [3 + i % 5] * n)
  out = asyncio.run(mech.run_round(pool, case, list(range(100)), lengths_for, n=n,
                                   filter_rate=filter_rate, rng=np.random.default_rng(0),
                                   reward=reward))
  return out, servers


@pytest.mark.parametrize("scheduling", ["batch", "queue"])
@pytest.mark.parametrize("placement", ["group", "replicate"])
def test_policies_keep_exactly_b_groups(scheduling, placement):
  out, servers = play(scheduling, placement, batch=6, filter_rate=0.4)
  drops = np.random.default_rng(0).random(out["groups_issued"]) < 0.4
  assert out["groups_issued"] - drops.sum() == 6  # every issued group is kept or replaced
  assert sum(out["server_tokens"]) == sum(3 + i % 5 for i in range(out["groups_issued"])) * 4
  if placement == "group":  # a prompt's n responses all went to one server
    for s in servers:
      for p in set(s.prompts):
        assert s.prompts.count(p) == 4
  if scheduling == "queue":
    assert max(out["peak_busy"]) <= 4  # never more in flight than a server has slots


def test_queue_scheduling_beats_a_static_split_on_a_long_tail():
  # Groups 0 and 2 are long; the static round-robin split puts both on server 0 (≈ 2·200 +
  # 2·30 ms), the queue sends the second one to whichever server frees first (≈ 200 + 3·30 ms).
  long_tail = lambda i: [200] * 4 if i in (0, 2) else [30] * 4  # noqa: E731
  batch, _ = play("batch", "group", batch=8, lengths=long_tail)
  queue, _ = play("queue", "group", batch=8, lengths=long_tail)
  assert queue["generation_s"] < 0.8 * batch["generation_s"]


def test_mechanism_aggregate_ratios_are_paired_by_seed():
  rows = [{"lengths": "narrow", "batch": 4, "scheduling": s, "placement": p, "seed": seed,
           "generation_s": t * (10.0 if seed else 1.0)}  # seed 1 is a 10x heavier workload
          for seed in (0, 1) for (s, p), t in zip(mech.POLICIES, (4.0, 3.0, 2.0, 1.0))]
  row = mech.aggregate(rows, ["narrow"], [4])[0]
  assert row["queue_gain"] == pytest.approx(3.0) and row["both_gain"] == pytest.approx(4.0)
  assert row["replication_gain"] == pytest.approx(2.0)
  assert row["batch_group"] == pytest.approx(22.0)  # times themselves: plain means


def dry_run(module: str, *flags: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", module, "--dry_run", *flags], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module,flags,runs", [
    ("experiments.ablate_losses", (), 18),
    ("experiments.ablate_losses", ("--losses=ppo,topr", "--modes=sync,4", "--seeds=0,1"), 8),
    ("experiments.sweep_async_ratio", (), 6),
    ("experiments.sweep_async_ratio", ("--ratios=1,2", "--nosync"), 2),
    ("experiments.resource_split", ("--total_devices=2",), 6),
    ("experiments.resource_split", ("--total_devices=4", "--noproxy"), 4),
    ("experiments.agentic", (), 3),
    ("experiments.rollout_mechanisms", ("--batch_sizes=4,8",), 16),
])
def test_experiment_flags_parse(module, flags, runs):
  proc = dry_run(module, *flags)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert len(proc.stdout.strip().splitlines()) == runs


def test_bad_flags_fail_clearly():
  proc = dry_run("experiments.ablate_losses", "--losses=ppo,nope")
  assert proc.returncode != 0 and "unknown loss 'nope'" in proc.stderr


def test_a_hung_run_is_stopped(tmp_path):
  child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  messages = []
  rc = _runs._watch(child, str(tmp_path), timeout_s=60, stall_s=3, log=messages.append)
  assert rc == "stalled" and child.poll() is not None and "stalled" in messages[0]


def test_cell_rows_list_unfinished_cells_and_saturation(tmp_path):
  def run(name, overrides, throughput):
    spec = write_run(str(tmp_path), name, fake_records(12, alpha=2, step_s=32 / throughput),
                     overrides)
    return _runs.launch(spec, str(tmp_path), log=lambda *_: None)

  def stopped(name, overrides):
    return _runs.RunResult(_runs.RunSpec(name, overrides), "", [], {}, False, status="stalled")

  a = lambda alpha: {"mode": "async", "async_ratio": alpha}  # noqa: E731
  results = [run("sync_s0", {"mode": "sync"}, 50.0), run("sync_s1", {"mode": "sync"}, 50.0),
             run("a1_s0", a(1), 96.0), stopped("a1_s1", a(1)),
             run("a2_s0", a(2), 100.0), run("a2_s1", a(2), 100.0),
             stopped("a0_s0", a(0)), stopped("a0_s1", a(0))]
  rows = {r["cell"]: r for r in _summary.cell_rows(results, threshold=0.6)}
  assert list(rows) == ["sync", "a1", "a2", "a0"]  # specification order, failed cell listed
  assert rows["sync"]["label"] == "sync" and rows["a2"]["label"] == "α=2"
  assert rows["sync"]["status"] == "ok" and rows["sync"]["seeds"] == 2
  assert rows["a1"]["seeds"] == 1 and rows["a1"]["status"] == "1/2 finished (a1_s1: stalled)"
  assert rows["a0"]["seeds"] == 0 and rows["a0"]["status"].startswith("0/2 finished")
  _summary.add_speedups(list(rows.values()))
  assert rows["a2"]["speedup"] == pytest.approx(2.0) and "speedup" not in rows["a0"]
  # α = 1 is within 5% of the best (α = 2); the unfinished α = 0 cannot be the answer.
  assert _summary.saturation_point(list(rows.values()), "samples_per_s_median", 0.95) == 1
  assert _summary.saturation_point(list(rows.values()), "samples_per_s_median", 0.99) == 2


