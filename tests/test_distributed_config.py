"""Where a process of a multi-process run comes from (flags' defaults: FLASHRL_*, then SLURM), and the
messages process 0 sends the others (JSON + raw arrays, no pickle): pure parts, no process started."""

import numpy as np
import pytest

from flashrl_jax.trainer import AUTO, DistributedConfig, Message, Op, first_slurm_host


@pytest.mark.parametrize("nodes,first", [
    ("node7", "node7"), ("gpu[03-05,9],cpu1", "gpu03"), ("a[1,2]-ib", "a1-ib"),
    ("h1,h2", "h1"), ("rack[2-3]n[10-11]", "rack2n10"),
])
def test_first_slurm_host(nodes, first):
  assert first_slurm_host(nodes) == first


def test_flashrl_variables_win_over_slurm_and_slurm_over_nothing():
  slurm = {"SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_JOB_NODELIST": "n[10-13]",
           "SLURM_JOB_ID": "77"}
  assert DistributedConfig.from_env(slurm) == DistributedConfig("n10:12077", 4, 2)
  assert DistributedConfig.from_env({**slurm, "FLASHRL_COORDINATOR_PORT": "5000"}).coordinator \
      == "n10:5000"
  ours = {**slurm, "FLASHRL_NUM_PROCESSES": "2", "FLASHRL_PROCESS_ID": "1",
          "FLASHRL_COORDINATOR": "10.0.0.1:1234"}
  assert DistributedConfig.from_env(ours) == DistributedConfig("10.0.0.1:1234", 2, 1)
  assert DistributedConfig.from_env({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == \
      DistributedConfig()
  assert DistributedConfig(coordinator=AUTO).is_multiprocess
  assert DistributedConfig("10.0.0.1:1234", 2, 1).coordinator_host == "10.0.0.1"


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_processes=2), "coordinator"), (dict(num_processes=2, process_id=2, coordinator="h:1"),
                                              "not in"),
    (dict(num_processes=2, coordinator="nohostport"), "host:port"),
])
def test_bad_placements_fail(kwargs, message):
  with pytest.raises(ValueError, match=message):
    DistributedConfig(**kwargs)


def test_messages_round_trip_without_pickle():
  arrays = {"ids": np.arange(12, dtype=np.int32).reshape(3, 4),
            "mask": np.array([[True, False]]), "logp": np.linspace(-1, 0, 5, dtype=np.float32),
            "empty": np.zeros((0, 3), np.int64)}
  message = Message(Op.UPDATE, {"step": 3, "extra": {"a": [1, "b"]}}, arrays)
  payload = message.encode()
  assert b"pickle" not in payload and payload[4:5] == b"{"
  back = Message.decode(payload)
  assert back.op is Op.UPDATE and back.args == message.args
  for name, value in arrays.items():
    assert back.arrays[name].dtype == value.dtype
    np.testing.assert_array_equal(back.arrays[name], value)
