"""Launch RL runs one at a time as subprocesses, and turn their `metrics.jsonl` into table rows.

Why a subprocess per run: every run starts its own rollout servers and pins itself and them to
cores (`os.sched_setaffinity`), compiles its own programs and holds its own JAX runtime; running
each in a fresh process keeps runs independent and lets a sweep survive one run crashing. Why
runs are sequential: the machine has 2 cores, so two runs at once would measure each other.

A run is a `RunSpec`: the demo config file plus overrides (mode, α, loss preset, sizes, seed).
`python -m experiments._runs SPEC.json` is the child: it builds the `RunConfig`, calls
`flashrl_jax.controller.run` and writes the run's own plots. A finished run (with `summary.json`)
is skipped when a sweep is re-run, so an interrupted sweep resumes where it stopped; an unfinished
one is wiped and started again (a half run would mix two start-ups into its throughput).

All children share a persistent JAX compilation cache (`.cache/jax_compilation`), so only the
first run of a shape pays compilation; start-up is excluded from the steady-state numbers anyway.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np

COMPILATION_CACHE = ".cache/jax_compilation"


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One run: `overrides` are RunConfig fields (nested dicts replace inside nested configs), plus
  `loss` (a whole LossConfig as a dict: its own defaults) and `optimizer` (in `train`)."""

  name: str
  overrides: dict[str, Any]
  config: str = "experiments/configs/demo.py"

  def command(self) -> str:
    """The equivalent `experiments.train` command line where flags can express it."""
    o = dict(self.overrides)
    flags = []
    for key in ("mode", "async_ratio", "steps", "batch_size", "group_size", "seed"):
      if key in o:
        flags.append(f"--{key}={o[key]}")
    if "loss" in o:
      flags.append(f"--loss={o['loss']['name']}")
    for key, flag in (("num_servers", "num_rollout_servers"),
                      ("max_running_requests", "max_running_requests")):
      if key in o.get("rollout", {}):
        flags.append(f"--{flag}={o['rollout'][key]}")
    for key in ("rollout_devices", "train_devices"):
      if key in o.get("resources", {}):
        flags.append(f"--{key}={o['resources'][key]}")
    if "learning_rate" in o.get("optimizer", {}):
      flags.append(f"--learning_rate={o['optimizer']['learning_rate']}")
    command = f"python -m experiments.train --config={self.config} " + " ".join(flags)
    rest = {k: v for k, v in o.get("loss", {}).items() if k != "name"}
    extra = {**({"loss": rest} if rest else {}),
             **{k: o[k] for k in ("task", "agentic", "train") if k in o}}
    if extra:  # not (all) expressible as train.py flags
      command += f"  # and {json.dumps(extra, ensure_ascii=False)}"
    return command


def _replace(obj, changes: dict):
  """`dataclasses.replace`, recursing into nested dataclasses for dict values."""
  updates = {}
  for key, value in changes.items():
    current = getattr(obj, key)
    nested = isinstance(value, dict) and dataclasses.is_dataclass(current)
    updates[key] = _replace(current, value) if nested else value
  return dataclasses.replace(obj, **updates)


def build_config(spec: RunSpec, workdir: str):
  """The spec's `RunConfig` (imports the library: call in the child, not in a flag-parsing parent).

  Overrides replace fields, recursively for nested configs (`{"task": {"env": {...}}}`); `loss` is
  a whole `LossConfig` (its own defaults, not the base config's), `optimizer` is `train.optimizer`.
  """
  from experiments.train import load_config_file
  from flashrl_jax.losses import LossConfig
  config = load_config_file(spec.config)
  o = dict(spec.overrides)
  train = dict(o.pop("train", {}))
  if "loss" in o:
    train["loss"] = LossConfig(**o.pop("loss"))
  if "optimizer" in o:
    train["optimizer"] = o.pop("optimizer")
  if train:
    o["train"] = train
  if o.get("mode") == "sync":
    o.setdefault("async_ratio", 0)
  return _replace(config, {**o, "workdir": workdir, "plot": True})


