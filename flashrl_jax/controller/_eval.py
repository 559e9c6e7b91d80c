"""Noise-free evaluation of an exact-answer task: the policy's probability of the correct answer.

Sampled reward at temperature 1 is a noisy estimate of `P(correct answer | prompt)`; for tasks with a
single correct answer string that probability can be computed exactly with one forward pass (the sum
of the answer tokens' log-probs, end-of-sequence included). The demo and the tests use it to show
that training moved the policy, independent of sampling noise. The correct response is the task's
canonical one (`TaskSource.reference`): the bare answer, or the answer in its requested format.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flashrl_jax import envs
from flashrl_jax.model import Decoder, Tokenizer, token_logprobs
from flashrl_jax.trainer import host_to_global, to_host


def answer_logprobs(model: Decoder, tokenizer: Tokenizer, samples: list[envs.Sample],
                    temperature: float = 1.0, references: list[str] | None = None,
                    mesh: Mesh | None = None) -> np.ndarray:
  """`[N]` log P(reference + eos | prompt) under `softmax(logits / temperature)`; the reference
  response defaults to `sample.answer`.

  `mesh`: the model's mesh; the inputs are then placed replicated on it, which a model sharded over
  several processes needs (every process runs the same evaluation).
  """
  rows = []
  for i, s in enumerate(samples):
    prompt = tokenizer.encode(s.prompt)
    answer = tokenizer.encode(s.answer if references is None else references[i])
    rows.append((prompt, answer + [tokenizer.eos_token_id]))
  width = max(len(p) + len(a) for p, a in rows)
  ids = np.zeros((len(rows), width), np.int32)
  targets = np.zeros_like(ids)
  mask = np.zeros(ids.shape, np.float32)
  for i, (p, a) in enumerate(rows):
    seq = p + a
    ids[i, :len(seq)] = seq
    targets[i, :len(seq) - 1] = seq[1:]
    mask[i, len(p) - 1:len(seq) - 1] = 1.0
  place = jnp.asarray if mesh is None else (
      lambda x: host_to_global(x, NamedSharding(mesh, PartitionSpec())))
  graphdef, state = nnx.split(model)
  logp = _token_logp(graphdef, state, place(ids), place(targets), float(temperature))
  return (to_host(logp) * mask).sum(-1)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _token_logp(graphdef, state, ids, targets, temperature: float) -> jax.Array:
  # One program, not op-by-op dispatch: with the model sharded over several processes, eager ops
  # would each run their own collectives, which async dispatch may interleave differently per
  # process (a deadlock); one jitted program runs its collectives in one fixed order everywhere.
  model = nnx.merge(graphdef, state)
  logp, _ = token_logprobs(model.hidden_states(ids), model.unembedding(), targets,
                           temperature=temperature)
  return logp


def expected_accuracy(model: Decoder, tokenizer: Tokenizer, samples: list[envs.Sample],
                      temperature: float = 1.0, references: list[str] | None = None,
                      mesh: Mesh | None = None) -> float:
  """Mean over `samples` of the probability that one sampled response is exactly the answer."""
  return float(np.mean(np.exp(answer_logprobs(model, tokenizer, samples, temperature, references,
                                              mesh))))


def held_out_accuracy(model: Decoder, tokenizer: Tokenizer, sets: dict[str, list[envs.Sample]],
                      reference: Callable[[envs.Sample], str], temperature: float = 1.0,
                      mesh: Mesh | None = None) -> dict[str, float]:
  """`eval/expected_accuracy` over every held-out sample, and `eval/expected_accuracy/<set>` each."""
  probs = {name: np.exp(answer_logprobs(model, tokenizer, samples, temperature,
                                        [reference(s) for s in samples], mesh))
           for name, samples in sets.items()}
  out = {"eval/expected_accuracy": float(np.mean(np.concatenate(list(probs.values()))))}
  out.update({f"eval/expected_accuracy/{name}": float(p.mean()) for name, p in probs.items()})
  return out
