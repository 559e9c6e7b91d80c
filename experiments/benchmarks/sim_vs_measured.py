"""The simulator against real runs it never saw: calibrated on microbenchmarks, then predicting.

    python -m experiments.benchmarks.sim_vs_measured [--regimes=longtail,balanced]
        [--modes=sync,1,2,4] [--repeats=3] [--nobracket] [--nomachine_probe]
        [--probe_sides=servers|both|train|train_during|none] [--out=DIR]
    python -m experiments.benchmarks.sim_vs_measured --repredict=DIR [--probe_sides=...]

For each regime (a run config file) the script first calibrates `flashrl_jax.sim` with standalone
microbenchmarks of the real parts (`experiments/_calibration.py`: decode step by live requests on
the run's own server layout, per-request cost as runs send their requests — sync: a batch after each
idle handoff; async: a batch's groups after each weight handoff — handoff, the initial policy's
response lengths, train step and export by trained tokens), once for the sync core layout and once
for the async split. Then it runs each mode for real (`python -m experiments.train`, real servers
and trainer), calibrates both layouts again (`--bracket`, the default), and predicts each run's
samples/s from the two calibrations blended at the run's time: nothing measured in a run goes into
its prediction. Around each calibration and each run an idle engine server per core times a small
decode batch and an idle learner per core a fixed train step (`--machine_probe`, the default;
`experiments/_machine_probe.py`): the machine's speed that minute, which drifts by 10-25% within a
pass. Its predictions are printed beside the rule, not applied since pass BF (`--probe_sides=none`:
in the machine's slow mode the probe's rescaling of the servers' costs, the rule before, made the
largest error of four passes in four; `experiments/_machine_probe.py` says why). Both
sides are timed on a shared machine, so the calibrated costs are also rescaled to the CPU contention
the run met: the kernel's per-thread time on a CPU and time waiting for one give, for the servers
and for the trainer's process, (run + wait) / run over the run's timed steps and over the
calibration's decode and train measurements; the rollout costs are multiplied by the servers' ratio
of the two, the trainer's by its process's. In the async split the trainer's process shares its core
with the controller's loop (1+1) or a server (2+1), and the calibrated interference factors charge
that sharing (measured as the calibration's async layout places it: the learner process beside the
client, `experiments/_calibration.py`); so that the ratio does not charge it again, an async run's
contention is divided by the calibration's as a run would meet it: alone and beside the other side,
weighted by the share of each side's time the simulation spends beside the other
(`reference_contention`), the trainer's factor floored at 1 (`trainer_floor`, since 2026-11-29).
Every row prints the prediction by these rules, the measurement (samples/s over the steps after
`--warmup_steps`, as `async_vs_sync` measures it) and the error, beside predictions by other rules
(`predict_row`, `alternative_predictions`: the alone-only rescaling, none, the first calibration
alone, the probes' variants, in async without the floor, in sync with the latency the calibration's
sync rounds showed, `_sim_config.round_latency_s`) and the run's mean response length beside the
calibration's: the calibration samples the initial policy, and a run whose policy drifts to shorter
answers is faster than that policy would be (docs/simulator.md), and names any timed step that
trained for over a second: a compile mid-run, which no calibration predicts (pass BI).

With `--repeats=N` every mode runs N times (interleaved, reversed on odd repeats) and each mode's
median prediction is compared with its median measurement too: on this 2-core machine one run
varies by more than the target error (nine long-tail runs of a day per mode: 210-312 samples/s at
α = 1, 287-425 at α = 4). `--repredict=DIR` predicts a finished pass's runs again from its saved
calibrations and run records, running nothing. Last lines: `sim_error_max_of_medians: <largest
error of a mode's median>` (repeats), `sim_error_max_unseen: <max |predicted−measured|/measured>`.
"""

from __future__ import annotations

import asyncio  # noqa: F401 (the calibration's event loop)
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable

import numpy as np
from absl import app, flags

from experiments import _calibration, _calibration_fits, _children, _machine_probe
from experiments._contention_rescaling import (  # noqa: F401 (mixed_contention: re-exported)
    Contention, Overlap, floored_prediction, mixed_contention, reference_contention,
    rescaled_prediction, shared_core_prediction)