def _child(spec_path: str) -> None:
  from experiments.train import ensure_model
  from flashrl_jax.controller import run
  from flashrl_jax.controller._plot import plot_run
  with open(spec_path) as f:
    raw = json.load(f)
  spec = RunSpec(raw["name"], raw["overrides"], raw["config"])
  config = build_config(spec, os.path.dirname(os.path.abspath(spec_path)))
  ensure_model(config)
  load_before, cores = os.getloadavg(), len(os.sched_getaffinity(0))
  summary = run(config)
  plot_run(summary.workdir)
  _write_run_info(config, summary.workdir, load_before, cores)
  print(f"run {spec.name}: {summary.samples_per_s:.2f} samples/s, {summary.wall_s:.1f}s")


def _code_version() -> dict:
  """The commit the run used, and the library files that differed from it (others commit while
  a sweep runs; a cell that ran on other code must be visible)."""
  def git(*args):
    return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()
  return {"git_commit": git("rev-parse", "HEAD"),
          "git_dirty": [line[3:] for line in git("status", "--porcelain", "flashrl_jax").splitlines()]}


def _write_run_info(config, workdir: str, load_before, cores: int) -> None:
  """What the simulator's calibration needs that metrics.jsonl lacks, and the machine's load."""
  from flashrl_jax.controller import PromptSource
  from flashrl_jax.model import load_tokenizer
  prompts = [0.0]
  if config.task.synthetic is not None:  # environment tasks have no fixed prompt set
    tokenizer = load_tokenizer(config.model_path)
    source = PromptSource(synthetic=config.task.synthetic, seed=config.task.seed)
    prompts = [len(tokenizer.encode(source.sample(i).prompt)) for i in range(64)]
  info = {"prompt_tokens_mean": float(np.mean(prompts)), "loadavg_before": load_before,
          "loadavg_after": os.getloadavg(), "cores": cores,
          "max_new_tokens": config.rollout.max_new_tokens,
          "pause_mode": config.rollout.pause_mode.value, **_code_version()}
  with open(os.path.join(workdir, "run_info.json"), "w") as f:
    json.dump(info, f, indent=1)


@dataclasses.dataclass
class RunResult:
  spec: RunSpec
  workdir: str
  records: list[dict]
  summary: dict
  ok: bool
  info: dict = dataclasses.field(default_factory=dict)


def load_records(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _watch(child: subprocess.Popen, workdir: str, *, timeout_s: float, stall_s: float,
           log) -> int | str:
  """Waits for the child; stops it (and its rollout servers) past `timeout_s`, or when no step
  has been logged for `stall_s` (a hung run must not block the rest of a sweep)."""
  metrics = os.path.join(workdir, "metrics.jsonl")
  start = last_change = time.monotonic()
  last_size = -1
  while child.poll() is None:
    time.sleep(2.0)
    size = os.path.getsize(metrics) if os.path.exists(metrics) else 0
    now = time.monotonic()
    if size != last_size:
      last_size, last_change = size, now
    reason = ("timeout" if now - start > timeout_s else
              "stalled" if now - last_change > stall_s else None)
    if reason:
      log(f"[{os.path.basename(workdir)}] {reason}: no step logged for {now - last_change:.0f}s; "
          "stopping it")
      child.terminate()
      try:
        child.wait(15)
      except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
      _stop_servers(workdir)
      return reason
  return child.returncode


def _stop_servers(workdir: str) -> None:
  """SIGTERMs the rollout servers a stopped run recorded in `server_pids.json` (if still ours)."""
  path = os.path.join(workdir, "server_pids.json")
  if not os.path.exists(path):
    return
  with open(path) as f:
    pids = [int(entry["pid"]) for entry in json.load(f)]
  for pid in pids:
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if b"flashrl_jax.rollout" not in f.read():
          continue  # the pid was reused by something else
      os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
      pass


def launch(spec: RunSpec, out_dir: str, *, timeout_s: float = 1800, stall_s: float = 600,
           rerun: bool = False, log=print) -> RunResult:
  """Runs `spec` in `out_dir/spec.name` (or reuses a finished run there)."""
  workdir = os.path.abspath(os.path.join(out_dir, spec.name))
  summary_path = os.path.join(workdir, "summary.json")
  if os.path.exists(summary_path) and not rerun:
    log(f"[{spec.name}] finished earlier, reusing {workdir}")
  else:
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    spec_path = os.path.join(workdir, "spec.json")
    with open(spec_path, "w") as f:
      json.dump({**dataclasses.asdict(spec), "command": spec.command()}, f, indent=1)
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.path.abspath(COMPILATION_CACHE),
               JAX_PLATFORMS="cpu")
    log(f"[{spec.name}] {spec.command()}")
    start = time.perf_counter()
    with open(os.path.join(workdir, "run.log"), "w") as out:
      child = subprocess.Popen([sys.executable, "-m", "experiments._runs", spec_path],
                               stdout=out, stderr=subprocess.STDOUT, env=env)
      rc = _watch(child, workdir, timeout_s=timeout_s, stall_s=stall_s, log=log)
    log(f"[{spec.name}] rc={rc} in {time.perf_counter() - start:.0f}s")
  summary = {}
  if os.path.exists(summary_path):
    with open(summary_path) as f:
      summary = json.load(f)
  info = {}
  if os.path.exists(os.path.join(workdir, "run_info.json")):
    with open(os.path.join(workdir, "run_info.json")) as f:
      info = json.load(f)
  return RunResult(spec, workdir, load_records(workdir), summary, bool(summary), info)


