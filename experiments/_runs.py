"""Launch RL runs one at a time as subprocesses, and turn their `metrics.jsonl` into table rows.

Why a subprocess per run: every run starts its own rollout servers and pins itself and them to
cores (`os.sched_setaffinity`), compiles its own programs and holds its own JAX runtime; running
each in a fresh process keeps runs independent and lets a sweep survive one run crashing. Why
runs are sequential: the machine has 2 cores, so two runs at once would measure each other.

A run is a `RunSpec`: a config file plus overrides of its fields by dotted path, the same mechanism
and the same names as the `experiments.train` command line (`RunSpec.command()` prints it).
`python -m experiments._runs SPEC.json` is the child: it builds the `RunConfig`, calls
`flashrl_jax.controller.run` and writes the run's own plots. A finished run (with `summary.json`)
is skipped when a sweep is re-run, so an interrupted sweep resumes where it stopped; an unfinished
one is wiped and started again (a half run would mix two start-ups into its throughput).

What the runs mean (throughput, quality, tables) is computed in `_summary.py`.

All children share a persistent JAX compilation cache (`.cache/jax_compilation`), so only the
first run of a shape pays compilation; start-up is excluded from the steady-state numbers anyway.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np

from experiments import _children
from experiments._cli import flag_of, load_config_file

COMPILATION_CACHE = ".cache/jax_compilation"


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One run: `overrides` maps dotted `RunConfig` field paths to values, exactly what
  `experiments.train` flags set (`{"rollout.num_servers": 2, "train.loss": {"name": "ppo"}}`; a
  dict is a whole new section with its own defaults)."""

  name: str
  overrides: dict[str, Any]
  config: str = "experiments/configs/repeat.py"

  def command(self) -> str:
    """The equivalent `experiments.train` command line."""
    flags = []
    for path, value in self.overrides.items():
      flag = flag_of(path)
      if isinstance(value, dict):
        flags.append(f"'--set={path}={json.dumps(value)}'")
      elif isinstance(value, (list, tuple)):
        flags.append(f"--{flag}={','.join(map(str, value))}" if flag else
                     f"--set={path}={','.join(map(str, value))}")
      elif isinstance(value, bool) and flag:
        flags.append(f"--{'' if value else 'no'}{flag}")
      else:
        flags.append(f"--{flag}={value}" if flag else f"--set={path}={value}")
    return f"python -m experiments.train --config={self.config} " + " ".join(flags)


def build_config(spec: RunSpec, workdir: str):
  """The spec's `RunConfig`: its config file with the overrides applied through the same
  mechanism as the command line (imports the library: call in the child, not in a parent)."""
  from flashrl_jax.controller import override
  return override(load_config_file(spec.config),
                  {**spec.overrides, "workdir": workdir, "plot": True})


def _child(spec_path: str) -> None:
  _children.unwind_on_sigterm()  # stopped by `_watch`, the run stops its servers
  from experiments.train import ensure_model
  from flashrl_jax.controller import run
  from flashrl_jax.controller import plot_run
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
    return subprocess.run(["git", *args], capture_output=True, text=True).stdout
  # Porcelain lines are "XY path": strip only the newline, or the first path loses a letter.
  status = git("status", "--porcelain", "flashrl_jax").splitlines()
  return {"git_commit": git("rev-parse", "HEAD").strip(),
          "git_dirty": [line[3:] for line in status if line.strip()]}


def _write_run_info(config, workdir: str, load_before, cores: int) -> None:
  """What the simulator's calibration needs that metrics.jsonl lacks, and the machine's load."""
  from flashrl_jax.controller import task_source
  from flashrl_jax.model import load_tokenizer
  prompts = [0.0]
  if config.task.env is None:  # environment tasks have no fixed prompt set
    tokenizer = load_tokenizer(config.model_path)
    source = task_source(config)
    prompts = [len(tokenizer.encode(source.sample(i).prompt)) for i in range(64)]
  info = {"prompt_tokens_mean": float(np.mean(prompts)), "loadavg_before": load_before,
          "loadavg_after": os.getloadavg(), "cores": cores,
          "max_new_tokens": config.rollout.max_new_tokens,
          "pause_mode": config.rollout.pause_mode.value, **_code_version()}
  with open(os.path.join(workdir, "run_info.json"), "w") as f:
    json.dump(info, f, indent=1)


@dataclasses.dataclass
class RunResult:
  """A run's outcome. `ok`: it finished (wrote `summary.json`); otherwise `status` says why not
  ("stalled", "timeout", "rc=1", ...), which the tables print instead of averaging it away."""

  spec: RunSpec
  workdir: str
  records: list[dict]
  summary: dict
  ok: bool
  info: dict = dataclasses.field(default_factory=dict)
  status: str = "ok"


def load_records(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _watch(child: subprocess.Popen, workdir: str, *, timeout_s: float, stall_s: float,
           log) -> int | str:
  """Waits for the child; stops it (and its rollout servers) past `timeout_s`, or when no step
  has been logged for `stall_s` (a hung run must not block the rest of a sweep), or when this
  process is interrupted (Ctrl-C, SIGTERM under `_children.unwind_on_sigterm`)."""
  metrics = os.path.join(workdir, "metrics.jsonl")
  start = last_change = time.monotonic()
  last_size = -1
  try:
    while child.poll() is None:
      time.sleep(2.0)
      size = os.path.getsize(metrics) if os.path.exists(metrics) else 0
      now = time.monotonic()
      if size != last_size:
        last_size, last_change = size, now
      reason = ("timeout" if now - start > timeout_s else
                "stalled" if now - last_change > stall_s else None)
      if reason:
        log(f"[{os.path.basename(workdir)}] {reason}: no step logged for "
            f"{now - last_change:.0f}s; stopping it")
        _stop_run(child, workdir)
        return reason
  except BaseException:
    _stop_run(child, workdir)
    raise
  return child.returncode


def _stop_run(child: subprocess.Popen, workdir: str) -> None:
  _children.stop(child)
  _stop_servers(workdir)  # those of a child that had to be SIGKILLed


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
  rc: int | str = 0
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
  status = "ok" if summary else (rc if isinstance(rc, str) else f"rc={rc}, no summary")
  return RunResult(spec, workdir, load_records(workdir), summary, bool(summary), info, status)


def run_all(specs: list[RunSpec], out_dir: str, **kwargs) -> list[RunResult]:
  return [launch(spec, out_dir, **kwargs) for spec in specs]


def run_or_print(specs: list[RunSpec], out_dir: str, *, dry_run: bool, **kwargs
                 ) -> list[RunResult] | None:
  """An experiment's `--dry_run` edge: prints each run's command (returns None), or runs them all.

  Every spec's config is built first, so a misspelt field or a bad value in a sweep fails before
  any run starts (in a dry run too).
  """
  for spec in specs:
    build_config(spec, os.path.join(out_dir, spec.name))
  if dry_run:
    for spec in specs:
      print(f"{spec.name}: {spec.command()}")
    return None
  return run_all(specs, out_dir, **kwargs)


if __name__ == "__main__":
  _child(sys.argv[1])