from experiments._pass_files import (
    LAYOUTS, MeasuredRun, calibration_stem, mode_alpha, mode_layout, mode_name, run_dir,
    saved_calibrations, saved_runs)
from experiments._sim_config import calibrated_mean_response, calibrated_step_s, sim_config
from experiments._measured_runs import COMPILE_S, measured, run, run_request_s
from flashrl_jax import sim

# The regimes of `async_vs_sync` (name -> config, steps, warm-up steps): the runs predicted are
# those runs, with the same steps and the same steps excluded.
REGIMES = {"longtail": ("experiments/configs/bench_rlvr_longtail.py", 100, 10),
           "balanced": ("experiments/configs/bench_rlvr.py", 24, 6)}

_REGIMES = flags.DEFINE_list("regimes", list(REGIMES),
                             f"Regimes ({', '.join(REGIMES)}) or config file paths.")
_MODES = flags.DEFINE_list("modes", ["sync", "1", "2", "4"], "sync and/or async ratios α.")
_STEPS = flags.DEFINE_integer("steps", None, "Training steps per run (default: the regime's; "
                              "16 for a config file path).")
_WARMUP = flags.DEFINE_integer("warmup_steps", None, "Leading steps excluded (compiles, fill; "
                               "default: the regime's, 4 for a config file path).")
_SEEDS = flags.DEFINE_integer("seeds", 8, "Simulation seeds averaged per prediction.")
_REPS = flags.DEFINE_integer("reps", 3, "Repetitions of each microbenchmark point (medians).")
_SPLIT = flags.DEFINE_string("async_split", "1+1", "Async runs' rollout+trainer cores, as "
                             "async_vs_sync's headline (1+1: a server alone on core 0, the "
                             "learner process and the controller's loop on core 1).")
_REPEATS = flags.DEFINE_integer(
    "repeats", 1, "Real runs per mode (interleaved); with more than one, each mode's median "
    "prediction is also compared with its median measurement (a single run on a shared machine "
    "varies by more than the target error: docs/simulator_history.md).")
_BRACKET = flags.DEFINE_bool(
    "bracket", True, "Calibrate each layout again after a regime's runs and predict each run from "
    "the two calibrations blended at its time (the machine's speed drifts within a pass); false: "
    "from the calibration before the runs only.")
_PROBE = flags.DEFINE_bool(
    "machine_probe", True, "Probe the machine's speed with the regime's own engine (an idle "
    "server per core, a small decode batch) just before and after each calibration and run, and "
    "print the predictions that rescale a run's costs by it beside the rule "
    "(experiments/_machine_probe.py).")
_SIDES = flags.DEFINE_enum(
    "probe_sides", "none", [s.value for s in _machine_probe.Sides],
    "Which costs the machine probe rescales in the rule: none (default, since pass BF), the "
    "servers' (the rule from pass AO until BF), both sides' by the decode probe, the servers' by "
    "it and the trainer's by the train probe around the run (train) or during it (train_during) "
    "(experiments/_machine_probe.py says why).")
_OUT = flags.DEFINE_string("out", None, "Directory for runs and calibrations (default: temp).")
_REPREDICT = flags.DEFINE_string(
    "repredict", None, "A pass's --out directory: predict its saved runs again from its saved "
    "calibrations (nothing runs; to compare rules on the same runs). Writes "
    "results_repredicted_<probe_sides>.json there.")


def _split() -> tuple[int, int]:
  rollout, train = _SPLIT.value.split("+")
  return int(rollout), int(train)


