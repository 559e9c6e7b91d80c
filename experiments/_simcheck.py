"""Predicted vs measured throughput of a finished run, through `experiments.benchmarks.sim_vs_measured`.

Why here: the simulator's own benchmark needs a calibration JSON that describes the run (mode, α,
B, n, servers, slots, trainer devices, prompt length) and a measured decode step of the engine.
This module writes that JSON from a run directory (`config.json`, `run_info.json`) and one decode
measurement, calls the benchmark as a subprocess (it owns its flags) and parses its report.

Decode calibration: the benchmark times one engine alone on one core. The controller gives the
K servers of an async run the R rollout cores (K > R: they time-share, so each decode step takes
K/R times longer, prefill too); a sync run gives every server its own core. That scaling is the
only adjustment; train, handoff and length models are fitted by the benchmark from the run itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np

from experiments import _summary

DEMO_MODEL = ".cache/demo_model"


def measure_decode(out_path: str, *, slots: int, context_length: int, core: int = 0) -> dict:
  """Runs the benchmark's `--measure_decode` pinned to one core; cached in `out_path`.
  Returns `{"decode": {"active", "step_s"}, "prefill_s_per_token"}`."""
  if os.path.exists(out_path):
    with open(out_path) as f:
      return json.load(f)
  cmd = ["taskset", "-c", str(core), sys.executable, "-m",
         "experiments.benchmarks.sim_vs_measured", f"--measure_decode={DEMO_MODEL}",
         f"--slots={slots}", f"--context_length={context_length}"]
  out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu")).stdout
  block = json.loads(out.strip().splitlines()[-1])  # {"decode": {...}, "prefill_s_per_token"}
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  with open(out_path, "w") as f:
    json.dump(block, f)
  return block


def calibration(workdir: str, decode: dict, warmup: int, scale: float = 1.0) -> dict:
  """The benchmark's calibration JSON for the run in `workdir`; `scale` multiplies the measured
  decode and prefill times (see `fitted_scale`)."""
  with open(os.path.join(workdir, "config.json")) as f:
    config = json.load(f)
  with open(os.path.join(workdir, "run_info.json")) as f:
    info = json.load(f)
  servers = config["rollout"]["num_servers"]
  cores = info.get("cores", 2)
  if config["mode"] == "async":
    share = max(servers / config["resources"]["rollout_devices"], 1.0)
  else:
    share = max(servers / cores, 1.0)
  share *= scale
  return {
      "run": {"mode": config["mode"], "async_ratio": config["async_ratio"],
              "batch_size": config["batch_size"], "group_size": config["group_size"],
              "rollout_servers": servers, "slots": config["rollout"]["max_running_requests"],
              "train_devices": config["resources"]["train_devices"],
              "prompt_tokens": round(info["prompt_tokens_mean"]),
              "max_len": info["max_new_tokens"], "pause_mode": info["pause_mode"],
              "queue_scheduling": True, "prompt_replication": True},
      "decode": {"active": decode["decode"]["active"],
                 "step_s": [s * share for s in decode["decode"]["step_s"]]},
      "prefill_s_per_token": decode.get("prefill_s_per_token", 0.0) * share,
      "warmup_steps": warmup,
  }


def compare(workdir: str, decode: dict, warmup: int, seeds: int = 3, scale: float = 1.0,
            tag: str = "") -> dict:
  """{'predicted', 'measured', 'error', 'wait_data_s': (predicted, measured), ...} from the
  benchmark's report, or {'error_text'} when it fails."""
  path = os.path.join(workdir, f"sim_calibration{tag}.json")
  with open(path, "w") as f:
    json.dump(calibration(workdir, decode, warmup, scale), f, indent=1)
  cmd = [sys.executable, "-m", "experiments.benchmarks.sim_vs_measured",
         f"--metrics={os.path.join(workdir, 'metrics.jsonl')}", f"--calibration={path}",
         f"--seeds={seeds}"]
  proc = subprocess.run(cmd, capture_output=True, text=True)
  with open(os.path.join(workdir, f"sim_vs_measured{tag}.txt"), "w") as f:
    f.write(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
  return parse_report(proc.stdout) if proc.returncode == 0 else {"error_text": proc.stderr[-500:]}


def check_runs(results, out_dir: str) -> tuple[dict, dict, float | None]:
  """Every finished run replayed twice: with the standalone decode measurement (cached in
  `out_dir/decode.json`), and with decode rescaled so that the sync run's generation time is
  reproduced (fitted on sync, then a prediction for every async run). Returns
  (reports by run name, fitted reports by run name, the fitted scale)."""
  done = [r for r in results if r.ok]
  if not done:
    return {}, {}, None
  with open(os.path.join(done[0].workdir, "config.json")) as f:
    config = json.load(f)
  decode = measure_decode(os.path.join(out_dir, "decode.json"),
                          slots=config["rollout"]["max_running_requests"],
                          context_length=config["train"]["batch"]["row_length"])

  def warm(r):
    return _summary.warmup_steps(r.records, r.spec.overrides.get("async_ratio", 0))

  raw = {r.spec.name: compare(r.workdir, decode, warm(r)) for r in done}
  sync = next((r for r in done if r.spec.overrides.get("mode") == "sync"), None)
  scale = fitted_scale(raw[sync.spec.name]) if sync else None
  if not scale:
    return raw, {}, None
  for _ in range(2):  # generation time is not exactly linear in the decode step: refine
    report = compare(sync.workdir, decode, warm(sync), scale=scale, tag="_fitted")
    scale *= fitted_scale(report) or 1.0
  fitted = {r.spec.name: compare(r.workdir, decode, warm(r), scale=scale, tag="_fitted")
            for r in done}
  return raw, fitted, scale


def add_to_rows(rows: list[dict], results, reports: dict, fitted: dict) -> None:
  """Per cell row (`_summary.cell_rows`): the seeds' mean predicted and measured samples/s and
  relative error, as `sim_*` (standalone decode) and `simfit_*` (decode fitted on sync)."""
  cells = _summary.group_cells(results)
  for row in rows:
    names = [r.spec.name for r in cells.get(row["cell"], [])]
    for prefix, source in (("sim", reports), ("simfit", fitted)):
      checks = [source[n] for n in names if "error" in source.get(n, {})]
      if checks:
        row[f"{prefix}_predicted"] = float(np.mean([c["predicted"] for c in checks]))
        row[f"{prefix}_measured"] = float(np.mean([c["measured"] for c in checks]))
        row[f"{prefix}_error"] = float(np.mean([c["error"] for c in checks]))


def fitted_scale(sync_report: dict) -> float | None:
  """Measured / predicted generation time of a sync run (its wait is generation + rewards): the
  factor by which the standalone decode measurement under-states the servers' real step (HTTP
  and per-request work, co-tenant load). Fitted on the sync run, applied to the others."""
  predicted, measured = sync_report.get("wait_data_s", (0.0, 0.0))
  return measured / predicted if predicted > 0 else None


def parse_report(text: str) -> dict:
  out = {}
  for name, predicted, measured in re.findall(
      r"(\w+): predicted\s+(\S+)\s+measured\s+(\S+)", text):
    out[name] = (float(predicted), float(measured))
  if "samples_per_s" in out:
    out["predicted"], out["measured"] = out["samples_per_s"]
  m = re.search(r"sim_error_vs_measured: (\S+)", text)
  if m:
    out["error"] = float(m.group(1))
  return out
