"""Resource split (ROLL Flash Fig. 3a): for a fixed device budget, how many go to rollout and how
many to training, and where the optimum lies.

Two sweeps, both async α = 2 on the repeat task, plus the sync baseline on the whole budget:

  split  every R + T = `--total_devices` with R, T >= 1 (R rollout cores running
         `--servers_per_device` servers each, T trainer cores). On CPU a device is a core.
  proxy  at one split, the rollout side's capacity: servers × decode slots per server.

On this 2-core machine the only split is 1 + 1, so the split sweep is a single run and the
optimum cannot be measured here; the proxy sweep (what the rollout core is asked to run) is the
closest thing this machine can vary, and it is not the same experiment: it moves the rollout /
train balance by changing the rollout's parallelism, not its hardware. For the paper-scale split
use the simulator (`python -m experiments.simulate --tables=split`, docs/simulator.md).

  python -m experiments.resource_split --out=runs/resource_split          # about 12 min here
  python -m experiments.resource_split --total_devices=8 --proxy=false    # a bigger CPU machine
"""

from __future__ import annotations

import os
import shutil

from absl import app, flags

from experiments import _children, _runs, _summary, plots

_OUT = flags.DEFINE_string("out", "runs/resource_split", "Directory of the sweep.")
_CONFIG = flags.DEFINE_string("config", "experiments/configs/repeat.py", "Base RunConfig file.")
_TOTAL = flags.DEFINE_integer("total_devices", None, "Device budget (default: this process's "
                              "cores).")
_PER_DEVICE = flags.DEFINE_integer("servers_per_device", 2, "Rollout servers per rollout core.")
_ALPHA = flags.DEFINE_integer("async_ratio", 2, "α of the async runs.")
_PROXY = flags.DEFINE_bool("proxy", True, "Also sweep servers × slots at the first split.")
_SERVERS = flags.DEFINE_list("proxy_servers", ["1", "2"], "Proxy sweep: rollout servers.")
_SLOTS = flags.DEFINE_list("proxy_slots", ["8", "16"], "Proxy sweep: decode slots per server.")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds.")
_STEPS = flags.DEFINE_integer("steps", 30, "Training steps per run.")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 1800, "Per-run time limit.")
_RERUN = flags.DEFINE_bool("rerun", False, "Re-run finished runs.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the runs and exit.")
_DOCS = flags.DEFINE_string("docs_dir", None, "Also copy the figure here.")


def make_specs(total: int, per_device: int, alpha: int, proxy: bool, servers, slots, seeds,
               steps: int, config: str) -> list[_runs.RunSpec]:
  specs, seen = [], set()

  def add(name, overrides):
    key = tuple(sorted((k, str(v)) for k, v in overrides.items()))
    if key not in seen:  # the proxy sweep's default cell is also a split cell
      seen.add(key)
      for seed in seeds:
        o = {"steps": steps, "seed": int(seed), "task.seed": int(seed) + 1, **overrides}
        specs.append(_runs.RunSpec(f"{name}_s{seed}", o, config))

  add(f"sync_{total}", {"mode": "sync", "rollout.num_servers": total})
  for r in range(1, total):
    add(f"split_{r}+{total - r}", {
        "mode": "async", "async_ratio": alpha,
        "resources.rollout_devices": r, "resources.train_devices": total - r,
        "rollout.num_servers": r * per_device})
  if proxy and total >= 2:
    for k in map(int, servers):
      for s in map(int, slots):
        add(f"proxy_{k}x{s}", {
            "mode": "async", "async_ratio": alpha,
            "resources.rollout_devices": 1, "resources.train_devices": total - 1,
            "rollout.num_servers": k, "rollout.max_running_requests": s})
  return specs


COLUMNS = [("run", "run"), ("rollout_devices", "rollout cores"), ("train_devices", "train cores"),
           ("servers", "servers"), ("slots", "slots/server"),
           ("samples_per_s_median", "samples/s (median step)"),
           ("samples_per_s_steady", "samples/s (steady mean)"), ("wait_data_s_mean", "wait s/step"),
           ("train_s_mean", "train s/step"), ("pause_s_mean", "pause s/step"),
           ("final_eval", "eval acc. final"), ("staleness_mean", "mean staleness")]


def row_for(results, name: str, threshold: float = 0.6) -> dict:
  runs = [r for r in results if _summary.cell_of(r.spec.name) == name]
  o = runs[0].spec.overrides
  cores = runs[0].info.get("cores")
  row = {"run": name,
         "rollout_devices": o.get("resources.rollout_devices", cores),
         "train_devices": o.get("resources.train_devices", cores),
         "servers": o.get("rollout.num_servers"),
         "slots": o.get("rollout.max_running_requests", "config"),
         **_summary.mean_over_seeds([_summary.summarize(r, threshold=threshold) for r in runs])}
  return row


def main(argv):
  del argv
  _children.unwind_on_sigterm()
  total = _TOTAL.value or len(os.sched_getaffinity(0))
  specs = make_specs(total, _PER_DEVICE.value, _ALPHA.value, _PROXY.value, _SERVERS.value,
                     _SLOTS.value, _SEEDS.value, _STEPS.value, _CONFIG.value)
  results = _runs.run_or_print(specs, _OUT.value, dry_run=_DRY_RUN.value, timeout_s=_TIMEOUT.value,
                               rerun=_RERUN.value)
  if results is None:
    return
  names = list(dict.fromkeys(_summary.cell_of(s.name) for s in specs))
  rows = [row_for(results, name) for name in names]
  rows = [r for r in rows if r["seeds"]]
  table = _summary.write_table(rows, COLUMNS, _OUT.value, "summary",
                            {"total_devices": total,
                             "commands": {s.name: s.command() for s in specs}})
  path = plots.bars_figure(
      [r["run"] for r in rows], {"median step": [r["samples_per_s_median"] for r in rows],
                                 "steady mean": [r["samples_per_s_steady"] for r in rows]},
      os.path.join(_OUT.value, "throughput.png"), ylabel="samples / s",
      title=f"{total} devices: split R+T and rollout capacity (servers x slots)")
  if _DOCS.value:
    os.makedirs(_DOCS.value, exist_ok=True)
    shutil.copy(path, os.path.join(_DOCS.value, "resource_split.png"))
  print(table)


if __name__ == "__main__":
  app.run(main)
