"""`run(config)`: builds one RL run's parts in order, then runs its loop.

Order matters and is fixed here: join `jax.distributed` (several processes), plan and apply the
placement (cores, visible devices) before JAX starts; connect the processes (`ProcessGroup`); on
process 0, start the local rollout servers, build the learner (trainer, checkpoints, exported
versions; every process builds its own at the same time) and restore the latest checkpoint (policy
version, data position and counters come back, prompts that were in flight are re-issued, metrics
of steps after the checkpoint are rolled back so nothing is counted twice); then open the fleet and
run the loop. The other processes only follow process 0's learner (`follow`). Rollout servers are
separate OS processes (our JAX engine started locally, or external SGLang servers).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import socket
import time
from typing import Callable

import jax

from flashrl_jax import _failpoints as failpoints
from flashrl_jax import envs
from flashrl_jax._gc import freeze_startup_objects
from flashrl_jax.controller._agent_proxy import AgentProxy
from flashrl_jax.controller._agentic import make_env_runner
from flashrl_jax.controller._agentic_config import AgentPolicy
from flashrl_jax.controller._config import RolloutBackend, RunConfig, config_to_json
from flashrl_jax.controller._counters import Counters
from flashrl_jax.controller._group_runner import GroupRunner
from flashrl_jax.controller._learner import Learner, follow
from flashrl_jax.controller._learner_process import LearnerProcess
from flashrl_jax.controller._loops import Loop
from flashrl_jax.controller._metrics import MetricsLogger, read_metrics
from flashrl_jax.controller._placement import Placement, applied, plan_placement
from flashrl_jax.controller._source import PromptSource, task_source
from flashrl_jax.fleet import (Fleet, LocalServers, RolloutClient, SamplingParams, reap_orphans,
                               record_pids)
from flashrl_jax.model import load_tokenizer, read_config
from flashrl_jax.rollout import ChatTemplate
from flashrl_jax.testing import stub_server_command
from flashrl_jax.trainer import (DistributedConfig, ProcessGroup, initialize_distributed,
                                 shutdown_distributed)

log = logging.getLogger(__name__)


def _truncate_metrics(path: str, last_step: int) -> None:
  """Drops records of steps after the restored checkpoint (they are about to be redone)."""
  if not os.path.exists(path):
    return
  kept = [r for r in read_metrics(path) if int(r["step"]) <= last_step]
  with open(path, "w") as f:
    for record in kept:
      f.write(json.dumps(record, sort_keys=True) + "\n")


@dataclasses.dataclass
class RunSummary:
  steps: int
  samples_trained: int
  wall_s: float
  samples_per_s: float
  final_policy_version: int
  counters: dict[str, int]
  workdir: str


def engine_server_args(config: RunConfig) -> tuple[str, ...]:
  """The flags a run gives its local JAX engine servers (the simulator's calibration starts its
  servers with the same)."""
  # A trajectory must fit one packed training row, so that is the servers' context too.
  return (f"--max_running_requests={config.rollout.max_running_requests}",
          f"--num_continuous_decode_steps={config.rollout.num_continuous_decode_steps}",
          f"--context_length={config.train.batch.row_length}", "--weight_version=0",
          f"--platform={config.resources.platform}")


def _start_servers(config: RunConfig, placement: Placement, log_dir: str, vocab_size: int,
                   pid_file: str) -> LocalServers:
  r = config.rollout
  if r.backend is RolloutBackend.STUB:  # run as a script: no JAX import, starts in a blink
    command = stub_server_command()
    extra = (f"--max_running_requests={r.max_running_requests}", f"--vocab_size={vocab_size}",
             f"--context_length={config.train.batch.row_length}", "--weight_version=0")
  else:
    command, extra = None, engine_server_args(config)
    if failpoints.needs_engine_kill():  # a fault test stops an engine thread through its route
      extra += ("--enable_fault_injection",)
  return LocalServers.start(config.model_path, placement.num_servers,
                            cpu_sets=placement.server_cpus,
                            server_env=placement.server_env, extra_args=extra, log_dir=log_dir,
                            command=command, background=placement.server_background,
                            on_spawn=lambda servers: record_pids(pid_file, servers))


@contextlib.contextmanager
def _local_servers(config: RunConfig, placement: Placement, workdir: str, vocab_size: int):
  """The run's local servers (None for external SGLang), recorded for `reap_orphans`, stopped after."""
  pid_file = os.path.join(workdir, "server_pids.json")
  reap_orphans(pid_file)  # servers of a previous controller killed with SIGKILL
  if config.rollout.backend is RolloutBackend.SGLANG:
    yield None
    return
  # Every process is recorded as it starts (a restart too), for `reap_orphans` after a SIGKILL.
  servers = _start_servers(config, placement, os.path.join(workdir, "server_logs"), vocab_size,
                           pid_file)
  try:
    yield servers
  finally:
    servers.stop()
    if os.path.exists(pid_file):
      os.remove(pid_file)


