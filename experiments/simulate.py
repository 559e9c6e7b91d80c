"""`python -m experiments.simulate --gpus=8,16,32,64,128 --out=runs/sim`: the paper-scale simulation.

Runs the discrete-event simulator (`flashrl_jax.sim`) on a Qwen3-8B-like RLVR workload and writes,
under `--out`, JSON + CSV tables and PNG plots of:
  scaling     throughput vs GPUs for sync and async (each α, best train/rollout split per budget);
  seqlen      sync vs async across mean response lengths at `--seq_gpus`;
  split       async throughput per train/rollout split at `--split_gpus` (paper Fig. 3a);
  mechanisms  sync generation time with/without queue scheduling and prompt replication.
The paper's numbers are printed beside ours. Last line: `sim_async_speedup_at_<G>_gpus: <ratio>`,
the async/sync samples/s at the largest budget and α = 2 (the paper's ratio; the first α swept when
2 is not), not the best α.
"""

import csv
import json
import os
import time

from absl import app, flags

from flashrl_jax import sim

PAPER_SPEEDUP_128 = 2.12          # async vs sync at 128 GPUs (Fig. 1b, top)
PAPER_SEQLEN_RANGE = (1.53, 2.24)  # async vs sync across average sequence lengths (Fig. 1b, bottom)

_GPUS = flags.DEFINE_list("gpus", ["8", "16", "32", "64", "128"], "GPU budgets to sweep.")
_ALPHAS = flags.DEFINE_list("alphas", ["1", "2", "4", "8"], "Async ratios α to sweep.")
_OUT = flags.DEFINE_string("out", "runs/sim", "Output directory.")
_TABLES = flags.DEFINE_list("tables", ["scaling", "seqlen", "split", "mechanisms"], "What to run.")
_MEAN_LEN = flags.DEFINE_float("mean_len", 8192, "Mean response length (after clipping).")
_MAX_LEN = flags.DEFINE_integer("max_len", 32768, "Generation limit L (tokens).")
_SIGMA = flags.DEFINE_float("sigma", 0.9, "Log-std of the lognormal length law.")
_BATCH = flags.DEFINE_integer("batch_prompts", 128, "Prompts per step (B).")
_GROUP = flags.DEFINE_integer("group_size", 8, "Responses per prompt (n).")
_SLOTS = flags.DEFINE_integer("slots", 64, "Concurrent decode slots per GPU.")
_TRAIN_MFU = flags.DEFINE_float("train_mfu", 0.4, "Model-FLOPs utilisation of training.")
_STEPS = flags.DEFINE_integer("steps", 6, "Measured steps per simulation (after warm-up).")
_SEED = flags.DEFINE_integer("seed", 0, "Simulation seed.")
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["2048", "4096", "8192", "16384"], "Mean lengths.")
_SEQ_GPUS = flags.DEFINE_integer("seq_gpus", 64, "GPU budget of the sequence-length table.")
_SEQ_ALPHA = flags.DEFINE_integer("seq_alpha", 2, "α of the sequence-length table.")
_SPLIT_GPUS = flags.DEFINE_integer("split_gpus", 40, "GPU budget of the split table.")
_SPLIT_TRAIN = flags.DEFINE_list("split_train", ["8", "12", "16", "20", "24", "28"], "Train GPUs.")
_MECH_GPUS = flags.DEFINE_integer("mech_gpus", 8, "GPU budget of the mechanisms table.")
_MECH_BATCHES = flags.DEFINE_list("mech_batches", ["32", "64", "128", "256"], "Batch sizes (B).")