def measure_mode(path: str, regime: str, mode: str, repeat: int, out: str, steps: int,
                 warmup: int, probe: _machine_probe.MachineProbe | None = None) -> MeasuredRun:
  """Runs one mode of `regime` for real (with `probe`, the machine probed just before and after)
  and prints its throughput."""
  alpha, layout = mode_alpha(mode), mode_layout(mode)
  workdir = run_dir(out, regime, mode, repeat)
  before = probe.measure() if probe is not None else None
  start = time.time()
  with (probe.during(train_cores=_calibration.train_cores(path, layout, _split()))
        if probe is not None else contextlib.nullcontext({})) as during:
    info = run(path, workdir, layout, alpha, steps, warmup, _split())
  end = time.time()
  if probe is not None:
    info.update(_machine_probe.around(before, probe.measure()), **during)
  with open(os.path.join(workdir, "run.json"), "w") as f:  # to re-predict from, offline
    json.dump({**info, "start": start, "end": end}, f, indent=1)
  print(f"{regime:>9} {mode_name(mode):<10} r{repeat} measured "
        f"{measured(workdir, warmup)['samples_per_s']:7.2f} samples/s (load "
        f"{info['loadavg'][0]:.1f}-{info['loadavg'][1]:.1f}, {end - start:.0f}s)", flush=True)
  return MeasuredRun(regime, mode, repeat, workdir, info, start, end)


def predictor(done: MeasuredRun, path: str, cal: dict, steps: int, warmup: int
              ) -> Callable[..., list[sim.SimResult]]:
  """`predict(slowdown, interference=None)`: `done`'s simulated runs (`--seeds` of them) from
  calibration `cal`, its costs rescaled by `slowdown` and, if given, its interference factors
  replaced."""
  config = _calibration.load_config(path, mode=done.layout, async_ratio=done.alpha)
  knobs = (done.layout, done.alpha, config.batch_size, config.group_size,
           config.rollout.pause_mode, steps, warmup)

  def predict(slowdown: Contention, interference: dict | None = None) -> list[sim.SimResult]:
    simulated = sim_config(cal if interference is None else {**cal, "interference": interference},
                           *knobs, rollout_slowdown=slowdown.servers,
                           train_slowdown=slowdown.trainer)
    return [sim.simulate(simulated, seed=s) for s in range(_SEEDS.value)]

  return predict


def server_cores(cal: dict) -> list[int]:
  """The cores calibration `cal`'s servers ran on (the run's: same layout)."""
  return sorted({core for cores in cal["placement"]["server_cpus"] for core in cores})


def mean_samples_per_s(results: list[sim.SimResult]) -> float:
  return float(np.mean([r.samples_per_s for r in results]))


def predicted_samples_per_s(done: MeasuredRun, path: str, cal: dict, steps: int, warmup: int,
                            sides: _machine_probe.Sides) -> dict:
  """A run's prediction from calibration `cal` alone, its costs rescaled to the CPU contention the
  run met (async: against the reference the prediction's own overlap implies) and, on `sides`
  (with probes around both), to the machine's speed around the run against around the
  calibration; beside it the predictions rescaled by the alone contention only and not rescaled
  at all."""
  machine = Contention(*_machine_probe.machine_speed(  # around the run against the calibration
      done.info, cal, server_cores(cal), cal["placement"]["train_cpus"], sides))
  contention = Contention(done.info["contention"]["rollout"] * machine.servers,
                          done.info["contention"]["trainer"] * machine.trainer)
  predict = predictor(done, path, cal, steps, warmup)
  unscaled = predict(Contention(1.0, 1.0))
  # Alone-only reference (what this script did before; in async it counts the sharing twice).
  alone_ref = reference_contention(cal, "sync")
  alone_only = predict(contention / alone_ref)
  results, slowdown, unfloored = alone_only, contention / alone_ref, None
  if done.layout != "sync":  # the trainer's factor floored at 1 since 2026-11-29 (`trainer_floor`)
    rule, unfloored = floored_prediction(cal, contention, predict, Overlap.of(unscaled))
    results, slowdown = rule.results, rule.slowdown

  mean = mean_samples_per_s
  return {"predicted": mean(results), "predicted_raw": mean(unscaled), "machine": machine,
          "predicted_alone_ref": mean(alone_only), "results": results, "slowdown": slowdown,
          "slowdown_alone_ref": contention / alone_ref, "unfloored": unfloored}


