"""Warm-starts the demo policy with a short supervised run, and caches it as an HF directory.

RL from a random tiny model would spend the whole CPU budget finding the answer format. A few
hundred supervised steps on (prompt, correct answer) pairs of the synthetic task give a policy that
is right some of the time, so the async RL run that follows has a reward signal to climb.

  python -m experiments.warmstart --out=.cache/demo_model --steps=160
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from flax import nnx

from flashrl_jax import envs
from experiments.configs.demo import demo_task
from flashrl_jax.model import Decoder, Family, ModelConfig, char_tokenizer, save_hf, token_logprobs

def demo_model_config(vocab_size: int) -> ModelConfig:
  """The demo policy: a 2-layer Qwen3-layout decoder, small enough to train on 2 CPU cores."""
  return ModelConfig(family=Family.QWEN3, vocab_size=vocab_size, hidden_size=64,
                     intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
                     bos_token_id=1, eos_token_ids=(2,))


def _encode_batch(tok, samples, length: int):
  ids = np.zeros((len(samples), length), np.int32)
  mask = np.zeros((len(samples), length), np.float32)
  for i, s in enumerate(samples):
    prompt, answer = tok.encode(s.prompt), tok.encode(s.answer) + [tok.eos_token_id]
    seq = (prompt + answer)[:length]
    ids[i, :len(seq)] = seq
    mask[i, len(prompt) - 1:len(seq) - 1] = 1.0  # predict answer tokens (and eos)
  return ids, mask


def _sequence_length(task: envs.SyntheticConfig) -> int:
  """Room for the longest prompt + answer + eos of `task`, rounded up to a multiple of 16."""
  longest = envs.generate_synthetic(
      dataclasses.replace(task, lengths=dataclasses.replace(
          task.lengths, law=envs.LengthLaw.CONSTANT, median=task.lengths.max_len)), num=1, seed=0)[0]
  tokens = len(longest.prompt) + len(longest.answer) + 2  # char tokenizer: one token per character
  return max(80, -(-tokens // 16) * 16)


def train_warmstart(out: str, steps: int, batch: int, lr: float, seed: int,
                    task: envs.SyntheticConfig | None = None) -> str:
  tok = char_tokenizer()
  config = demo_model_config(vocab_size=96)
  model = Decoder(config, rngs=nnx.Rngs(seed))
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(50, steps // 5), steps, lr * 0.1)
  optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.01), wrt=nnx.Param)
  task = task or demo_task()
  data = envs.generate_synthetic(task, num=steps * batch, seed=seed + 1)
  length = _sequence_length(task)

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
  for i in range(steps):
    ids, mask = _encode_batch(tok, data[i * batch:(i + 1) * batch], length)
    loss = step(model, optimizer, jnp.asarray(ids), jnp.asarray(mask))
    if i % 50 == 0 or i == steps - 1:
      logging.info("warmstart step %d/%d loss %.4f (%.0fs)", i, steps, float(loss),
                   time.time() - start)
  os.makedirs(out, exist_ok=True)
  save_hf(model, out)
  tok.save(out)
  with open(os.path.join(out, "warmstart.json"), "w") as f:
    json.dump({"steps": steps, "batch": batch, "lr": lr, "seed": seed, "task": _task_key(task),
               "final_loss": float(loss)}, f)
  return out


def _task_key(task: envs.SyntheticConfig) -> str:
  """A fingerprint of the problems `task` generates (so `median=8` and `median=8.0` agree)."""
  problems = envs.generate_synthetic(task, num=256, seed=0)
  return hashlib.sha256("\n".join(f"{p.prompt}|{p.answer}" for p in problems).encode()).hexdigest()


def ensure_warmstart(out: str, steps: int = 160, batch: int = 32, lr: float = 3e-3, seed: int = 0,
                     force: bool = False, task: envs.SyntheticConfig | None = None) -> str:
  """Returns the cached warm-started model dir, training it first if needed.

  The cache is keyed by the step count and (for a task other than the demo's) the task, so a
  changed task retrains instead of silently reusing a model warm-started on another distribution.
  """
  marker = os.path.join(out, "warmstart.json")
  if os.path.exists(marker) and not force:
    with open(marker) as f:
      recorded = json.load(f)
    if recorded.get("steps") == steps and recorded.get("task", _task_key(demo_task())) == _task_key(
        task or demo_task()):
      return out
  return train_warmstart(out, steps, batch, lr, seed, task)


def main(argv):
  del argv
  f = flags.FLAGS
  path = ensure_warmstart(f.out, f.steps, f.batch, f.lr, f.seed, f.force)
  print(f"warm-started model: {path}")


if __name__ == "__main__":
  # Flags are defined only when run as a script, so `experiments.train` can import this module.
  _OUT = flags.DEFINE_string("out", ".cache/demo_model", "Where the HF directory is written.")
  _STEPS = flags.DEFINE_integer("steps", 160, "Supervised steps.")
  _BATCH = flags.DEFINE_integer("batch", 32, "Sequences per step.")
  _LR = flags.DEFINE_float("lr", 3e-3, "Peak learning rate.")
  _SEED = flags.DEFINE_integer("seed", 0, "Seed.")
  _FORCE = flags.DEFINE_bool("force", False, "Retrain even when a cached model exists.")
  app.run(main)