def run_all(specs: list[RunSpec], out_dir: str, **kwargs) -> list[RunResult]:
  return [launch(spec, out_dir, **kwargs) for spec in specs]


# --- analysis ----------------------------------------------------------------------------------


def moving_average(values, window: int = 11) -> np.ndarray:
  """Trailing moving average, the paper's 11-step smoothing (shorter at the start)."""
  values = np.asarray(values, np.float64)
  return np.array([values[max(0, i - window + 1):i + 1].mean() for i in range(len(values))])


def steady_throughput(records: list[dict], warmup: int) -> float:
  """Samples/s over the steps after `warmup` (start-up, compilation and the pre-filled buffer of
  an async run are excluded): trained samples / wall of those steps."""
  rest = records[warmup:] or records
  wall = sum(r["time/step_s"] for r in rest)
  return sum(r["num_samples"] for r in rest) / wall if wall > 0 else float("nan")


def warmup_steps(records: list[dict], async_ratio: int) -> int:
  """Step 1 compiles; an async run then eats the α batches generated during compilation."""
  return min(async_ratio + 2, max(len(records) - 3, 0))


EVAL = "eval/expected_accuracy"


def eval_curve(records: list[dict]) -> tuple[list[int], list[float]]:
  """(steps, values) of the exact held-out evaluation; step 0 is the initial policy."""
  steps, values = [], []
  if records and "eval/initial_expected_accuracy" in records[0]:
    steps.append(0)
    values.append(float(records[0]["eval/initial_expected_accuracy"]))
  for r in records:
    if EVAL in r:
      steps.append(int(r["step"]))
      values.append(float(r[EVAL]))
  return steps, values