def predict_row(done: MeasuredRun, path: str, cal: dict, steps: int, warmup: int, *,
                sides: _machine_probe.Sides, weight: float | None = None,
                first: dict | None = None, pools: tuple[dict, dict] | None = None) -> dict:
  """Predicts a measured run from calibration `cal` (with brackets: the two calibrations blended
  at `weight`, and `first`, the calibration before the runs alone, printed beside it), the
  machine probe rescaling `sides`, prints the row and returns it. `pools`: the regime's runs'
  and calibrations' pooled probes (`_machine_probe.pooled`), for the alternative that rescales
  by them (printed, not applied; as the shared-core train factor, `_contention_rescaling`)."""
  p = predicted_samples_per_s(done, path, cal, steps, warmup, sides)
  results, slowdown = p["results"], p["slowdown"]
  predicted, raw, old = p["predicted"], p["predicted_raw"], p["predicted_alone_ref"]
  got = measured(done.workdir, warmup)
  info, name = done.info, mode_name(done.mode)

  def error(x: float) -> float:
    return abs(x - got["samples_per_s"]) / got["samples_per_s"]

  row = {"regime": done.regime, "mode": name, "repeat": done.repeat,
         "measured": got["samples_per_s"], "predicted": predicted, "predicted_raw": raw,
         "predicted_alone_ref": old, "slowdown": [slowdown.servers, slowdown.trainer],
         "slowdown_alone_ref": [p["slowdown_alone_ref"].servers, p["slowdown_alone_ref"].trainer],
         "overlap": dataclasses.asdict(Overlap.of(results)),
         "error": error(predicted), "error_raw": error(raw), "error_alone_ref": error(old),
         "train_s": (float(np.mean([r.train_time_s for r in results])), got["train_s"]),
         "wait_s": (float(np.mean([r.wait_data_s for r in results])), got["wait_s"]),
         "mean_response": (calibrated_mean_response(cal), got["mean_response"]),
         "compile_steps": got["compile_steps"],
         "loadavg": info["loadavg"], "run_wall_s": info["wall_s"],
         "servers": info["servers"], "busy_fraction": float(np.mean(
             [r.rollout_busy_fraction for r in results]))}
  if "machine_probe_s" in info and "machine_probe_s" in cal:
    machine, Sides = p["machine"], _machine_probe.Sides
    probed = {Sides.TRAIN: "train_probe_s", Sides.TRAIN_DURING: "during_train_probe_s"}
    others = [Sides.NONE, Sides.SERVERS, Sides.BOTH] + [  # train: since eb808f8, during: 11-29
        s for s, key in probed.items() if key in info and key in cal]
    other = {other: predicted if other == sides else  # the rule applied: computed above
             predicted_samples_per_s(done, path, cal, steps, warmup, other)["predicted"]
             for other in others}
    unprobed, servers, both = other[Sides.NONE], other[Sides.SERVERS], other[Sides.BOTH]
    servers_probe = _machine_probe.speed_ratio(info, cal, server_cores(cal))
    trainer_probe = _machine_probe.speed_ratio(info, cal, cal["placement"]["train_cpus"])
    row.update(machine_speed=[machine.servers, machine.trainer], trainer_core_probe=trainer_probe,
               servers_probe=servers_probe, predicted_unprobed=unprobed,
               error_unprobed=error(unprobed), predicted_probe_servers=servers,
               error_probe_servers=error(servers), predicted_probe_both=both,
               error_probe_both=error(both))
    train = ""
    if Sides.TRAIN in other:
      train_probe = _machine_probe.speed_ratio(info, cal, cal["placement"]["train_cpus"],
                                               "train_probe")
      row.update(trainer_core_train_probe=train_probe, predicted_probe_train=other[Sides.TRAIN],
                 error_probe_train=error(other[Sides.TRAIN]))
      train = (f"; the trainer's core's train probe x{train_probe:.3f}, with it on the trainer "
               f"{other[Sides.TRAIN]:7.2f} ({row['error_probe_train']:5.1%})")
    if Sides.TRAIN_DURING in other:  # printed, not applied: its first pass is its test
      during = _machine_probe.speed_ratio(info, cal, cal["placement"]["train_cpus"],
                                          "during_train_probe")
      row.update(trainer_core_during_train_probe=during,
                 predicted_probe_train_during=other[Sides.TRAIN_DURING],
                 error_probe_train_during=error(other[Sides.TRAIN_DURING]))
      train += (f"; its train probe during the run x{during:.3f}, with it on the trainer "
                f"{other[Sides.TRAIN_DURING]:7.2f} ({row['error_probe_train_during']:5.1%})")
    print(f"{done.regime:>9} {name:<10} r{done.repeat} machine probe around the run "
          f"{info['machine_probe_s'] * 1e3:.1f} ms against the calibration's "
          f"{cal['machine_probe_s'] * 1e3:.1f} ms (the servers' cores x{servers_probe:.3f}, the "
          f"trainer's x{trainer_probe:.3f}; the rule rescales {sides.value}): predicted without "
          f"the probe {unprobed:7.2f} ({row['error_unprobed']:5.1%}), with it on the servers (the "
          f"rule until pass BF) {servers:7.2f} ({row['error_probe_servers']:5.1%}), on both sides "
          f"{both:7.2f} ({row['error_probe_both']:5.1%}){train}", flush=True)
  alternatives = alternative_predictions(done, path, cal, steps, warmup, p, pools, sides)
  row.update({k: v for k, v in alternatives.items() if k != "line"})
  row.update({f"error_{k[len('predicted_'):]}": error(v) for k, v in alternatives.items()
              if k.startswith("predicted_")})
  if alternatives["line"]:
    print(f"{done.regime:>9} {name:<10} r{done.repeat} printed, not applied: " + "; ".join(
              f"{label} {row[f'predicted_{key}']:7.2f} ({row[f'error_{key}']:5.1%})"
              for key, label in alternatives["line"]), flush=True)
  bracket = ""
  if first is not None:
    before_only = predicted_samples_per_s(done, path, first, steps, warmup, sides)["predicted"]
    row.update(calibration_weight=weight, predicted_first_only=before_only,
               error_first_only=error(before_only))
    bracket = (f" [calibrations blended at {weight:.2f}; from the first alone {before_only:7.2f}"
               f" ({row['error_first_only']:5.1%})]")
  print(f"{done.regime:>9} {name:<10} r{done.repeat} measured {row['measured']:7.2f} samples/s | "
        f"predicted {row['predicted']:7.2f} (error {row['error']:5.1%}){bracket}; rescaled by the "
        f"alone contention only {old:7.2f} ({row['error_alone_ref']:5.1%}); without rescaling "
        f"{raw:7.2f} ({row['error_raw']:5.1%}) | CPU contention x{slowdown.servers:.2f} "
        f"(servers) x{slowdown.trainer:.2f} (trainer process) of the calibration's (alone only: "
        f"x{row['slowdown_alone_ref'][0]:.2f}, x{row['slowdown_alone_ref'][1]:.2f}; simulated "
        f"beside fraction: train {row['overlap']['train_beside_rollout']:.2f}, rollout "
        f"{row['overlap']['rollout_beside_train']:.2f}), load "
        f"{info['loadavg'][0]:.1f}-{info['loadavg'][1]:.1f} | per step, predicted/measured: "
        f"train {row['train_s'][0]:.3f}/{row['train_s'][1]:.3f}s, wait for data "
        f"{row['wait_s'][0]:.3f}/{row['wait_s'][1]:.3f}s, mean response "
        f"{row['mean_response'][0]:.1f}/{row['mean_response'][1]:.1f} tokens (the calibration's "
        f"initial policy / the run's)" + (f" | steps {got['compile_steps']} trained over "
        f"{COMPILE_S:.0f} s: compiled mid-run" if got["compile_steps"] else ""), flush=True)
  profile = info["servers"]
  if profile is not None:  # a server restarted or none answered: nothing to compare
    step = calibrated_step_s(cal, profile["live"], profile["servers"])
    # What a probe should follow (a diagnostic, never a prediction's input): the run's own decode.
    row["decode_over_calibrated"] = profile["iteration_ms"] / (step * 1e3)
    request_s = run_request_s(cal, info.get("server_window"))
    row["run_request_s"] = request_s
    ro = cal["rollout"]
    calibrated = (f"{ro['stream']['request_s'] * 1e3:.2f} ms in its stream, "
                  f"{ro['request_batch_s'] * 1e3:.2f} ms as a batch" if "stream" in ro else
                  f"{ro['request_s'] * 1e3:.2f} ms in sync rounds, "
                  f"{ro['request_batch_s'] * 1e3:.2f} ms fitted to batches" if "rounds" in ro else
                  f"{ro['request_s'] * 1e3:.2f} ms as a batch")
    if "bursts" in ro:
      calibrated += f", {ro['bursts']['request_s'] * 1e3:.2f} ms in bursts after handoffs"
    print(f"{'':>20} servers: decode iteration {profile['iteration_ms']:.3f} ms at "
          f"{profile['live']:.1f} live (calibrated step there {step * 1e3:.3f} ms, "
          f"x{slowdown.servers:.2f} rescaled {step * slowdown.servers * 1e3:.3f} ms), inside "
          f"decode/prefill {profile['busy']:.2f} of the time (simulated: busy "
          f"{row['busy_fraction']:.2f} of the whole run)"
          + ("" if request_s is None else f"; CPU per request beyond the static table "
             f"{request_s * 1e3:.2f} ms (calibration: {calibrated})"), flush=True)
  return row


