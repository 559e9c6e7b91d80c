"""Real rollout servers for the API tests: an HF-made tiny model served by our JAX server.

The checkpoint is written by `transformers` itself (`save_pretrained`), so the same directory also
loads into HF for float64 reference log-probs, and it carries the project's character tokenizer with
its chat template, as the demo model does.
"""

from __future__ import annotations

import os

from flashrl_jax.fleet import LocalServers
from flashrl_jax.model import char_tokenizer
from tests.hf_helpers import make_hf_model


def write_hf_checkpoint(path: str, *, seed: int = 0):
  """A random tiny Qwen3 written by transformers, plus tokenizer files; returns the HF model."""
  model = make_hf_model("qwen3", seed=seed)
  tokenizer = char_tokenizer()
  model.config.eos_token_id = tokenizer.eos_token_id
  model.config.bos_token_id = tokenizer.bos_token_id
  model.config.max_position_embeddings = 1024  # room for tool schemas, one character a token
  model.save_pretrained(path, safe_serialization=True)
  tokenizer.save(path)
  return model


def start_servers(model_path: str, num: int = 1, *extra: str, log_dir: str) -> LocalServers:
  """`num` real server processes (pinned to no core: the tests share two), logging under
  `log_dir` (a test's temporary directory: the library's default is a temp dir it keeps)."""
  # No warm-up: it compiles every shape of a 1024-token context, the tests use a few of them.
  return LocalServers.start(model_path, num, extra_args=("--max_running_requests=4",
                                                         "--max_prefill_batch=2", "--nowarmup",
                                                         *extra),
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), startup_timeout_s=300,
                            log_dir=log_dir)
