"""The run's metrics sinks: after a resume, TensorBoard must not show the abandoned steps twice.

`metrics.jsonl` is truncated at the resumed step by `run()`; TensorBoard event files are append-only,
so the resumed writer records a purge marker (`SessionLog.START` at the first new step) that
TensorBoard honours by dropping the earlier run's events from that step on. Read back here with the
event protos themselves (TFRecord framing parsed by hand; TensorBoard is not a dependency).
"""

import glob
import os
import struct

from tensorboardX.proto import event_pb2

from flashrl_jax.controller._metrics import MetricsLogger


def read_events(logdir):
  events = []
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    at = 0
    while at < len(data):
      (length,) = struct.unpack("<Q", data[at:at + 8])
      event = event_pb2.Event()
      event.ParseFromString(data[at + 12:at + 12 + length])  # skip length + its crc
      events.append((path, event))
      at += 12 + length + 4  # payload + its crc
  return events


def test_resumed_logger_purges_later_tensorboard_steps(tmp_path):
  first = MetricsLogger(str(tmp_path))
  for step in range(1, 6):
    first.log({"step": step, "reward_mean": float(step)})
  first.close()
  resumed = MetricsLogger(str(tmp_path), resume_step=3)
  for step in (4, 5):
    resumed.log({"step": step, "reward_mean": 10.0 * step})
  resumed.close()

  events = read_events(tmp_path / "tensorboard")
  files = sorted({path for path, _ in events})
  assert len(files) == 2
  purges = [(path, e.step) for path, e in events
            if e.HasField("session_log") and e.session_log.status == event_pb2.SessionLog.START]
  assert purges == [(files[1], 4)], purges
  scalars = [(path, e.step, v.simple_value) for path, e in events if e.HasField("summary")
             for v in e.summary.value if v.tag.endswith("reward_mean")]
  assert [(s, v) for p, s, v in scalars if p == files[1]] == [(4, 40.0), (5, 50.0)]
  assert [s for p, s, _ in scalars if p == files[0]] == [1, 2, 3, 4, 5]


def test_fresh_logger_writes_no_purge_marker(tmp_path):
  logger = MetricsLogger(str(tmp_path))
  logger.log({"step": 1, "reward_mean": 0.5})
  logger.close()
  events = read_events(tmp_path / "tensorboard")
  assert not any(e.HasField("session_log") and e.session_log.status == event_pb2.SessionLog.START
                 for _, e in events)
  assert any(e.HasField("summary") for _, e in events)


def test_step_metrics_count_reward_verdicts_isolation_and_limits():
  from flashrl_jax.controller._metrics import step_sample_metrics
  from flashrl_jax.controller._samples import Group, Response
  from flashrl_jax.envs import Sample

  def response(reward, **info):
    return Response("0:0", [5], [0.0], [0], 0, "stop", reward=reward, reward_info=info)

  group = Group(0, Sample("p", ""), [1], 3, responses=[
      response(1.0, status="passed", isolation="root_namespaces", timeout_s=10.0),
      response(0.0, status="timeout", isolation="root_namespaces", timeout_s=0.6),
      response(0.0, status="wrong_answer", isolation="root_namespaces", timeout_s=0.6)])
  metrics = step_sample_metrics([group], trainer_version=0)
  assert metrics["reward_status"] == {"passed": 1, "timeout": 1, "wrong_answer": 1}
  assert metrics["reward_isolation"] == {"root_namespaces": 3}
  assert metrics["reward_timeout_s_min"] == 0.6
  assert abs(metrics["reward_timeout_s_mean"] - 11.2 / 3) < 1e-12
  plain = step_sample_metrics([Group(0, Sample("p", ""), [1], 1, responses=[response(1.0)])], 0)
  assert not any(k.startswith(("reward_status", "reward_isolation", "reward_timeout")) for k in plain)


def test_each_step_is_one_event_with_every_numeric_field(tmp_path):
  """Tried: a record mixing numbers, a bool, a list, a dict, a string and a key with characters
  TensorBoard does not allow in tags. Each step must be one event holding exactly the numeric
  fields (the tag cleaned as TensorBoard's `add_scalar` cleans it), and metrics.jsonl the whole
  record."""
  logger = MetricsLogger(str(tmp_path))
  for step in (1, 2):
    logger.log({"step": step, "time/step_s": 0.25 * step, "num_samples": 32,
                "trainer/staleness_hist/>=8": 3, "done": True, "sample_ids": [1, 2],
                "staleness_hist": {"0": 4}, "mode": "async", "loss": float("nan")})
  logger.close()
  summaries = [e for _, e in read_events(tmp_path / "tensorboard") if e.HasField("summary")]
  assert [e.step for e in summaries] == [1, 2]
  values = {v.tag: v.simple_value for v in summaries[1].summary.value}
  assert values == {"step": 2.0, "time/step_s": 0.5, "num_samples": 32.0,
                    "trainer/staleness_hist/__8": 3.0}, values
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 2 and '"sample_ids": [1, 2]' in lines[1] and '"loss": "nan"' in lines[1]