def alternative_predictions(done: MeasuredRun, path: str, cal: dict, steps: int, warmup: int,
                            rule: dict, pools: tuple[dict, dict] | None,
                            sides: _machine_probe.Sides) -> dict:
  """Predictions beside the rule. Written before pass AT: the servers' costs rescaled by the
  regime's pooled probes (every run's against every calibration's, per core median: pass AS); in
  async, the train step beside rollout by `shared_core_train_factor` (the servers as the rule has
  them, the trainer's costs not rescaled by contention). Before pass AU: the servers' costs
  rescaled by the probe *during* the run over the one during its calibration. In async, the rule
  before 2026-11-29 (the trainer's factor not floored); in sync, the sync rounds' latency. The
  rule rescales `sides`; the probes' alternatives rescale the servers' costs whatever it does.
  Keys `predicted_<name>` (pooled_probe, shared_core, during_probe, unfloored, rounds_latency),
  `shared_core_train_factor`, `pooled_probe_speed`, `during_probe_speed`, `line` ((key, label))."""
  out: dict = {"line": []}

  def probed(run_probe: dict, cal_probe: dict) -> tuple[float, float]:
    """(the prediction with the servers' costs rescaled by another probe, that probe's speed
    ratio on them): the run's and the calibration's decode probes per core replaced by it."""
    p = predicted_samples_per_s(
        dataclasses.replace(done, info={**done.info, "machine_probe_per_core": run_probe}), path,
        {**cal, "machine_probe_per_core": cal_probe}, steps, warmup, _machine_probe.Sides.SERVERS)
    return p["predicted"], p["machine"].servers

  key = "during_probe_per_core"
  if key in done.info and key in cal:  # the probe during the run and during the calibration
    out["predicted_during_probe"], out["during_probe_speed"] = probed(done.info[key], cal[key])
    steal = [100 * float(np.mean([x.get("steal_per_core", {}).get(str(c), np.nan)
                                  for c in server_cores(cal)])) for x in (done.info, cal)]
    out["line"].append(("during_probe", f"the probe during the run (since pass AU; "
                        f"x{out['during_probe_speed']:.3f} on the servers; their cores' steal "
                        f"{steal[0]:.1f}% of the run's time, {steal[1]:.1f}% of the "
                        "calibration's)"))
  if pools is not None and all(pools):
    key = "machine_probe_per_core"
    out["predicted_pooled_probe"], out["pooled_probe_speed"] = probed(pools[0][key], pools[1][key])
    out["line"].append(("pooled_probe", f"the regime's pooled probes "
                        f"(x{out['pooled_probe_speed']:.3f} on the servers)"))
  predict = predictor(done, path, cal, steps, warmup)
  if rule["unfloored"] is not None:  # the rule until 2026-11-29 (`trainer_floor` says why)
    out["predicted_unfloored"] = mean_samples_per_s(rule["unfloored"].results)
    out["line"].append(("unfloored", f"the trainer's contention factor "
                        f"x{rule['unfloored'].slowdown.trainer:.2f} not floored at 1"))
  rounds = cal["rollout"].get("rounds", {})
  if done.layout == "sync" and "latency_s" in rounds:  # since 2026-11-29 (`round_latency_s`)
    ro = {**cal["rollout"], "latency_s": rounds["latency_s"]}
    out["predicted_rounds_latency"] = predicted_samples_per_s(
        done, path, {**cal, "rollout": ro}, steps, warmup, sides)["predicted"]
    out["line"].append(("rounds_latency", f"the sync rounds' latency {ro['latency_s'] * 1e3:.1f}"
                        f" ms, not the decode batches' {cal['rollout']['latency_s'] * 1e3:.1f} ms"))
  if done.layout != "sync" and "beside_rollout" in cal["trainer"]:
    servers = Contention(rule["slowdown"].servers, 1.0)
    results, factor = shared_core_prediction(
        cal, done.info["contention"]["trainer"],
        lambda interference: predict(servers, interference), Overlap.of(rule["results"]))
    out.update(predicted_shared_core=mean_samples_per_s(results), shared_core_train_factor=factor)
    out["line"].append(("shared_core", f"the train step's factor beside rollout from its core's "
                        f"sharing x{factor:.2f} (calibrated "
                        f"x{cal['interference']['train_beside_rollout']:.2f})"))
  return out


