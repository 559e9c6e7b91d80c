"""Helpers for rollout client tests: stub server processes and the stub's expected outputs."""

from __future__ import annotations

import asyncio
import json
import urllib.request

from flashrl_jax.fleet import LocalServers
from flashrl_jax.testing import stub_logprob, stub_next_token, stub_server_command

# Run as a script: `python -m flashrl_jax.testing._stub` works too but imports JAX via the package.
STUB_COMMAND = stub_server_command()
VOCAB = 1000


def start_stubs(num: int, model_path: str, *extra_args: str, log_dir: str,
                **kwargs) -> LocalServers:
  """`num` stub server processes logging under `log_dir` (a test's temporary directory: the
  library's default is a temp dir it keeps)."""
  return LocalServers.start(model_path, num, command=STUB_COMMAND, extra_args=extra_args,
                            startup_timeout_s=60.0, log_dir=log_dir, **kwargs)


def configure(url: str, **knobs) -> None:
  """Changes a running stub's knobs (`misbehave`, `latency_s`, `token_latency_s`, ...)."""
  req = urllib.request.Request(url + "/_stub/configure", data=json.dumps(knobs).encode(),
                               headers={"Content-Type": "application/json"}, method="POST")
  with urllib.request.urlopen(req, timeout=10) as r:
    assert r.status == 200


def expected(prompt: list[int], n: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
  """What the stub generates for `prompt` with max_new_tokens=n (no stop ids)."""
  ids, last = [], prompt[-1]
  for _ in range(n):
    last = stub_next_token(last, VOCAB)
    ids.append(last)
  return tuple(ids), tuple(stub_logprob(t) for t in ids)


def run(coro, timeout_s: float = 60.0):
  return asyncio.run(asyncio.wait_for(coro, timeout_s))