def _write(rows: list[dict], out: str, name: str) -> None:
  with open(os.path.join(out, f"{name}.json"), "w") as f:
    json.dump(rows, f, indent=1)
  with open(os.path.join(out, f"{name}.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)


def _print(rows: list[dict], keys: list[str]) -> None:
  print(" | ".join(keys))
  for row in rows:
    print(" | ".join(f"{row[k]:.3g}" if isinstance(row[k], float) else str(row[k]) for k in keys))


def _plot_scaling(rows: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
  for i, label in enumerate(dict.fromkeys(_label(r) for r in rows)):
    sel = [r for r in rows if _label(r) == label]
    gpus = [r["gpus"] for r in sel]
    ax.plot(gpus, [r["samples_per_s"] for r in sel], "o-", color=f"C{i}", label=label)
    if label != "sync":
      bx.plot(gpus, [r["speedup_vs_sync"] for r in sel], "o-", color=f"C{i}", label=label)
      bx.plot(gpus, [r["token_speedup_vs_sync"] for r in sel], "--", color=f"C{i}", alpha=0.6)
  bx.plot([128], [PAPER_SPEEDUP_128], "k*", markersize=12, label="paper (async vs sync)")
  bx.plot([], [], "k--", alpha=0.6, label="dashed: tokens/s ratio")
  ax.set(xscale="log", xlabel="GPUs", ylabel="samples/s", title="Simulated throughput")
  bx.set(xscale="log", xlabel="GPUs", ylabel="async / sync", title="Speedup over sync")
  for axis in (ax, bx):
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _plot_seqlen(rows: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5.5, 4))
  sel = [r for r in rows if r["mode"] == "async"]
  lens = [r["mean_len"] for r in sel]
  ax.plot(lens, [r["speedup_vs_sync"] for r in sel], "o-", label="simulated, samples/s")
  ax.plot(lens, [r["token_speedup_vs_sync"] for r in sel], "o--", label="simulated, tokens/s")
  ax.axhspan(*PAPER_SEQLEN_RANGE, color="grey", alpha=0.25, label="paper range 1.53–2.24×")
  ax.set(xscale="log", xlabel="mean response length (tokens)", ylabel="async / sync",
         title=f"Speedup vs length ({sel[0]['gpus']} GPUs)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _label(row: dict) -> str:
  return "sync" if row["mode"] == "sync" else f"async α={row['alpha']}"


def main(argv):
  del argv
  os.makedirs(_OUT.value, exist_ok=True)
  workload = sim.Workload(mean_len=_MEAN_LEN.value, max_len=_MAX_LEN.value, sigma=_SIGMA.value,
                          batch_prompts=_BATCH.value, group_size=_GROUP.value, steps=_STEPS.value,
                          slots=_SLOTS.value, train_mfu=_TRAIN_MFU.value)
  gpus = [int(g) for g in _GPUS.value]
  alphas = [int(a) for a in _ALPHAS.value]
  headline = None
  start = time.time()
  if "mechanisms" in _TABLES.value:
    rows = sim.mechanism_rows(_MECH_GPUS.value, [int(b) for b in _MECH_BATCHES.value], workload,
                              _SEED.value)
    _write(rows, _OUT.value, "mechanisms")
    print("\n# rollout mechanisms (sync, generation time per step)")
    _print(rows, ["batch_prompts", "queue_scheduling", "prompt_replication", "gen_time_s"])
  if "split" in _TABLES.value:
    rows = sim.split_rows(_SPLIT_GPUS.value, 2, [int(t) for t in _SPLIT_TRAIN.value], workload,
                          _SEED.value)
    _write(rows, _OUT.value, "split")
    print(f"\n# train/rollout split at {_SPLIT_GPUS.value} GPUs, α=2 (paper: 24 rollout + 16 train "
          "best, ~2× over sync)")
    _print(rows, ["mode", "train_gpus", "samples_per_s", "speedup_vs_sync",
                  "token_speedup_vs_sync", "idle_fraction", "dropped_samples"])
  if "seqlen" in _TABLES.value:
    rows = sim.sequence_rows([float(x) for x in _SEQ_LENS.value], _SEQ_GPUS.value,
                             _SEQ_ALPHA.value, workload, _SEED.value)
    _write(rows, _OUT.value, "seqlen")
    _plot_seqlen(rows, os.path.join(_OUT.value, "seqlen.png"))
    print(f"\n# sequence length at {_SEQ_GPUS.value} GPUs (paper: async 1.53–2.24× over sync)")
    _print(rows, ["mean_len", "mode", "train_gpus", "samples_per_s", "tokens_per_s",
                  "mean_len_trained", "dropped_samples", "speedup_vs_sync",
                  "token_speedup_vs_sync"])
  if "scaling" in _TABLES.value:
    rows = sim.scaling_rows(gpus, alphas, workload, _SEED.value)
    _write(rows, _OUT.value, "scaling")
    _plot_scaling(rows, os.path.join(_OUT.value, "scaling.png"))
    print(f"\n# scaling (paper: async {PAPER_SPEEDUP_128}× over sync at 128 GPUs)")
    _print(rows, ["gpus", "mode", "alpha", "train_gpus", "samples_per_s", "tokens_per_s",
                  "mean_len_trained", "gen_time_s", "idle_fraction", "dropped_samples",
                  "speedup_vs_sync", "token_speedup_vs_sync"])
    top, alpha = max(gpus), (2 if 2 in alphas else alphas[0])
    headline = (top, next(r["speedup_vs_sync"] for r in rows
                          if r["gpus"] == top and r["alpha"] == alpha))
  print(f"\n(simulated in {time.time() - start:.0f} s; outputs in {_OUT.value})")
  if headline:
    print(f"sim_async_speedup_at_{headline[0]}_gpus: {headline[1]:.3f}")


if __name__ == "__main__":
  app.run(main)