def ensure_model(config_path: str) -> None:
  """The project's warm-started benchmark models are built on first use (by the train entry)."""
  code = ("import sys; from experiments import train, _calibration; "
          "train.ensure_model(_calibration.load_config(sys.argv[1]))")
  subprocess.run([sys.executable, "-c", code, config_path], check=True)


def calibrate_layout(path: str, regime: str, layout: str, out: str, suffix: str,
                     probe: _machine_probe.MachineProbe | None = None) -> dict:
  """Calibrates one layout of `regime` (with `probe`, the machine probed just before and after),
  saves the calibration beside the runs, prints its numbers and returns it with its wall-clock
  midpoint (`time_mid`, seconds)."""
  before = probe.measure() if probe is not None else None
  start = time.time()
  with (probe.during(train_cores=_calibration.train_cores(path, layout, _split()))
        if probe is not None else contextlib.nullcontext({})) as during:
    cal = _calibration.calibrate(path, layout, reps=_REPS.value,
                                 log_dir=calibration_stem(out, regime, layout, suffix),
                                 split=_split() if layout == "async" else None)
  cal["time_mid"] = (start + time.time()) / 2
  if probe is not None:
    cal.update(_machine_probe.around(before, probe.measure()), **during)
  with open(calibration_stem(out, regime, layout, suffix) + ".json", "w") as f:
    json.dump(cal, f, indent=1)
  print(f"{regime} calibration{suffix.replace('_', ' ')} ({layout} layout, "
        f"{_calibration.describe(cal)}", flush=True)
  return cal


