"""Where a run's processes go (`plan_placement`, a pure function of the config and the cores)."""

import dataclasses

from flashrl_jax.controller import RolloutConfig, plan_placement
from flashrl_jax.controller._run import engine_server_args
from experiments.configs import bench_rlvr_longtail


def test_one_server_per_rollout_core_when_num_servers_is_zero():
  config = bench_rlvr_longtail.get_config()
  config = config.replace(rollout=dataclasses.replace(config.rollout, num_servers=0))
  sync = plan_placement(config.replace(mode="sync", async_ratio=0), [0, 1])
  assert sync.num_servers == 2 and sync.server_cpus == ((0,), (1,))
  split = plan_placement(config.replace(mode="async", async_ratio=2), [0, 1])  # 1 + 1 cores
  assert split.num_servers == 1 and split.server_cpus == ((0,),)
  # The event loop runs with the learner process (None: the trainer's cores), off the server's.
  assert split.trainer_cpus == (1,) and split.controller_cpus is None
  # A trainer inside the controller's process keeps the loop off its core (the GIL is shared).
  in_process = plan_placement(config.replace(mode="async", async_ratio=2, learner_process=False),
                              [0, 1])
  assert in_process.trainer_cpus == (1,) and in_process.controller_cpus == (0,)
  assert split.server_background == (False,)  # the trainer's core is its own
  assert sync.server_background is None  # sync never trains while generating
  # 2 + 1: a server on each core, the one on the trainer's core in the background.
  shared = plan_placement(config.replace(mode="async", async_ratio=2,
                                         resources=dataclasses.replace(
                                             config.resources, rollout_devices=2,
                                             train_devices=1)), [0, 1])
  assert shared.server_cpus == ((0,), (1,)) and shared.trainer_cpus == (1,)
  assert shared.server_background == (False, True)
  # An explicit count still shares the rollout core round-robin.
  two = config.replace(mode="async", rollout=dataclasses.replace(config.rollout, num_servers=2))
  assert plan_placement(two, [0, 1]).server_cpus == ((0,), (0,))


def test_negative_server_count_is_refused():
  import pytest
  with pytest.raises(ValueError, match="num_servers must be >= 0"):
    RolloutConfig(num_servers=-1)
  with pytest.raises(ValueError, match="num_continuous_decode_steps"):
    RolloutConfig(num_continuous_decode_steps=0)


def test_local_engine_servers_get_the_decode_block_of_the_config():
  config = bench_rlvr_longtail.get_config()
  config = config.replace(rollout=dataclasses.replace(config.rollout,
                                                      num_continuous_decode_steps=7))
  assert "--num_continuous_decode_steps=7" in engine_server_args(config)


def test_gpu_placement_separates_or_shares_the_accelerators():
  """Async gives the trainer the GPUs after the rollout ones; `share_accelerators` (and sync mode)
  gives it the first ones, which the servers use too: one GPU serves both, as in sync mode."""
  from flashrl_jax.controller import ResourceConfig
  config = bench_rlvr_longtail.get_config()
  on_gpu = lambda mode, **kw: config.replace(
      mode=mode, async_ratio=2 if mode == "async" else 0,
      resources=ResourceConfig(platform="gpu", **kw))
  split = plan_placement(on_gpu("async", rollout_devices=2, train_devices=1), range(8))
  assert split.num_servers == 2
  assert [env["CUDA_VISIBLE_DEVICES"] for env in split.server_env] == ["0", "1"]
  assert dict(split.environ) == {"CUDA_VISIBLE_DEVICES": "2"}
  assert split.trainer_cpus is None and split.server_cpus is None  # no core pinning on GPU
  shared = plan_placement(on_gpu("async", rollout_devices=1, train_devices=1,
                                 share_accelerators=True), range(8))
  assert [env["CUDA_VISIBLE_DEVICES"] for env in shared.server_env] == ["0"]
  assert dict(shared.environ) == {"CUDA_VISIBLE_DEVICES": "0"}
  sync = plan_placement(on_gpu("sync"), range(8))
  assert dict(sync.environ) == dict(shared.environ)
  assert sync.server_env == shared.server_env


def test_sharing_accelerators_is_refused_on_cpu():
  import pytest
  from flashrl_jax.controller import ResourceConfig
  with pytest.raises(ValueError, match="share_accelerators is for GPUs"):
    ResourceConfig(platform="cpu", share_accelerators=True)
  # A TPU chip takes one process at a time: the servers and the trainer could not both open it.
  with pytest.raises(ValueError, match="opened by one process at a time"):
    ResourceConfig(platform="tpu", share_accelerators=True)
  assert ResourceConfig(platform="gpu", share_accelerators=True).share_accelerators


def test_a_run_meant_for_an_accelerator_refuses_the_cpu_backend():
  # JAX falls back to the CPU when no GPU is visible: the learner says so instead of training there.
  import pytest
  from flashrl_jax._backend import check_backend
  check_backend("cpu", "the trainer")  # this machine's backend
  with pytest.raises(RuntimeError, match="resources.platform is 'gpu' but JAX's backend in the "
                     "trainer"):
    check_backend("gpu", "the trainer")


def test_a_rollout_server_meant_for_an_accelerator_refuses_the_cpu_backend(tmp_path):
  # The same fallback in a server process: it would decode on the CPU; it exits saying why, before
  # it loads anything (the model directory here is empty).
  import subprocess
  import sys
  proc = subprocess.run([sys.executable, "-m", "flashrl_jax.rollout.server",
                         f"--model_path={tmp_path}", "--port=0", "--platform=gpu"],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert "JAX's backend in this rollout server is 'cpu'" in proc.stderr
