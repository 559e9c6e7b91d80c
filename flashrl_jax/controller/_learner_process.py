"""The learner in a process of its own, behind the `Learner` interface: `LearnerProcess`.

Why: the controller's event loop (HTTP to the servers, scoring, dispatch) is Python, and so is the
work around every jitted train step (placing the batch, dispatching the step, reading its metrics).
In one process they share the GIL, and while rollouts stream in (async mode) each time the trainer
thread takes the GIL back it can wait a whole switch interval. Measured on the long-tail benchmark's
train step (2 cores, `experiments/benchmarks/async_vs_sync.py` config): 56 ms per 1500 tokens alone,
279 ms beside a busy Python thread in the same process, 48 ms beside two busy processes at the
idle scheduling class; the async runs' train step took 0.13-0.16 s against sync's 0.045 s. In its
own process the trainer has its own interpreter and its own cores.

The controller sends it the operations a multi-process run sends its followers (`Message`: a JSON
header and raw arrays, no pickle) over a socket pair; the batch is packed on the controller side,
as for followers. Requests are answered in order with RESULT (the value and the policy version
after it) or ERROR. `hold` and `collect_garbage` are one-way: the handoff runs them on the event
loop while an update may be running, and they only need to follow that update, which they do (the
process runs messages in order).

The process dies with the thread that started it (PR_SET_PDEATHSIG: start it from the main thread),
and a `kill` failpoint hit inside it SIGKILLs the controller too (`failpoints.RUN_PID_ENV`), so a
fault test kills the run wherever its failpoint is.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from typing import Any

from flashrl_jax import _failpoints as failpoints
from flashrl_jax._gc import freeze_startup_objects
from flashrl_jax.controller._config import RunConfig, config_from_json, config_to_json
from flashrl_jax.trainer import Message, Op, Trajectory, pack, receive_message, send_message

log = logging.getLogger(__name__)

_ONE_WAY = (Op.HOLD, Op.COLLECT)


class LearnerProcessError(RuntimeError):
  """An operation failed in the learner process (its type, message and traceback are in the text),
  or the process is gone."""


class LearnerProcess:
  """`Learner`'s interface, run in a child process (see the module docstring). `start` it from the
  main thread, with this process pinned where the trainer belongs (the child inherits it)."""

  def __init__(self, proc: subprocess.Popen, sock: socket.socket, config: RunConfig,
               policy_version: int):
    self._proc, self._sock, self._config = proc, sock, config
    self._policy_version = policy_version
    self._call_lock = threading.Lock()  # one request waiting for its answer at a time
    self._send_lock = threading.Lock()  # one-way messages may be sent while a request waits
    self.num_processes = 1

  @classmethod
  def start(cls, config: RunConfig, workdir: str, *,
            compilation_cache_dir: str | None = None) -> LearnerProcess:
    """Starts the process and builds the learner there (`Learner.create`); returns once it is
    built (raises `LearnerProcessError` with the child's error if it could not be)."""
    ours, theirs = socket.socketpair()
    env = dict(os.environ, **{failpoints.RUN_PID_ENV: str(os.getpid())})
    entry = f"from {__name__} import main; main()"  # its command line names this module
    proc = subprocess.Popen([sys.executable, "-c", entry, str(theirs.fileno())],
                            pass_fds=(theirs.fileno(),), env=env)
    theirs.close()
    self = cls(proc, ours, config, policy_version=0)
    self._request(Op.INIT, {"config": config_to_json(config), "workdir": workdir,
                            "compilation_cache_dir": compilation_cache_dir})
    return self

  @property
  def policy_version(self) -> int:
    return self._policy_version

  @property
  def pid(self) -> int:
    return self._proc.pid

  # --- the Learner interface --------------------------------------------------------------------

  def update(self, trajectories: list[Trajectory]) -> dict[str, float]:
    train = self._config.train
    batch = pack(trajectories, train.batch, train.num_minibatches)
    return self._request(Op.UPDATE, arrays={f.name: getattr(batch, f.name)
                                            for f in dataclasses.fields(batch)})

  def export(self) -> str:
    return self._request(Op.EXPORT)

  def reexport(self) -> str:
    return self._request(Op.REEXPORT)

  def hold(self, version: int) -> None:
    self._send(Message(Op.HOLD, {"version": int(version)}))

  def collect_garbage(self) -> None:
    self._send(Message(Op.COLLECT))

  def evaluate(self) -> dict[str, float] | None:
    return self._request(Op.EVALUATE)

  def save(self, step: int, extra: dict[str, Any]) -> None:
    self._request(Op.SAVE, {"step": int(step), "extra": extra})

  def restore(self) -> dict[str, Any] | None:
    return self._request(Op.RESTORE)

  def close(self, error: str | None = None) -> None:
    """Stops the learner (waiting for its last checkpoint to be written) and its process."""
    try:
      if self._proc.poll() is None:
        self._request(Op.STOP, {"error": error})
    except LearnerProcessError as e:
      log.error("the learner process did not stop cleanly: %s", e)
    finally:
      self._sock.close()
      try:
        self._proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self._proc.kill()
        self._proc.wait()

  # --- the stream -------------------------------------------------------------------------------

  def _send(self, message: Message) -> None:
    with self._send_lock:
      try:
        send_message(self._sock, message)
      except OSError as error:
        raise self._gone(f"sending {message.op.value} failed: {error}") from None

  def _request(self, op: Op, args: dict[str, Any] | None = None,
               arrays: dict[str, Any] | None = None) -> Any:
    with self._call_lock:
      self._send(Message(op, args or {}, arrays or {}))
      try:
        answer = receive_message(self._sock)
      except OSError as error:
        raise self._gone(f"reading the answer to {op.value} failed: {error}") from None
    if answer is None:
      raise self._gone(f"it closed its stream during {op.value}")
    if answer.op is Op.ERROR:
      a = answer.args
      raise LearnerProcessError(f"{op.value} failed in the learner process: {a['type']}: "
                                f"{a['message']}\n{a['traceback']}")
    self._policy_version = int(answer.args["policy_version"])
    return answer.args["value"]

  def _gone(self, detail: str) -> LearnerProcessError:
    try:
      code = self._proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      code = None
    how = ("still running" if code is None else
           f"killed by signal {-code}" if code < 0 else f"exit status {code}")
    return LearnerProcessError(f"the learner process ({how}) is gone: {detail}")


# --- the child ----------------------------------------------------------------------------------

def _die_with_parent() -> None:
  """SIGKILL this process when the thread that started it ends (a killed controller leaves no
  trainer behind holding memory and cores)."""
  pr_set_pdeathsig = 1
  ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
  if os.getppid() != int(os.environ[failpoints.RUN_PID_ENV]):  # it died before the prctl
    os._exit(1)


def _run_op(learner, message: Message) -> Any:
  op, args = message.op, message.args
  if op is Op.UPDATE:
    from flashrl_jax.trainer import Batch
    return learner.trainer.update_batch(Batch(**message.arrays))
  if op is Op.EXPORT:
    return learner.export()
  if op is Op.REEXPORT:
    return learner.reexport()
  if op is Op.HOLD:
    return learner.hold(int(args["version"]))
  if op is Op.COLLECT:
    return learner.collect_garbage()
  if op is Op.EVALUATE:
    return learner.evaluate()
  if op is Op.SAVE:
    return learner.save(int(args["step"]), args["extra"])
  if op is Op.RESTORE:
    return learner.restore()
  raise ValueError(f"not a learner-process operation: {op}")


def _answer(sock: socket.socket, op: Op, value: Any, policy_version: int) -> None:
  if op not in _ONE_WAY:
    send_message(sock, Message(Op.RESULT, {"value": value, "policy_version": policy_version}))


def _fail(sock: socket.socket, op: Op, error: BaseException) -> None:
  log.error("learner operation %s failed: %r", op.value, error)
  if op not in _ONE_WAY:
    send_message(sock, Message(Op.ERROR, {"type": type(error).__name__, "message": str(error),
                                          "traceback": traceback.format_exc()}))


def serve(sock: socket.socket) -> None:
  """The child's loop: build the learner (INIT), then answer operations until STOP."""
  init = receive_message(sock)
  if init is None or init.op is not Op.INIT:
    raise RuntimeError("the learner process expects INIT first")
  from flashrl_jax.controller._learner import Learner
  try:
    if init.args.get("compilation_cache_dir"):
      from flashrl_jax.rollout import enable_compilation_cache
      enable_compilation_cache(init.args["compilation_cache_dir"])
    learner = Learner.create(config_from_json(init.args["config"]), init.args["workdir"])
  except Exception as error:  # noqa: BLE001 - reported to the controller, which raises it
    _fail(sock, Op.INIT, error)
    return
  freeze_startup_objects()  # the model, optimizer and compiled steps: kept for the whole run
  _answer(sock, Op.INIT, None, learner.policy_version)
  while True:
    message = receive_message(sock)
    if message is None:  # the controller closed its end without STOP: it is gone
      return
    if message.op is Op.STOP:
      try:
        learner.close(message.args.get("error"))
      except Exception as error:  # noqa: BLE001
        _fail(sock, Op.STOP, error)
      else:
        _answer(sock, Op.STOP, None, learner.policy_version)
      return
    try:
      value = _run_op(learner, message)
    except Exception as error:  # noqa: BLE001 - the controller decides what a failure means
      _fail(sock, message.op, error)
    else:
      _answer(sock, message.op, value, learner.policy_version)


def main() -> None:
  _die_with_parent()
  logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                      format="%(levelname).1s learner %(asctime)s %(name)s] %(message)s")
  serve(socket.socket(fileno=int(sys.argv[1])))