def measure_regime(path: str, regime: str, out: str, steps: int, warmup: int
                   ) -> tuple[dict[str, dict], list[MeasuredRun], dict[str, dict]]:
  """Calibrates both layouts, runs every mode `--repeats` times, calibrates again (`--bracket`):
  (the first calibrations, the runs, the second calibrations) by layout."""
  ensure_model(path)
  with contextlib.ExitStack() as stack:
    probe = (stack.enter_context(_machine_probe.MachineProbe(
        _calibration.load_config(path), os.path.join(out, f"{regime}_probe_servers")))
        if _PROBE.value else None)
    first = {layout: calibrate_layout(path, regime, layout, out, "", probe)
             for layout in LAYOUTS}
    # Repeats run every mode back to back, reversed on odd repeats (as async_vs_sync
    # interleaves), so a change of the machine's speed meets every mode alike.
    done = []
    for repeat in range(_REPEATS.value):
      modes = _MODES.value if repeat % 2 == 0 else _MODES.value[::-1]
      done += [measure_mode(path, regime, mode, repeat, out, steps, warmup, probe)
               for mode in modes]
    # The second calibrations, after the runs, in reverse order (each layout's two then sit
    # about as far on either side of its runs).
    second = ({layout: calibrate_layout(path, regime, layout, out, "_after", probe)
               for layout in reversed(LAYOUTS)} if _BRACKET.value else {})
  return first, done, second


