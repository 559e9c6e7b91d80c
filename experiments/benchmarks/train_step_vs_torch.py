"""Train-step throughput of our jitted RL step vs an equivalent PyTorch step, on CPU.

Why: the trainer must not be the slow side of the async pipeline. Both sides run the same random
Qwen3 checkpoint (written by transformers, read by our loader), the same batch (full rows: sequences
exactly `--seq` tokens long, `--prompt` of them prompt, so packing and padding play no part), the same
loss (token-mean PPO clipped surrogate against behaviour log-probs, GRPO advantages), the same
AdamW update with global-norm clipping, float32, on the same CPU cores with the same thread count.
The PyTorch step is written the efficient way: the LM head is applied to response positions only,
HF's SDPA attention, `zero_grad(set_to_none=True)`, and `OMP_WAIT_POLICY=PASSIVE` (with spinning
OpenMP workers on a machine shared with other processes, every small PyTorch op is ~50x slower,
which would make the comparison meaningless in our favour). Steps alternate (ours, torch, ours, ...) so load
from other processes hits both alike; the medians are reported. Compilation (ours) and a first
step (torch) are warmed up outside the timings.

Also reported: the model FLOPs of one step (6 * matmul params * tokens + attention) as achieved FLOP/s
and as a fraction of a measured float32 matmul peak of this machine (a large jitted `jnp.dot`).

  .venv/bin/python -m experiments.benchmarks.train_step_vs_torch

The last line is the headline: `train_step_speedup_vs_torch: <ours tokens/s / torch tokens/s>`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np


def parse_args() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--vocab", type=int, default=4096)
  p.add_argument("--batch", type=int, default=4, help="sequences per step")
  p.add_argument("--seq", type=int, default=256, help="tokens per sequence (prompt + response)")
  p.add_argument("--prompt", type=int, default=32)
  p.add_argument("--steps", type=int, default=6, help="timed steps per side")
  p.add_argument("--threads", type=int, default=2, help="CPU cores and threads for both")
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args()


def write_checkpoint(path: str, args) -> None:
  import torch
  import transformers
  torch.manual_seed(args.seed)
  config = transformers.Qwen3Config(
      vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
      head_dim=args.hidden // 4, max_position_embeddings=2048, tie_word_embeddings=False)
  transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def make_batch(args, rng):
  from flashrl_jax.trainer import Trajectory
  r = args.seq - args.prompt
  return [Trajectory(sample_id=i, prompt_ids=rng.integers(0, args.vocab, args.prompt),
                     response_ids=rng.integers(0, args.vocab, r),
                     behavior_logp=-rng.uniform(5.0, 12.0, r).astype(np.float32),
                     reward=float(i % 2), group_id=i // 2) for i in range(args.batch)]


# --- ours --------------------------------------------------------------------------------------

def jax_side(path, args, trajectories):
  import jax
  from flashrl_jax.losses import LossConfig
  from flashrl_jax.model import read_config
  from flashrl_jax.trainer import (BatchConfig, OptimizerConfig, TrainConfig, Trainer, make_mesh,
                                   tree_to_global)
  config = TrainConfig(
      loss=LossConfig(name="ppo"), optimizer=OptimizerConfig(learning_rate=1e-5),
      batch=BatchConfig(row_length=args.seq, rows=args.batch, sequences_per_row=1,
                        max_response_length=args.seq - args.prompt),
      logprob_chunk_size=args.seq)
  trainer = Trainer(read_config(path), config, make_mesh("", jax.devices()[:1]), init_params=path)
  batch = tree_to_global(trainer.pack(trajectories), trainer.batch_shardings)

  def step():
    return float(trainer.step_on(batch)["loss"])

  return step


# --- PyTorch -----------------------------------------------------------------------------------

def torch_side(path, args, trajectories):
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
  p = args.prompt

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

def step_flops(args) -> float:
  d, f, layers, v = args.hidden, 3 * args.hidden, args.layers, args.vocab
  heads, kv, hd = 4, 2, args.hidden // 4
  per_layer = d * hd * (heads + 2 * kv) + heads * hd * d + 3 * d * f  # q k v o + SwiGLU
  tokens = args.batch * args.seq
  response = args.batch * (args.seq - args.prompt)
  dense = 6 * (layers * per_layer * tokens + d * v * response)  # fwd 2, bwd 4 per MAC
  attention = 6 * 2 * layers * args.batch * args.seq ** 2 * heads * hd  # QK^T and PV
  return float(dense + attention)


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
  import jax
  import jax.numpy as jnp
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  f = jax.jit(lambda x, y: x @ y)
  f(a, a).block_until_ready()
  best = min(_timed(lambda: f(a, a).block_until_ready()) for _ in range(repeats))
  return 2 * n ** 3 / best


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


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
  rng = np.random.default_rng(args.seed)
  trajectories = make_batch(args, rng)
  with tempfile.TemporaryDirectory() as path:
    write_checkpoint(path, args)
    ours, theirs = jax_side(path, args, trajectories), torch_side(path, args, trajectories)
    t0 = time.perf_counter()
    loss_ours = ours()
    compile_s = time.perf_counter() - t0
    loss_theirs = theirs()
    print(f"first-step loss: ours {loss_ours:.6f}  torch {loss_theirs:.6f}  "
          f"(same weights and batch; compile {compile_s:.1f}s)")
    times = {"ours": [], "torch": []}
    for _ in range(args.steps):
      times["ours"].append(_timed(ours))
      times["torch"].append(_timed(theirs))
  tokens = args.batch * args.seq
  flops = step_flops(args)
  peak = matmul_peak()
  print(f"config: hidden {args.hidden}, layers {args.layers}, vocab {args.vocab}, "
        f"batch {args.batch} x {args.seq} tokens, threads {args.threads}")
  print(f"step FLOPs: {flops / 1e9:.2f} GFLOP; float32 matmul peak: {peak / 1e9:.1f} GFLOP/s")
  rates = {}
  for side, ts in times.items():
    median = statistics.median(ts)
    rates[side] = tokens / median
    print(f"{side:>5}: median step {median * 1e3:8.1f} ms  (min {min(ts) * 1e3:.1f})  "
          f"{rates[side]:8.0f} tokens/s  {flops / median / 1e9:6.1f} GFLOP/s  "
          f"{flops / median / peak:5.1%} of peak")
  best = min(times["torch"]) / min(times["ours"])
  print(f"speedup of the fastest steps (less sensitive to load from other processes): {best:.2f}")
  print(f"train_step_speedup_vs_torch: {rates['ours'] / rates['torch']:.2f}")


if __name__ == "__main__":
  main()
