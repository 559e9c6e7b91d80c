"""Warm-starts a tiny policy with a short supervised run on its task, and caches it as an HF directory.

RL from a random tiny model would spend the whole CPU budget finding the answer format. A few
hundred supervised steps on (prompt, correct response) pairs drawn from the task's own training
stream (never its held-out sets) give a policy that is right some of the time, so the async RL run
that follows has a reward signal to climb. The cache is keyed by the step count and a fingerprint of
the training pairs, so a changed task retrains instead of reusing a model fitted to another one.

  python -m experiments.warmstart --out=.cache/demo_model   # the demo's model (what demo.sh uses)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time

import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx
from tqdm import tqdm

from flashrl_jax import envs
from flashrl_jax.model import Decoder, Family, ModelConfig, char_tokenizer, save_hf, token_logprobs


def demo_model_config(vocab_size: int) -> ModelConfig:
  """The demo policy: a 2-layer Qwen3-layout decoder, small enough to train on 2 CPU cores."""
  return ModelConfig(family=Family.QWEN3, vocab_size=vocab_size, hidden_size=64,
                     intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
                     bos_token_id=1, eos_token_ids=(2,))


Task = envs.SyntheticConfig | envs.TaskSource


def _encode_batch(tok, pairs: list[tuple[str, str]], length: int):
  ids = np.zeros((len(pairs), length), np.int32)
  mask = np.zeros((len(pairs), length), np.float32)
  for i, (prompt_text, response) in enumerate(pairs):
    prompt, answer = tok.encode(prompt_text), tok.encode(response) + [tok.eos_token_id]
    seq = (prompt + answer)[:length]
    ids[i, :len(seq)] = seq
    mask[i, len(prompt) - 1:len(seq) - 1] = 1.0  # predict answer tokens (and eos)
  return ids, mask


def _synthetic_length(task: envs.SyntheticConfig) -> int:
  """Room for the longest prompt + answer + eos of `task`, rounded up to a multiple of 16."""
  longest = envs.generate_synthetic(
      dataclasses.replace(task, lengths=dataclasses.replace(
          task.lengths, law=envs.LengthLaw.CONSTANT, median=task.lengths.max_len)), num=1, seed=0)[0]
  tokens = len(longest.prompt) + len(longest.answer) + 2  # char tokenizer: one token per character
  return max(80, -(-tokens // 16) * 16)


def _pairs(task: Task, num: int, seed: int) -> tuple[list[tuple[str, str]], int]:
  """`num` (prompt, correct response) pairs and the padded sequence length that fits them."""
  if isinstance(task, envs.SyntheticConfig):  # seeded as it always was: cached models stay valid
    data = envs.generate_synthetic(task, num=num, seed=seed + 1)
    return [(s.prompt, s.answer) for s in data], _synthetic_length(task)
  pairs = [(s.prompt, task.reference(s)) for s in (task.sample(i) for i in range(num))]
  tokens = max(len(p) + len(r) for p, r in pairs) + 2  # char tokenizer: one token per character
  return pairs, -(-tokens // 16) * 16


def task_key(task: Task) -> str:
  """A fingerprint of the pairs `task` trains on (so `median=8` and `median=8.0` agree)."""
  if isinstance(task, envs.SyntheticConfig):
    problems = envs.generate_synthetic(task, num=256, seed=0)
    text = "\n".join(f"{p.prompt}|{p.answer}" for p in problems)
  else:
    text = "\n".join(f"{p}|{r}" for p, r in _pairs(task, 256, 0)[0])
  return hashlib.sha256(text.encode()).hexdigest()


def train_warmstart(out: str, steps: int, batch: int, lr: float, seed: int, task: Task,
                    *, progress: bool = True) -> str:
  tok = char_tokenizer()
  config = demo_model_config(vocab_size=96)
  model = Decoder(config, rngs=nnx.Rngs(seed))
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(50, steps // 5), steps, lr * 0.1)
  optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.01), wrt=nnx.Param)
  data, length = _pairs(task, steps * batch, seed)

  @nnx.jit
  def step(model, optimizer, ids, mask):
    def loss_fn(model):
      hidden = model.hidden_states(ids[:, :-1])
      logp, _ = token_logprobs(hidden, model.unembedding(), ids[:, 1:])
      return -jnp.sum(logp * mask[:, :-1]) / jnp.maximum(mask.sum(), 1.0)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  start = time.time()
  with tqdm(total=steps, desc="warm start", unit="step", disable=not progress, file=sys.stderr,
            dynamic_ncols=True) as bar:
    for i in range(steps):
      ids, mask = _encode_batch(tok, data[i * batch:(i + 1) * batch], length)
      loss = step(model, optimizer, jnp.asarray(ids), jnp.asarray(mask))
      if i % 10 == 0 or i == steps - 1:
        bar.set_postfix(loss=f"{float(loss):.3f}", refresh=False)
      bar.update(1)
  os.makedirs(out, exist_ok=True)
  save_hf(model, out)
  tok.save(out)
  with open(os.path.join(out, "warmstart.json"), "w") as f:
    json.dump({"steps": steps, "batch": batch, "lr": lr, "seed": seed, "task": task_key(task),
               "final_loss": float(loss), "seconds": time.time() - start}, f)
  return out


def ensure_warmstart(out: str, task: Task, steps: int = 160, batch: int = 32, lr: float = 3e-3,
                     seed: int = 0, force: bool = False, progress: bool = True) -> str:
  """Returns the cached warm-started model dir, training it first if needed (with a progress bar)."""
  marker = os.path.join(out, "warmstart.json")
  key = task_key(task)
  if os.path.exists(marker) and not force:
    with open(marker) as f:
      recorded = json.load(f)
    if recorded.get("steps") == steps and recorded.get("task") == key:
      print(f"warm start: cached model in {out}", flush=True)
      return out
  print(f"warm start: {steps} supervised steps x {batch} question/answer pairs of the task "
        f"(cached in {out} afterwards)", flush=True)
  return train_warmstart(out, steps, batch, lr, seed, task, progress=progress)


def ensure_demo_model(out: str | None = None, progress: bool = True) -> str:
  """The demo's warm-started model, trained on the demo task's own training stream."""
  from experiments.configs import demo
  from flashrl_jax.controller import task_source
  config = demo.get_config()
  task = config.task.synthetic or task_source(config)
  return ensure_warmstart(out or demo.DEMO_MODEL_DIR, task,
                          steps=demo.DEMO_WARMSTART_STEPS, progress=progress)


def ensure_project_model(model_path: str) -> bool:
  """Warm-starts (or finds cached) the project model at `model_path` if it is the demo's, a
  benchmark's or the code RLVR config's, each on its own task; False for any other path."""
  from experiments.configs import bench_rlvr, bench_rlvr_longtail, code_rlvr, demo, repeat
  path = os.path.normpath(model_path)
  if path == os.path.normpath(demo.DEMO_MODEL_DIR):
    ensure_demo_model()
    return True
  benches = {  # model dir -> (task it is warm-started on, supervised steps)
      repeat.REPEAT_MODEL_DIR: (repeat.repeat_task(), repeat.REPEAT_WARMSTART_STEPS),
      bench_rlvr.BENCH_MODEL_DIR: (bench_rlvr.bench_task(), bench_rlvr.BENCH_WARMSTART_STEPS),
      bench_rlvr_longtail.LONGTAIL_MODEL_DIR: (bench_rlvr_longtail.longtail_task(),
                                               bench_rlvr_longtail.LONGTAIL_WARMSTART_STEPS),
      code_rlvr.CODE_MODEL_DIR: (envs.CodeTaskSource(code_rlvr.code_tasks()),
                                 code_rlvr.CODE_WARMSTART_STEPS),
  }
  for model_dir, (task, steps) in benches.items():
    if path == os.path.normpath(model_dir):
      ensure_warmstart(model_dir, task, steps=steps)
      return True
  return False


def main(argv):
  del argv
  f = flags.FLAGS
  print(f"warm-started model: {ensure_demo_model(f.out)}")


if __name__ == "__main__":
  # Flags are defined only when run as a script, so `experiments.train` can import this module.
  flags.DEFINE_string("out", ".cache/demo_model", "Where the HF directory is written.")
  app.run(main)
