"""Train-step throughput of our jitted RL step vs an equivalent PyTorch step, on CPU, for two configs.

Why: the trainer must not be the slow side of the async pipeline. Two model/batch configs are
measured side by side in one run:

  demo     the tiny Qwen3 the CPU demo actually trains (`experiments/warmstart.py`
           `demo_model_config`: hidden 64, 2 layers, 4/2 heads, head_dim 16, vocab 96, tied
           embeddings) on the repeat config's micro-batch shape (`experiments/configs/repeat.py`:
           8 rows of 128 tokens, responses up to 64): 8 sequences of 64 prompt + 64 response tokens;
  compute  a compute-bound Qwen3 (hidden 256, 4 layers, 4/2 heads, head_dim 64, vocab 4096, untied)
           on 4 sequences of 32 prompt + 224 response tokens.

The headline is the demo config, the model this project trains on this machine; the compute-bound
ratio is printed beside it (see docs/trainer.md for its profile).

For each config both sides run the same random checkpoint (written by our saver, read by our loader
and by transformers), the same batch (full rows, one sequence per row, so packing and padding play
no part and PyTorch needs none), the same loss (token-mean PPO clipped surrogate against behaviour
log-probs, GRPO advantages), the same AdamW update with global-norm clipping, float32, on the same
CPU cores with the same thread count; the first-step losses are printed and must agree. The PyTorch
step is written the efficient way: the LM head is applied to response positions only, HF's SDPA
attention, `zero_grad(set_to_none=True)`, and `OMP_WAIT_POLICY=PASSIVE` (with spinning OpenMP
workers on a machine shared with other processes, every small PyTorch op is ~50x slower, which would
make the comparison meaningless in our favour). Compilation (ours) and a first step (torch) are
warmed up outside the timings. Timed samples alternate between the four (side, config) pairs, in a
reversed order every other round, so load from other processes hits all alike; medians are reported.

Also reported: the model FLOPs of one step (6 * matmul params * tokens + attention, the LM head on
response tokens only) as achieved FLOP/s and as a fraction of a measured float32 matmul peak of this
machine (the best rate of large jitted `jnp.dot`s).

  .venv/bin/python -m experiments.benchmarks.train_step_vs_torch            # --threads 2

The last line is the headline: `train_step_speedup_vs_torch: <ours / torch tokens/s, demo config>`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

import numpy as np


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  name: str
  hidden: int
  intermediate: int
  layers: int
  heads: int
  kv_heads: int
  head_dim: int
  vocab: int
  tied: bool
  batch: int  # sequences per step, one per row
  seq: int  # tokens per sequence (prompt + response)
  prompt: int
  steps_per_sample: int  # steps timed back to back per sample (short steps need several)


def demo_config() -> BenchConfig:
  """The CPU demo's model and the repeat config's micro-batch shape, read from their definitions."""
  from experiments.configs.repeat import get_config
  from experiments.warmstart import demo_model_config
  model = demo_model_config(vocab_size=96)  # the char tokenizer's vocabulary, as warmstart uses
  batch = get_config().train.batch
  return BenchConfig(name="demo", hidden=model.hidden_size, intermediate=model.intermediate_size,
                     layers=model.num_layers, heads=model.num_heads, kv_heads=model.num_kv_heads,
                     head_dim=model.head_dim, vocab=model.vocab_size,
                     tied=model.tie_word_embeddings, batch=batch.rows, seq=batch.row_length,
                     prompt=batch.row_length - batch.max_response_length, steps_per_sample=8)


COMPUTE = BenchConfig(name="compute", hidden=256, intermediate=768, layers=4, heads=4, kv_heads=2,
                      head_dim=64, vocab=4096, tied=False, batch=4, seq=256, prompt=32,
                      steps_per_sample=1)


def parse_args() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rounds", type=int, default=12, help="timed samples per side and config")
  p.add_argument("--threads", type=int, default=2, help="CPU cores and threads for both")
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args()


def write_checkpoint(path: str, bench: BenchConfig, seed: int) -> None:
  from flashrl_jax.model import Family, ModelConfig
  from flashrl_jax.testing import write_tiny_checkpoint
  config = ModelConfig(
      family=Family.QWEN3, vocab_size=bench.vocab, hidden_size=bench.hidden,
      intermediate_size=bench.intermediate, num_layers=bench.layers, num_heads=bench.heads,
      num_kv_heads=bench.kv_heads, head_dim=bench.head_dim, rope_theta=10000.0,
      max_position_embeddings=max(512, bench.seq), tie_word_embeddings=bench.tied,
      bos_token_id=1, eos_token_ids=(2,))
  write_tiny_checkpoint(path, config, seed=seed, with_tokenizer=False)


def make_batch(bench: BenchConfig, rng):
  from flashrl_jax.trainer import Trajectory
  r = bench.seq - bench.prompt
  return [Trajectory(sample_id=i, prompt_ids=rng.integers(0, bench.vocab, bench.prompt),
                     response_ids=rng.integers(0, bench.vocab, r),
                     behavior_logp=-rng.uniform(1.0, 6.0, r).astype(np.float32),
                     reward=float(i % 2), group_id=i // 2) for i in range(bench.batch)]


# --- ours --------------------------------------------------------------------------------------

def jax_side(path, bench: BenchConfig, trajectories):
  import jax
  from flashrl_jax.losses import LossConfig
  from flashrl_jax.model import read_config
  from flashrl_jax.trainer import (BatchConfig, OptimizerConfig, TrainConfig, Trainer, make_mesh,
                                   tree_to_global)
  response = bench.seq - bench.prompt
  config = TrainConfig(
      loss=LossConfig(name="ppo"), optimizer=OptimizerConfig(learning_rate=1e-5),
      batch=BatchConfig(row_length=bench.seq, rows=bench.batch, sequences_per_row=1,
                        max_response_length=response),
      logprob_chunk_size=response)  # one chunk: these responses are short
  trainer = Trainer(read_config(path), config, make_mesh("", jax.devices()[:1]), init_params=path)
  batch = tree_to_global(trainer.pack(trajectories), trainer.batch_shardings)

  def step():
    return float(trainer.step_on(batch)["loss"])

  return step


# --- PyTorch -----------------------------------------------------------------------------------

def torch_side(path, bench: BenchConfig, trajectories):
  import torch
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation="sdpa").train()
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=0.0)
  ids = torch.as_tensor(np.stack([np.concatenate([t.prompt_ids, t.response_ids])
                                  for t in trajectories]), dtype=torch.long)
  behavior = torch.as_tensor(np.stack([t.behavior_logp for t in trajectories]))
  rewards = torch.as_tensor([t.reward for t in trajectories])
  groups = torch.as_tensor([t.group_id for t in trajectories])
  p = bench.prompt

  def step():
    # GRPO advantages: (r - mean_g) / (std_g + eps), unbiased std, as ours.
    same = (groups[:, None] == groups[None, :]).float()
    size = same.sum(-1)
    mean = same @ rewards / size
    std = torch.sqrt((same * (rewards[None] - mean[:, None]) ** 2).sum(-1) / (size - 1).clamp(min=1))
    adv = torch.where(size > 1, (rewards - mean) / (std + 1e-6), torch.zeros_like(rewards))
    hidden = model.model(input_ids=ids).last_hidden_state[:, p - 1:-1]
    logits = model.lm_head(hidden)
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, p:, None])[..., 0]
    ratio = torch.exp(torch.clamp(logp - behavior, -20, 20))
    obj = torch.minimum(ratio * adv[:, None], torch.clamp(ratio, 0.8, 1.2) * adv[:, None])
    loss = -obj.mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())

  return step


# --- FLOPs -------------------------------------------------------------------------------------

def step_flops(bench: BenchConfig) -> float:
  d, f, hd = bench.hidden, bench.intermediate, bench.head_dim
  heads, kv = bench.heads, bench.kv_heads
  per_layer = d * hd * (heads + 2 * kv) + heads * hd * d + 3 * d * f  # q k v o + SwiGLU
  tokens = bench.batch * bench.seq
  response = bench.batch * (bench.seq - bench.prompt)
  dense = 6 * (bench.layers * per_layer * tokens + d * bench.vocab * response)  # fwd 2, bwd 4
  attention = 6 * 2 * bench.layers * bench.batch * bench.seq ** 2 * heads * hd  # QK^T and PV
  return float(dense + attention)


def matmul_peak(sizes=(1024, 2048), repeats: int = 10) -> float:
  """The best float32 FLOP/s of jitted square matmuls (a short one often runs in a quiet moment)."""
  import jax
  import jax.numpy as jnp
  best = 0.0
  for n in sizes:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    fastest = min(_timed(lambda: f(a, a).block_until_ready()) for _ in range(repeats))
    best = max(best, 2 * n ** 3 / fastest)
  return best


def _timed(fn, n: int = 1) -> float:
  """Seconds per call of `fn`, over `n` calls back to back."""
  start = time.perf_counter()
  for _ in range(n):
    fn()
  return (time.perf_counter() - start) / n


def main():
  args = parse_args()
  os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:args.threads]))
  # XLA sizes its CPU thread pool from the cores this process may use: the affinity above.
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=true"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  # Sleeping (not spinning) OpenMP workers: on a machine shared with other processes, spinning
  # workers that wait for a descheduled sibling make every small PyTorch op ~50x slower.
  os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
  import torch
  torch.set_num_threads(args.threads)
  benches = [demo_config(), COMPUTE]
  steps = {}
  with tempfile.TemporaryDirectory() as root:
    for bench in benches:
      path = os.path.join(root, bench.name)
      write_checkpoint(path, bench, args.seed)
      trajectories = make_batch(bench, np.random.default_rng(args.seed))
      ours, theirs = jax_side(path, bench, trajectories), torch_side(path, bench, trajectories)
      t0 = time.perf_counter()
      loss_ours = ours()
      compile_s = time.perf_counter() - t0
      loss_theirs = theirs()
      print(f"[{bench.name}] first-step loss: ours {loss_ours:.6f}  torch {loss_theirs:.6f}  "
            f"(same weights and batch; compile {compile_s:.1f}s)", flush=True)
      steps[(bench.name, "ours")], steps[(bench.name, "torch")] = ours, theirs
  by_name = {b.name: b for b in benches}
  times = {key: [] for key in steps}
  for r in range(args.rounds):
    for key in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
      times[key].append(_timed(steps[key], by_name[key[0]].steps_per_sample))
  peak = matmul_peak()
  print(f"threads {args.threads}; float32 matmul peak: {peak / 1e9:.1f} GFLOP/s; "
        f"{args.rounds} interleaved samples per side and config; load {os.getloadavg()[0]:.1f}")
  speedups = {}
  for bench in benches:
    tokens, flops = bench.batch * bench.seq, step_flops(bench)
    print(f"[{bench.name}] hidden {bench.hidden}, layers {bench.layers}, vocab {bench.vocab}"
          f"{' (tied)' if bench.tied else ''}, {bench.batch} x {bench.seq} tokens "
          f"({bench.prompt} prompt); step {flops / 1e9:.2f} GFLOP")
    rates = {}
    for side in ("ours", "torch"):
      ts = times[(bench.name, side)]
      median = statistics.median(ts)
      rates[side] = tokens / median
      print(f"  {side:>5}: median step {median * 1e3:8.2f} ms  (min {min(ts) * 1e3:.2f})  "
            f"{rates[side]:8.0f} tokens/s  {flops / median / 1e9:6.1f} GFLOP/s  "
            f"{flops / median / peak:5.1%} of peak")
    best = min(times[(bench.name, "torch")]) / min(times[(bench.name, "ours")])
    speedups[bench.name] = rates["ours"] / rates["torch"]
    print(f"  speedup: {speedups[bench.name]:.2f} (medians), {best:.2f} (fastest steps)")
  print(f"train_step_speedup_vs_torch_compute_bound: {speedups['compute']:.2f}")
  print(f"train_step_speedup_vs_torch: {speedups['demo']:.2f}")


if __name__ == "__main__":
  main()