def main(argv):
  del argv
  _children.unwind_on_sigterm()
  source = _REPREDICT.value
  out = source or _OUT.value or tempfile.mkdtemp(prefix="sim_vs_measured_")
  os.makedirs(out, exist_ok=True)
  sides = _machine_probe.Sides(_SIDES.value)
  print(f"runs and calibrations {'read from' if source else 'in'} {out} ({os.cpu_count()} "
        f"cores); the machine probe rescales: {sides.value}", flush=True)
  rows, summaries = [], []
  for regime in _REGIMES.value:
    path, steps, warmup = REGIMES.get(regime, (regime, 16, 4))
    steps = _STEPS.value or steps
    warmup = warmup if _WARMUP.value is None else _WARMUP.value
    if not os.path.exists(path):
      print(f"{regime}: {path} does not exist, skipped", flush=True)
      continue
    if source:  # a pass's saved runs and calibrations, predicted again: nothing runs
      first, done = saved_calibrations(source, regime, ""), saved_runs(source, regime, _MODES.value)
      second = saved_calibrations(source, regime, "_after") if _BRACKET.value else {}
      if not done or any(run.layout not in first for run in done):
        print(f"{regime}: no saved runs with their calibrations in {source}, skipped", flush=True)
        continue
    else:
      first, done, second = measure_regime(path, regime, out, steps, warmup)
    pools = (_machine_probe.pooled([run.info for run in done]),
             _machine_probe.pooled([*first.values(), *second.values()]))
    for measured_run in done:
      layout = measured_run.layout
      if layout not in second:
        rows.append(predict_row(measured_run, path, first[layout], steps, warmup, sides=sides,
                                pools=pools))
        continue
      weight = _calibration_fits.bracket_weight(
          measured_run.start, measured_run.end, first[layout]["time_mid"],
          second[layout]["time_mid"])
      cal = _calibration_fits.blended(first[layout], second[layout], weight)
      rows.append(predict_row(measured_run, path, cal, steps, warmup, weight=weight,
                              first=first[layout], sides=sides, pools=pools))
    if any(run.repeat for run in done):  # repeats: each mode's medians too
      for mode in _MODES.value:
        name = mode_name(mode)
        mine = [r for r in rows if r["regime"] == regime and r["mode"] == name]
        if not mine:
          continue
        got = float(np.median([r["measured"] for r in mine]))
        want = float(np.median([r["predicted"] for r in mine]))
        summaries.append({"regime": regime, "mode": name, "measured_median": got,
                          "predicted_median": want, "error": abs(want - got) / got})
        print(f"{regime:>9} {name:<10} median of {len(mine)} runs: measured {got:7.2f} samples/s "
              f"(runs {min(r['measured'] for r in mine):.1f}-"
              f"{max(r['measured'] for r in mine):.1f}) | predicted {want:7.2f} "
              f"(error {abs(want - got) / got:5.1%})", flush=True)
  results = f"results_repredicted_{sides.value}.json" if source else "results.json"
  with open(os.path.join(out, results), "w") as f:
    json.dump({"runs": rows, "medians": summaries}, f, indent=1)
  if not rows:
    raise app.UsageError("no regime could be run")
  if summaries:
    print(f"sim_error_max_of_medians: {max(r['error'] for r in summaries):.3f}")
  print(f"sim_error_max_unseen: {max(r['error'] for r in rows):.3f}")


if __name__ == "__main__":
  app.run(main)