def summarize(result: RunResult, *, threshold: float, window: int = 11) -> dict[str, Any]:
  """One table row. Quality: the exact expected accuracy on held-out prompts (`eval/...`, every
  few steps; noise-free) and the 11-step moving average of the training accuracy (noisy, and in
  async mode measured on samples of older policies). `steps_to_threshold`: first evaluation at or
  above `threshold`. Throughput: steady state (see `steady_throughput`) and median-step based."""
  r = result.records
  spec = result.spec.overrides
  alpha = int(spec.get("async_ratio", 0)) if spec.get("mode") != "sync" else 0
  row: dict[str, Any] = {"run": result.spec.name, "ok": result.ok, "steps": len(r)}
  if not r:
    return row
  acc = moving_average([x["accuracy"] for x in r], window)
  cumulative = np.cumsum([x["time/step_s"] for x in r])
  eval_steps, eval_values = eval_curve(r)
  hit = next((s for s, v in zip(eval_steps, eval_values) if s > 0 and v >= threshold), None)
  warm = warmup_steps(r, alpha)
  rest = r[warm:] or r
  row.update({
      "final_accuracy": float(acc[-1]),
      "initial_eval": eval_values[0] if eval_steps and eval_steps[0] == 0 else None,
      "final_eval": eval_values[-1] if eval_values else None,
      "best_eval": max(eval_values) if eval_values else None,
      "steps_to_threshold": hit,
      "time_to_threshold_s": None if hit is None else float(cumulative[hit - 1]),
      "wall_s": float(result.summary.get("wall_s", cumulative[-1])),
      "train_wall_s": float(cumulative[-1]),
      "samples_per_s_e2e": float(result.summary.get("samples_per_s", float("nan"))),
      "samples_per_s_steady": steady_throughput(r, warm),
      # Robust to the other tenants of this machine: a 10 s stall of a neighbour's job lands in
      # one step's wall time and moves the mean, not the median.
      "samples_per_s_median": float(np.median([x["num_samples"] for x in rest]) /
                                    np.median([x["time/step_s"] for x in rest])),
      "warmup_steps": warm,
      "step_s_median": float(np.median([x["time/step_s"] for x in rest])),
      "pause_s_mean": float(np.mean([x.get("time/pause_s", 0.0) for x in rest])),
      "train_s_mean": float(np.mean([x["time/train_s"] for x in rest])),
      "wait_data_s_mean": float(np.mean([x.get("time/wait_data_s", 0.0) for x in rest])),
      "staleness_mean": float(np.mean([x.get("staleness_mean", 0.0) for x in r])),
      "staleness_max": int(max(x.get("staleness_max", 0) for x in r)),
      "dropped_stale": int(result.summary.get("counters", {}).get("dropped_stale", 0)),
      "response_length_mean": float(np.mean([x["response_length_mean"] for x in r])),
      # Response tokens trained per second: samples/s can rise just by training shorter samples.
      "tokens_per_s_median": float(np.median([x["num_samples"] * x["response_length_mean"]
                                              for x in rest]) /
                                   np.median([x["time/step_s"] for x in rest])),
      "loadavg": result.info.get("loadavg_before", [None])[0],
  })
  if row["final_eval"] is not None and row["initial_eval"] is not None:
    row["eval_gain"] = row["final_eval"] - row["initial_eval"]
  return row


def mean_over_seeds(summaries: list[dict]) -> dict[str, Any]:
  """One row from the seeds of a cell: numeric means, `<key>_std` for the quality metrics, and
  for steps/time to threshold the median over the seeds that reached it (None if half did not)."""
  ok = [s for s in summaries if s.get("ok") and "samples_per_s_steady" in s]
  row: dict[str, Any] = {"seeds": len(ok)}
  if not ok:
    return row
  for key, value in ok[0].items():
    if key in ("steps_to_threshold", "time_to_threshold_s"):
      hits = sorted(s[key] for s in ok if s.get(key) is not None)
      row[key] = hits[len(hits) // 2] if 2 * len(hits) > len(ok) else None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      values = [s[key] for s in ok if isinstance(s.get(key), (int, float))]
      row[key] = float(np.mean(values))
      if key in ("final_eval", "final_accuracy", "eval_gain") and len(values) > 1:
        row[f"{key}_std"] = float(np.std(values))
  return row


def fmt(value: Any, digits: int = 3) -> str:
  if value is None:
    return "—"
  if isinstance(value, bool):
    return "yes" if value else "no"
  if isinstance(value, float):
    return "nan" if math.isnan(value) else f"{value:.{digits}g}"
  return str(value)


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
  """`columns`: (key, header) pairs; missing keys print as —."""
  lines = ["| " + " | ".join(h for _, h in columns) + " |",
           "|" + "---|" * len(columns)]
  for row in rows:
    lines.append("| " + " | ".join(fmt(row.get(k)) for k, _ in columns) + " |")
  return "\n".join(lines)


def write_table(rows: list[dict], columns: list[tuple[str, str]], out_dir: str, name: str,
                extra: dict | None = None) -> str:
  """Writes `name.md` and `name.json` under `out_dir`; returns the markdown."""
  os.makedirs(out_dir, exist_ok=True)
  table = markdown_table(rows, columns)
  with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
    json.dump({"rows": rows, **(extra or {})}, f, indent=1, default=str)
  return table


if __name__ == "__main__":
  _child(sys.argv[1])
