"""`run(config)`: builds one RL run's parts in order, then runs its loop.

Order matters and is fixed here: plan and apply the placement (cores, visible devices) before JAX
starts; start the local rollout servers; build the learner (trainer, checkpoints, exported versions)
and restore the latest checkpoint (policy version, data position and counters come back, prompts
that were in flight are re-issued, metrics of steps after the checkpoint are rolled back so nothing
is counted twice); then open the fleet and run the loop. Rollout servers are separate OS processes
(our JAX engine started locally, or external SGLang servers); the trainer runs in this process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import enum
import json
import logging
import os
import time
from typing import Any, Callable

from flashrl_jax import _failpoints as failpoints
from flashrl_jax import envs
from flashrl_jax.controller._agent_proxy import AgentProxy
from flashrl_jax.controller._agentic import make_env_runner
from flashrl_jax.controller._agentic_config import AgentPolicy
from flashrl_jax.controller._config import RolloutBackend, RunConfig
from flashrl_jax.controller._counters import Counters
from flashrl_jax.controller._eval import held_out_accuracy
from flashrl_jax.controller._group_runner import GroupRunner
from flashrl_jax.controller._learner import Learner
from flashrl_jax.controller._loops import Loop
from flashrl_jax.controller._metrics import MetricsLogger, read_metrics
from flashrl_jax.controller._placement import Placement, applied, plan_placement
from flashrl_jax.controller._source import PromptSource, task_source
from flashrl_jax.fleet import (Fleet, LocalServers, RolloutClient, SamplingParams, reap_orphans,
                               record_pids)
from flashrl_jax.model import load_tokenizer, read_config
from flashrl_jax.rollout import ChatTemplate
from flashrl_jax.testing import stub_server_command
from flashrl_jax.trainer import (CheckpointConfig, Checkpointer, MeshConfig, Trainer,
                                 VersionStore, make_mesh)

log = logging.getLogger(__name__)


def config_to_json(config: Any) -> Any:
  if dataclasses.is_dataclass(config):
    return {f.name: config_to_json(getattr(config, f.name)) for f in dataclasses.fields(config)}
  if isinstance(config, enum.Enum):
    return config.value
  if isinstance(config, (list, tuple)):
    return [config_to_json(v) for v in config]
  return config


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


def _start_servers(config: RunConfig, placement: Placement, log_dir: str, vocab_size: int,
                   pid_file: str) -> LocalServers:
  r = config.rollout
  # A trajectory must fit one packed training row, so that is the servers' context too.
  extra = (f"--max_running_requests={r.max_running_requests}",
           f"--context_length={config.train.batch.row_length}", "--weight_version=0")
  if failpoints.needs_engine_kill():  # a fault test stops an engine thread through its route
    extra += ("--enable_fault_injection",)
  command = None
  if r.backend is RolloutBackend.STUB:  # run as a script: no JAX import, starts in a blink
    command = stub_server_command()
    extra = (f"--max_running_requests={r.max_running_requests}", f"--vocab_size={vocab_size}",
             "--weight_version=0")
  return LocalServers.start(config.model_path, r.num_servers, cpu_sets=placement.server_cpus,
                            server_env=placement.server_env, extra_args=extra, log_dir=log_dir,
                            command=command,
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


def run(config: RunConfig, *, on_step: Callable[[dict], None] | None = None) -> RunSummary:
  workdir = config.resolved_workdir()
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(config_to_json(config), f, indent=1)
  model_config = read_config(config.model_path)
  placement = plan_placement(config, sorted(os.sched_getaffinity(0)))
  with applied(placement), _local_servers(config, placement, workdir,
                                          model_config.vocab_size) as servers:
    urls = servers.urls if servers is not None else list(config.rollout.sglang_urls)
    return _run(config, workdir, urls, servers, placement, on_step)


def _learner(config: RunConfig, workdir: str, model_config, tokenizer,
             task: envs.TaskSource) -> Learner:
  mesh = make_mesh(MeshConfig.parse(config.mesh))
  trainer = Trainer(model_config, config.train, mesh, seed=config.seed,
                    init_params=config.model_path)
  evaluator = None
  # Exact evaluation needs one correct response per prompt: exact-match and reasoning-gym tasks.
  eval_sets = task.eval_sets() if config.task.reward in (
      envs.RewardKind.EXACT_MATCH, envs.RewardKind.REASONING_GYM) else {}
  if eval_sets and config.eval_samples:
    evaluator = lambda model: held_out_accuracy(model, tokenizer, eval_sets, task.reference,
                                                config.rollout.temperature)
  checkpointer = Checkpointer(CheckpointConfig(directory=os.path.join(workdir, "checkpoints"),
                                               max_to_keep=config.keep_checkpoints))
  return Learner(trainer, VersionStore(os.path.join(workdir, "versions")), checkpointer,
                 keep_versions=config.keep_versions, evaluator=evaluator)


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
         placement: Placement, on_step) -> RunSummary:
  tokenizer = load_tokenizer(config.model_path)
  model_config = read_config(config.model_path)
  source = PromptSource(task_source(config))
  learner = _learner(config, workdir, model_config, tokenizer, source.task)
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
      # CPU async: the event loop (client streaming, dispatch, scoring) runs on the rollout side's
      # cores, and every `asyncio.to_thread` call (training, export, evaluation) on this process's
      # own, so the trainer's core is not shared with the controller.
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
        runner = GroupRunner(fleet, reward_fn, tokenizer, sampling, config.group_size)
      await Loop(config, fleet=fleet, learner=learner, source=source, runner=runner,
                 counters=counters, logger=logger, start_step=start_step,
                 initial_eval=initial_eval, on_step=on_step).run()

  start = time.perf_counter()
  try:
    asyncio.run(main())
  finally:
    learner.close()
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