def run(config: RunConfig, *, on_step: Callable[[dict], None] | None = None,
        distributed: DistributedConfig | None = None) -> RunSummary | None:
  """Runs one RL job; returns its summary on process 0 and None on the others.

  `distributed`: this process's place in a multi-process run (default: the only process). Every
  process joins `jax.distributed`, builds the same mesh and train state and runs every jitted step;
  process 0 alone runs the loop, the fleet, the rewards and the logging (`Learner`, `follow`).
  """
  distributed = initialize_distributed(distributed or DistributedConfig())
  workdir = config.resolved_workdir()
  leader = distributed.process_id == 0
  # Only process 0 hosts servers and the controller; the others are trainer processes only.
  placement = plan_placement(config, sorted(os.sched_getaffinity(0))) if leader else Placement()
  with applied(placement):
    group = None
    if distributed.is_multiprocess:
      group = ProcessGroup.connect(distributed.coordinator_host or _own_address())
    if not leader:
      follow(config, workdir, group)
      shutdown_distributed()
      return None
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(config_to_json(config), f, indent=1)
    model_config = read_config(config.model_path)
    with _local_servers(config, placement, workdir, model_config.vocab_size) as servers:
      if group is not None and servers is not None:
        group.add_cleanup(servers.stop)  # process 0 stopped by a lost process: no orphans
      urls = servers.urls if servers is not None else list(config.rollout.sglang_urls)
      summary = _run(config, workdir, urls, servers, placement, on_step, group)
  shutdown_distributed()
  return summary


def _own_address() -> str:
  """This host's address as other hosts reach it (when the cluster, not a flag, set up JAX)."""
  return socket.gethostbyname(socket.gethostname())


def agent_proxy(config: RunConfig, fleet: Fleet, tokenizer, sampling: SamplingParams
                ) -> AgentProxy:
  """The OpenAI endpoint agent code is given (`agentic.policy=openai`), rendering prompts with
  the policy's own chat template."""
  template = ChatTemplate.from_model_dir(config.model_path)
  if template is None:
    raise ValueError(f"agentic.policy=openai needs a chat template in {config.model_path}"
                     "/tokenizer_config.json.")
  return AgentProxy(fleet, tokenizer, template, dataclasses.replace(
      sampling, max_new_tokens=config.agentic.turn_max_new_tokens))


def _run(config: RunConfig, workdir: str, urls: list[str], servers: LocalServers | None,
         placement: Placement, on_step, group: ProcessGroup | None) -> RunSummary:
  tokenizer = load_tokenizer(config.model_path)
  model_config = read_config(config.model_path)
  source = PromptSource(task_source(config))
  if group is None and config.learner_process:
    # Started from this (main) thread, pinned to the trainer's cores: the child inherits both.
    learner = LearnerProcess.start(config, workdir,
                                   compilation_cache_dir=jax.config.jax_compilation_cache_dir)
  else:
    learner = Learner.create(config, workdir, task=source.task, group=group)
  counters, start_step = Counters(), 0
  extra = learner.restore()
  if extra is not None:
    source.restore(extra["source"])
    counters = Counters.from_json(extra.get("counters", {}))
    start_step = int(extra["step"])
    log.info("resumed from step %d (policy version %d)", start_step, learner.policy_version)
  restored_samples = counters.samples_trained
  _truncate_metrics(os.path.join(workdir, "metrics.jsonl"), start_step)
  logger = MetricsLogger(workdir, resume_step=start_step)
  eos = tuple(i for i in ([tokenizer.eos_token_id] + list(model_config.eos_token_ids))
              if i is not None)
  r = config.rollout
  sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                            top_p=r.top_p, stop_token_ids=tuple(sorted(set(eos))))
  reward_fn = envs.make_reward_fn(config.task.reward_config())
  initial_eval = learner.evaluate() if start_step == 0 else None

  async def main() -> None:
    if placement.controller_cpus is not None:
      # CPU async with the trainer in this process: the event loop (client streaming, dispatch,
      # scoring) runs on the rollout side's cores, and every `asyncio.to_thread` call (training,
      # export, evaluation) on this process's own, so the trainer's core is not shared with it.
      train_cores = sorted(os.sched_getaffinity(0))
      asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(
          thread_name_prefix="trainer", initializer=os.sched_setaffinity, initargs=(0, train_cores)))
      os.sched_setaffinity(0, placement.controller_cpus)  # this thread only (per-thread affinity)
    client = RolloutClient(urls, request_timeout_s=r.request_timeout_s, max_retries=r.max_retries,
                           vocab_size=model_config.vocab_size, router_url=r.router_url)
    # Restarts dead or hung local servers; publishes skip (and recover) servers that fail.
    pid_file = os.path.join(workdir, "server_pids.json") if servers is not None else None
    async with Fleet(client, pause_mode=r.pause_mode, servers=servers,
                     pid_file=pid_file) as fleet, contextlib.AsyncExitStack() as stack:
      await fleet.wait_healthy(timeout_s=300)
      proxy = None
      if config.task.env is not None and config.agentic.policy is AgentPolicy.OPENAI:
        proxy = await stack.enter_async_context(agent_proxy(config, fleet, tokenizer, sampling))
      if config.task.env is not None:
        runner = make_env_runner(config, fleet, tokenizer, sampling, counters, proxy)
      else:
        runner = GroupRunner(fleet, reward_fn, tokenizer, sampling, config.group_size,
                             prompt_replication=r.prompt_replication)
      freeze_startup_objects()  # (with the learner in this process: its programs too)
      await Loop(config, fleet=fleet, learner=learner, source=source, runner=runner,
                 counters=counters, logger=logger, start_step=start_step,
                 initial_eval=initial_eval, on_step=on_step).run()

  start = time.perf_counter()
  error = None
  try:
    asyncio.run(main())
  except BaseException as e:
    error = f"{type(e).__name__}: {e}"
    raise
  finally:
    learner.close(error)
    logger.close()
  wall = time.perf_counter() - start
  trained = counters.samples_trained - restored_samples
  summary = RunSummary(steps=config.steps, samples_trained=counters.samples_trained,
                       wall_s=wall, samples_per_s=trained / max(wall, 1e-9),
                       final_policy_version=learner.policy_version, counters=counters.to_json(),
                       workdir=workdir)
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(dataclasses.asdict(summary), f, indent=1)
  return summary
