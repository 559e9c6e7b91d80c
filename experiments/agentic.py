"""Agentic (ROLL Flash §4.3, Fig. 11): env-level async and redundant env rollout vs the
synchronous lock-step environment loop, with long-tailed environment latency and injected failures.

Full training runs of `experiments/configs/agentic.py` (multi-turn FrozenLake, the demo's tiny
policy on our JAX servers, the real trainer and weight handoff), with what `flashrl_jax.controller`
provides (`_agentic.py`): sync lock-step (n candidates per group), env-level async (n candidates),
async + redundant (`--redundant_candidates` per group of n). Environment steps: lognormal latency
with a 10x tail, `--fail_slow_prob` steps another 10x slower, `--fail_stop_prob` raise. What the 2
cores measure here includes their contention: generation of the real model competes with
everything else on the machine. The throughput benchmark with long-tail levels is
`experiments.benchmarks.agentic_async_vs_sync`.

  python -m experiments.agentic --out=runs/agentic     # about 10 min here
"""

from __future__ import annotations

import json
import os
import shutil

from absl import app, flags

from experiments import _children, _runs, _summary, plots

_OUT = flags.DEFINE_string("out", "runs/agentic", "Directory of the experiment.")
_CONFIG = flags.DEFINE_string("config", "experiments/configs/agentic.py", "Agentic RunConfig.")
_STEPS = flags.DEFINE_integer("steps", 10, "Training steps per run.")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds.")
_REDUNDANT = flags.DEFINE_integer("redundant_candidates", 3,
                                  "Candidates per group in the redundant variant (> n).")
_SLOW = flags.DEFINE_float("fail_slow_prob", 0.05, "P(an env step takes another 10x).")
_STOP = flags.DEFINE_float("fail_stop_prob", 0.02, "P(an env step raises).")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 1800, "Per-run time limit.")
_RERUN = flags.DEFINE_bool("rerun", False, "Re-run finished runs.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the runs and exit.")
_DOCS = flags.DEFINE_string("docs_dir", None, "Also copy the figure here.")

VARIANTS = ("sync", "async", "async_redundant")


def make_specs(steps: int, seeds, redundant: int, slow: float, stop: float,
               config: str) -> list[_runs.RunSpec]:
  failure = {"task.env.failure.slow_prob": slow, "task.env.failure.stop_prob": stop}
  specs = []
  for variant in VARIANTS:
    o = {"steps": steps, **failure}
    if variant == "sync":
      o.update({"mode": "sync", "agentic.env_group_size": 0})  # 0 = n: no redundancy
    elif variant == "async":
      o.update({"mode": "async", "agentic.env_group_size": 0})
    else:
      o.update({"mode": "async", "agentic.env_group_size": redundant})
    for seed in seeds:
      specs.append(_runs.RunSpec(f"{variant}_s{seed}", {**o, "seed": int(seed)}, config))
  return specs


COLUMNS = [("variant", "variant"), ("seeds", "seeds"),
           ("samples_per_s_median", "episodes/s (median step)"),
           ("samples_per_s_steady", "episodes/s (steady mean)"),
           ("samples_per_s_e2e", "episodes/s (whole run)"), ("speedup", "speedup (median)"),
           ("step_s_median", "median step (s)"), ("dropped", "episodes dropped (by cause)")]


def dropped(records: list[dict]) -> dict[str, int]:
  last = records[-1] if records else {}
  return {k.rsplit("/", 1)[-1]: int(v) for k, v in last.items()
          if k.startswith("total/episodes_dropped/") and v}


def main(argv):
  del argv
  _children.unwind_on_sigterm()
  specs = make_specs(_STEPS.value, _SEEDS.value, _REDUNDANT.value, _SLOW.value, _STOP.value,
                     _CONFIG.value)
  results = _runs.run_or_print(specs, _OUT.value, dry_run=_DRY_RUN.value, timeout_s=_TIMEOUT.value,
                               rerun=_RERUN.value)
  if results is None:
    return
  rows = []
  for variant in VARIANTS:
    runs = [r for r in results if _summary.cell_of(r.spec.name) == variant and r.records]
    if runs:
      row = {"variant": variant,
             **_summary.mean_over_seeds([_summary.summarize(r, threshold=1.0) for r in runs])}
      row["dropped"] = json.dumps(dropped(runs[0].records))
      rows.append(row)
  base = next((r for r in rows if r["variant"] == "sync"), None)
  for row in rows:
    if base and base.get("samples_per_s_median"):
      row["speedup"] = row["samples_per_s_median"] / base["samples_per_s_median"]
  table = _summary.write_table(rows, COLUMNS, _OUT.value, "summary",
                            {"fail_slow_prob": _SLOW.value,
                             "fail_stop_prob": _STOP.value,
                             "commands": {s.name: s.command() for s in specs}})
  path = plots.bars_figure([r["variant"] for r in rows],
                           {"median step": [r["samples_per_s_median"] for r in rows],
                            "steady mean": [r["samples_per_s_steady"] for r in rows]},
                           os.path.join(_OUT.value, "throughput.png"), ylabel="episodes / s",
                           title="agentic FrozenLake: lock-step sync vs env-level async")
  if _DOCS.value:
    os.makedirs(_DOCS.value, exist_ok=True)
    shutil.copy(path, os.path.join(_DOCS.value, "agentic.png"))
  print(table)


if __name__ == "__main__":
  app.run(main)
