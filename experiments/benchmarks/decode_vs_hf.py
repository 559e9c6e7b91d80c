"""Decode throughput of our rollout engine vs HF transformers `generate`, on long-tail lengths.

Why: rollout dominates RL step time, and RL response lengths are long-tailed. HF `generate` batches
statically (a batch runs until its longest member ends, so short members' rows sit idle); our engine
batches continuously (a finished request's slot is refilled at once). Both run the same random Qwen3
checkpoint (written by transformers, read by our loader), the same requests (same prompts, same
per-request `max_new_tokens`, greedy, no early EOS), the same batch size (HF batch = our slots) and the
same CPU cores and thread count. Reported: useful generated tokens per second, time to finish all
requests, and the fraction of slot-steps that sit idle under each batching. Compilation (ours) and the
first call (HF) are warmed up outside the timings.

  .venv/bin/python -m experiments.benchmarks.decode_vs_hf

The last line is the headline: `decode_speedup_vs_hf_generate: <ours tokens/s / HF tokens/s>`.

Measured (defaults: 64 requests, 16 slots, 1 thread; a 2-core AMD EPYC VM shared with other jobs,
load average 5-9; jax 0.10.2 XLA:CPU vs torch 2.13 + transformers 5.23), at this revision:

                                HF generate (static)   ours (continuous)
  time to finish all (s)                      49.50                9.52
  decode tokens/s                              81.3               422.8
  tokens per CPU-second                       244.4               724.6
  idle slot fraction                          80.7%               51.6%
  decode rows computed idle                   80.7%               16.4%
  decode_speedup_vs_hf_generate: 5.20   (CPU-time speedup 2.97)

Wall-clock ratios on that shared machine ranged 1.6x-5.2x over five runs (whichever side happened to
run during a busy spell lost); the CPU-time ratio, which other load barely moves, stayed 2.6x-3.0x.
The win is continuous batching (511 decode steps instead of HF's 1303, bounded by the longest
request) plus running the tail in a smaller decode batch. Later measurements: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np


def parse_args() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--num_requests", type=int, default=64)
  p.add_argument("--slots", type=int, default=16, help="our decode slots = HF batch size")
  p.add_argument("--prompt_len", type=int, default=32)
  p.add_argument("--min_new_tokens", type=int, default=16)
  p.add_argument("--max_new_tokens", type=int, default=512)
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--vocab", type=int, default=4096)
  # One thread by default: on a shared 2-core box, 2 torch OpenMP threads stall each other under
  # outside load (5x slower per step), which would flatter us.
  p.add_argument("--threads", type=int, default=1, help="CPU cores and threads for both")
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args()


def long_tail_lengths(n: int, lo: int, hi: int, rng: np.random.Generator) -> np.ndarray:
  """Pareto-tailed response lengths in [lo, hi]: most short, a few near the cap."""
  return np.minimum(hi, (lo * (1.0 + rng.pareto(1.1, n))).astype(int))


def static_idle_fraction(lengths: np.ndarray, batch: int) -> float:
  """Idle slot-steps of static batching: each batch runs as long as its longest member."""
  chunks = [lengths[i:i + batch] for i in range(0, len(lengths), batch)]
  return 1.0 - lengths.sum() / sum(len(c) * c.max() for c in chunks)


def write_checkpoint(path: str, args) -> None:
  import torch
  import transformers
  torch.manual_seed(args.seed)
  config = transformers.Qwen3Config(
      vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
      head_dim=args.hidden // 4, max_position_embeddings=2048, tie_word_embeddings=False,
      eos_token_id=None, bos_token_id=None)
  transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def run_hf(path: str, prompts: np.ndarray, lengths: np.ndarray, batch: int):
  import torch
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

  def gen(ids, n):  # no eos token in the config: every row runs exactly n steps
    config = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                                           max_new_tokens=n)
    with torch.inference_mode():
      return model.generate(torch.as_tensor(ids), attention_mask=torch.ones(ids.shape, dtype=int),
                            generation_config=config)
  gen(prompts[:batch], 4)  # warm-up
  outputs = []
  start, cpu = time.perf_counter(), time.process_time()
  for i in range(0, len(prompts), batch):
    chunk = lengths[i:i + batch]
    out = gen(prompts[i:i + batch], int(chunk.max())).numpy()[:, prompts.shape[1]:]
    outputs += [row[:n].tolist() for row, n in zip(out, chunk)]  # the rest is discarded work
  return time.perf_counter() - start, time.process_time() - cpu, outputs


def run_ours(path: str, prompts: np.ndarray, lengths: np.ndarray, slots: int):
  from flashrl_jax.rollout import Engine, EngineConfig, Sampling, enable_compilation_cache
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  enable_compilation_cache(os.path.join(root, ".cache", "jax"))  # a re-run loads, not compiles
  engine = Engine(EngineConfig(path, max_running_requests=slots,
                               context_length=prompts.shape[1] + int(lengths.max())))
  start = time.perf_counter()  # compile every program the run will use (prefill groups, decode)
  engine.warmup().result()
  compile_s = time.perf_counter() - start
  engine.stats.__init__()
  start, cpu = time.perf_counter(), time.process_time()
  outs = engine.generate(list(prompts), [Sampling(temperature=0, max_new_tokens=int(n),
                                                  ignore_eos=True) for n in lengths])
  elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
  idle = (engine.stats.idle_fraction(slots), engine.stats.wasted_compute_fraction())
  engine.shutdown()
  return elapsed, cpu, [list(o.output_ids) for o in outs], idle, compile_s


def main() -> None:
  args = parse_args()
  os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:args.threads]))
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import torch
  torch.set_num_threads(args.threads)
  rng = np.random.default_rng(args.seed)
  lengths = long_tail_lengths(args.num_requests, args.min_new_tokens, args.max_new_tokens, rng)
  prompts = rng.integers(0, args.vocab, size=(args.num_requests, args.prompt_len), dtype=np.int64)
  useful = int(lengths.sum())
  with tempfile.TemporaryDirectory() as path:
    write_checkpoint(path, args)
    print("running HF generate ...", file=sys.stderr, flush=True)
    hf_s, hf_cpu, hf_out = run_hf(path, prompts, lengths, args.slots)
    print(f"  {hf_s:.1f} s; running ours ...", file=sys.stderr, flush=True)
    ours_s, ours_cpu, ours_out, ours_idle, compile_s = run_ours(path, prompts, lengths,
                                                                args.slots)
  same = np.mean([a[:8] == b[:8] for a, b in zip(hf_out, ours_out)])
  print(f"model: Qwen3 hidden={args.hidden} layers={args.layers} vocab={args.vocab}, float32, "
        f"{args.threads} CPU threads")
  print(f"requests: {args.num_requests} x prompt {args.prompt_len}, max_new_tokens long-tail "
        f"min={lengths.min()} median={int(np.median(lengths))} max={lengths.max()} "
        f"sum={useful}; batch/slots={args.slots}")
  print(f"greedy agreement of the first 8 tokens, ours vs HF: {same:.0%} of requests")
  print(f"{'':28s}{'HF generate (static)':>22s}{'ours (continuous)':>20s}")
  print(f"{'time to finish all (s)':28s}{hf_s:22.2f}{ours_s:20.2f}")
  print(f"{'decode tokens/s':28s}{useful / hf_s:22.1f}{useful / ours_s:20.1f}")
  print(f"{'tokens per CPU-second':28s}{useful / hf_cpu:22.1f}{useful / ours_cpu:20.1f}")
  static_idle = static_idle_fraction(lengths, args.slots)
  print(f"{'idle slot fraction':28s}{static_idle:22.1%}{ours_idle[0]:20.1%}")
  print(f"{'decode rows computed idle':28s}{static_idle:22.1%}{ours_idle[1]:20.1%}")
  print(f"our one-off compile time: {compile_s:.1f} s (excluded); CPU-time speedup "
        f"{hf_cpu / ours_cpu:.2f} (robust to other load on the machine)")
  print(f"decode_speedup_vs_hf_generate: {hf_s / ours_s:.2f}")


if __name__ == "__main__":
  main()
