"""`run(config)`: wires servers, trainer, checkpoints, client and a loop into one RL run.

Process layout ("slices"): rollout servers are separate OS processes (our JAX engine started locally,
or external SGLang servers); the trainer runs in this process. Async mode pins the servers and the
trainer to disjoint cores (the resource split is a flag); sync mode lets them time-share all cores,
which is the same budget. A restart with the same command resumes from the latest checkpoint: policy
version, data position and counters come back, prompts that were in flight are re-issued, and
metrics of steps after the checkpoint are rolled back so nothing is counted twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import enum
import json
import logging
import os
import shutil
import sys
import time
from typing import Any, Callable

from flashrl_jax import envs
from flashrl_jax.controller._agentic import make_env_runner, run_agentic_sync
from flashrl_jax.controller._config import Mode, RolloutBackend, RunConfig
from flashrl_jax.controller._group_runner import GroupRunner
from flashrl_jax.controller._eval import expected_accuracy
from flashrl_jax.controller._handoff import export_current, publish
from flashrl_jax.controller._loops import LoopContext, run_async, run_sync
from flashrl_jax.controller._metrics import MetricsLogger, read_metrics
from flashrl_jax.controller._source import PromptSource
from flashrl_jax.fleet import (
    LocalServers, RolloutClient, SamplingParams, Supervisor, reap_orphans, record_pids, split_cpus)
from flashrl_jax.model import load_tokenizer, read_config
from flashrl_jax.testing import _stub
from flashrl_jax.trainer import MeshConfig, Trainer, abstract_train_state, make_mesh
from flashrl_jax.trainer._checkpoint import CheckpointConfig, Checkpointer
from flashrl_jax.trainer._export import VersionStore

log = logging.getLogger(__name__)


def config_to_json(config: Any) -> Any:
  if dataclasses.is_dataclass(config):
    return {f.name: config_to_json(getattr(config, f.name)) for f in dataclasses.fields(config)}
  if isinstance(config, enum.Enum):
    return config.value
  if isinstance(config, (list, tuple)):
    return [config_to_json(v) for v in config]
  return config


def _prompt_source(config: RunConfig) -> PromptSource:
  task = config.task
  if task.env is not None:  # the prompt index is the level seed: the source only numbers episodes
    return PromptSource(samples=[envs.Sample(prompt="", answer="", id="env")], seed=task.seed)
  if task.synthetic is not None:
    return PromptSource(synthetic=task.synthetic, seed=task.seed)
  loaded = envs.load_dataset(task.dataset_path)
  for error in loaded.errors:
    log.error("dataset %s row %d skipped: %s", task.dataset_path, error.row, error.message)
  return PromptSource(samples=list(loaded.samples), seed=task.seed)


def _truncate_metrics(path: str, last_step: int) -> None:
  """Drops records of steps after the restored checkpoint (they are about to be redone)."""
  if not os.path.exists(path):
    return
  kept = [r for r in read_metrics(path) if int(r["step"]) <= last_step]
  with open(path, "w") as f:
    for record in kept:
      f.write(json.dumps(record, sort_keys=True) + "\n")


def _drop_future_versions(store: VersionStore, version: int) -> None:
  """Deletes exports newer than the restored policy: a killed run wrote them after its last
  checkpoint, so their weights are not the ones this run will train (and must never be served)."""
  for stale in [v for v in store.versions() if v > version]:
    log.warning("removing policy version %d exported after the restored checkpoint", stale)
    shutil.rmtree(store.path(stale))


@dataclasses.dataclass
class RunSummary:
  steps: int
  samples_trained: int
  wall_s: float
  samples_per_s: float
  final_policy_version: int
  counters: dict[str, int]
  workdir: str


def _start_servers(config: RunConfig, cores: list[int], log_dir: str,
                   vocab_size: int) -> LocalServers:
  r = config.rollout
  per_server = None
  if config.resources.platform == "cpu":
    # Disjoint cores when there are enough; otherwise servers share the rollout cores round-robin
    # (still disjoint from the trainer's).
    per_server = (split_cpus(r.num_servers, cores) if r.num_servers <= len(cores)
                  else [[cores[i % len(cores)]] for i in range(r.num_servers)])
  gpu_ids = tpu_ids = None
  if config.resources.platform in ("gpu", "tpu"):
    # Accelerators 0..R-1 serve rollout (split evenly over the servers); the trainer gets R..R+T-1.
    devices = config.resources.rollout_devices
    if devices % r.num_servers:
      raise ValueError(f"{devices} rollout devices do not split evenly over {r.num_servers} servers.")
    per = devices // r.num_servers
    ids = [list(range(i * per, (i + 1) * per)) for i in range(r.num_servers)]
    if config.resources.platform == "gpu":
      gpu_ids = ids
    else:
      if per != 1:
        raise ValueError("TPU rollout servers take one chip each; use --rollout_devices = servers.")
      tpu_ids = [i[0] for i in ids]
  # A trajectory must fit one packed training row, so that is the servers' context too.
  extra = (f"--max_running_requests={r.max_running_requests}",
           f"--context_length={config.train.batch.row_length}", "--weight_version=0")
  command = None
  if r.backend is RolloutBackend.STUB:  # run as a script: no JAX import, starts in a blink
    command = (sys.executable, _stub.__file__)
    extra = (f"--max_running_requests={r.max_running_requests}", f"--vocab_size={vocab_size}",
             "--weight_version=0")
  return LocalServers.start(config.model_path, r.num_servers, cpu_sets=per_server, gpu_ids=gpu_ids,
                            tpu_ids=tpu_ids, extra_args=extra, log_dir=log_dir, command=command)


def run(config: RunConfig, *, on_step: Callable[[dict], None] | None = None) -> RunSummary:
  workdir = config.resolved_workdir()
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(config_to_json(config), f, indent=1)
  tokenizer = load_tokenizer(config.model_path)
  model_config = read_config(config.model_path)

  cores = sorted(os.sched_getaffinity(0))
  if config.mode is Mode.ASYNC:
    rollout_cores, train_cores = config.resources.cpu_split(cores)
  else:
    rollout_cores = train_cores = cores
  servers = None
  pid_file = os.path.join(workdir, "server_pids.json")
  reap_orphans(pid_file)  # servers of a previous controller killed with SIGKILL
  if config.rollout.backend is not RolloutBackend.SGLANG:
    servers = _start_servers(config, rollout_cores, os.path.join(workdir, "server_logs"),
                             model_config.vocab_size)
    record_pids(pid_file, servers)
    urls = servers.urls
  else:
    urls = list(config.rollout.sglang_urls)
  try:
    controller_cores = None
    if config.resources.platform == "cpu":
      os.sched_setaffinity(0, train_cores)  # before JAX starts its thread pool
      if config.mode is Mode.ASYNC:
        controller_cores = rollout_cores
    else:  # before JAX initialises its backend: the trainer sees only its own accelerators
      first = config.resources.rollout_devices if config.mode is Mode.ASYNC else 0
      visible = ",".join(str(i) for i in range(first, first + config.resources.train_devices))
      variable = "CUDA_VISIBLE_DEVICES" if config.resources.platform == "gpu" else "TPU_VISIBLE_CHIPS"
      os.environ[variable] = visible
    return _run_with_servers(config, workdir, urls, tokenizer, model_config, on_step, servers,
                             controller_cores=controller_cores)
  finally:
    if config.resources.platform == "cpu":
      os.sched_setaffinity(0, cores)
    if servers is not None:
      servers.stop()
      if os.path.exists(pid_file):
        os.remove(pid_file)


def _run_with_servers(config, workdir, urls, tokenizer, model_config, on_step,
                      servers: LocalServers | None = None,
                      controller_cores: list[int] | None = None) -> RunSummary:
  """`controller_cores`: CPU async only. The event loop (client streaming, dispatch, scoring
  callbacks) then runs on these (the rollout side's) cores, and every `asyncio.to_thread` call
  (training, export, evaluation) on this process's own cores, so the trainer's core is not shared
  with the controller; JAX's thread pool, started before the split, stays on the trainer's cores."""
  mesh = make_mesh(MeshConfig.parse(config.mesh))
  trainer = Trainer(model_config, config.train, mesh, seed=config.seed,
                    init_params=config.model_path)
  source = _prompt_source(config)
  checkpointer = Checkpointer(CheckpointConfig(directory=os.path.join(workdir, "checkpoints"),
                                               max_to_keep=config.keep_checkpoints))
  counters_restored: dict[str, int] = {}
  start_step = 0
  restored = checkpointer.restore_latest(
      abstract_train_state(model_config, config.train, mesh)[1])
  if restored is not None:
    state, extra = restored
    trainer.set_state(state)
    source.restore(extra["source"])
    counters_restored = dict(extra.get("counters", {}))
    start_step = int(extra["step"])
    log.info("resumed from step %d (policy version %d)", start_step, trainer.policy_version)
  logger_path = os.path.join(workdir, "metrics.jsonl")
  _truncate_metrics(logger_path, start_step)
  logger = MetricsLogger(workdir, resume_step=start_step)
  store = VersionStore(os.path.join(workdir, "versions"))
  _drop_future_versions(store, trainer.policy_version)
  eos = tuple(i for i in ([tokenizer.eos_token_id] + list(model_config.eos_token_ids))
              if i is not None)
  r = config.rollout
  sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                            top_p=r.top_p, stop_token_ids=tuple(sorted(set(eos))))
  reward_fn = envs.make_reward_fn(envs.RewardConfig(kind=config.task.reward))
  evaluate = None
  if config.task.synthetic is not None and config.task.reward is envs.RewardKind.EXACT_MATCH:
    eval_set = envs.generate_synthetic(config.task.synthetic, config.eval_samples,
                                       seed=config.task.seed + 1_000_003)
    evaluate = lambda: expected_accuracy(trainer.model(), tokenizer, eval_set,
                                         config.rollout.temperature)

  def save_checkpoint(step: int, pending: list[int]) -> dict[str, float]:
    due = step == config.steps or (config.checkpoint_every and step % config.checkpoint_every == 0)
    if not due:
      return {}
    t0 = time.perf_counter()
    checkpointer.save(step, trainer.state, {
        "step": step, "source": source.state(in_flight=pending), "counters": ctx.counters,
        "policy_version": trainer.policy_version})
    return {"time/checkpoint_s": time.perf_counter() - t0}

  async def main() -> None:
    nonlocal ctx
    if controller_cores is not None:
      train_cores = sorted(os.sched_getaffinity(0))
      asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(
          thread_name_prefix="trainer", initializer=os.sched_setaffinity, initargs=(0, train_cores)))
      os.sched_setaffinity(0, controller_cores)  # this thread only (Linux affinity is per thread)
    async with RolloutClient(urls, request_timeout_s=r.request_timeout_s,
                             max_retries=r.max_retries, vocab_size=model_config.vocab_size) as client:
      await client.wait_healthy(timeout_s=300)
      # Servers start from whatever they loaded; make them serve exactly the trainer's version.
      path = await asyncio.to_thread(export_current, trainer, store)
      await client.update_weights_from_disk(path, str(trainer.policy_version))
      if config.task.env is not None:
        runner = make_env_runner(config, client, tokenizer, sampling, lambda: ctx.published_version)
      else:
        runner = GroupRunner(client, reward_fn, tokenizer, sampling, config.group_size,
                             lambda: ctx.published_version)
      ctx = LoopContext(config=config, trainer=trainer, client=client, runner=runner,
                        source=source, store=store, logger=logger,
                        save_checkpoint=save_checkpoint, on_step=on_step or (lambda rec: None),
                        start_step=start_step, published_version=trainer.policy_version,
                        evaluate=evaluate, initial_eval=initial_eval)
      ctx.counters.update(counters_restored)
      ctx.last_dropped = ctx.counters["dropped_stale"]
      if config.task.env is not None:
        runner.stats.bind(ctx.counters)
        ctx.extra_metrics = runner.stats.report
      # Restarts dead or hung local servers; publishes skip (and recover) servers that fail.
      supervisor = Supervisor(
          client, servers=servers, counters=ctx.counters,
          current_version=lambda: (store.path(ctx.published_version), ctx.published_version),
          pid_file=os.path.join(workdir, "server_pids.json") if servers is not None else None)
      ctx.publish = lambda: publish(trainer, store, supervisor, r.pause_mode,
                                      keep_versions=config.keep_versions)
      if config.mode is Mode.ASYNC:
        loop = run_async
      else:
        loop = run_agentic_sync if config.task.env is not None else run_sync
      async with supervisor:
        await loop(ctx)

  ctx: LoopContext | None = None
  initial_eval = evaluate() if evaluate is not None and start_step == 0 else None
  start = time.perf_counter()
  try:
    asyncio.run(main())
  finally:
    checkpointer.wait()
    checkpointer.close()
    logger.close()
  wall = time.perf_counter() - start
  trained = ctx.counters["samples_trained"] - counters_restored.get("samples_trained", 0)
  summary = RunSummary(steps=config.steps, samples_trained=ctx.counters["samples_trained"],
                       wall_s=wall, samples_per_s=trained / max(wall, 1e-9),
                       final_policy_version=trainer.policy_version, counters=dict(ctx.counters),
                       workdir=workdir)
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(dataclasses.asdict(summary), f, indent=1)
  return summary
