"""The processes of one multi-process run: process 0 sends each piece of work to the others, and
every process learns at once when another one is gone.

Why a TCP stream from process 0 to each other process, beside `jax.distributed`:

- Work messages (train on this batch, export, checkpoint, stop) go over it, so a process waiting
  for work waits in a socket read, which has no timeout, and not inside a collective: the
  controller may spend minutes between steps (rollouts, rewards), longer than a collective should
  hang. The JAX collectives (the step, the gathers of an export, orbax) start only once every
  process has the message.
- Each step's batch rides in the message: process 0 packs it (only it has the rollouts) and sends
  the packed host arrays, and every process then places its own shards (`host_to_global`). A batch
  is small next to the model, and sending it needs no shared filesystem, no XLA program per payload
  size (as `multihost_utils.broadcast_one_to_all` would) and no device memory.
- A process that exits closes its end: the others see it at once, even while blocked in a
  collective (a reader thread watches each stream), print which process was lost and exit with
  `EXIT_LOST`, so nothing waits on a collective that can never complete. Process 0 also tells the
  remaining processes which one it lost, and runs its cleanups (stopping its rollout servers).

Messages are a JSON header plus raw arrays (no pickle crosses a process).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import queue
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)

EXIT_LOST = 3  # the exit status of a process that stopped because another one was lost


class Op(enum.Enum):
  INIT = "init"          # build the trainer (every process, together)
  RESTORE = "restore"    # restore the latest checkpoint
  UPDATE = "update"      # one RL step on the packed batch in `arrays`
  EXPORT = "export"      # export the current policy version
  SAVE = "save"          # checkpoint (args: step, extra)
  EVALUATE = "evaluate"  # the held-out evaluation
  STOP = "stop"          # the run is over (args: error, None when it finished)
  LOST = "lost"          # process `args["process"]` is gone (sent by process 0)
  # A learner in its own process (`controller.LearnerProcess`) also takes these, and answers each
  # request with RESULT or ERROR.
  REEXPORT = "reexport"  # export the current version again (the servers refused it)
  HOLD = "hold"          # keep version `args["version"]`'s export (one-way)
  COLLECT = "collect"    # delete exports nothing needs (one-way)
  RESULT = "result"      # the answer: args["value"], args["policy_version"]
  ERROR = "error"        # the request failed: args["type"], args["message"], args["traceback"]


@dataclasses.dataclass(frozen=True)
class Message:
  op: Op
  args: dict[str, Any] = dataclasses.field(default_factory=dict)
  arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

  def encode(self) -> bytes:
    arrays = {k: np.ascontiguousarray(v) for k, v in self.arrays.items()}
    header = json.dumps({"op": self.op.value, "args": self.args,
                         "arrays": [[k, v.dtype.str, list(v.shape)] for k, v in arrays.items()]})
    head = header.encode()
    return b"".join([struct.pack(">I", len(head)), head, *(v.tobytes() for v in arrays.values())])

  @classmethod
  def decode(cls, payload: bytes) -> Message:
    (n,) = struct.unpack(">I", payload[:4])
    header = json.loads(payload[4:4 + n])
    offset, arrays = 4 + n, {}
    for name, dtype, shape in header["arrays"]:
      dtype = np.dtype(dtype)
      size = int(np.prod(shape)) * dtype.itemsize
      arrays[name] = np.frombuffer(payload[offset:offset + size], dtype).reshape(shape).copy()
      offset += size
    return cls(Op(header["op"]), header["args"], arrays)


def send_message(sock: socket.socket, message: Message) -> None:
  """Writes one framed message to a stream socket."""
  _send_frame(sock, message.encode())


def receive_message(sock: socket.socket) -> Message | None:
  """Reads one framed message; None when the other end closed the stream."""
  payload = _recv_frame(sock)
  return None if payload is None else Message.decode(payload)


def _send_frame(sock: socket.socket, payload: bytes) -> None:
  sock.sendall(struct.pack(">Q", len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
  chunks, got = [], 0
  while got < n:
    chunk = sock.recv(min(n - got, 1 << 20))
    if not chunk:
      return None
    chunks.append(chunk)
    got += len(chunk)
  return b"".join(chunks)


def _recv_frame(sock: socket.socket) -> bytes | None:
  head = _recv_exact(sock, 8)
  if head is None:
    return None
  return _recv_exact(sock, struct.unpack(">Q", head)[0])


def _broadcast_address(host: str, port: int) -> tuple[str, int]:
  """Process 0's (host, port), known to every process (one collective, at start-up)."""
  data = np.zeros(258, np.uint8)
  if jax.process_index() == 0:
    raw = host.encode()[:256]
    data[:len(raw)] = np.frombuffer(raw, np.uint8)
    data[256:] = np.frombuffer(struct.pack(">H", port), np.uint8)
  data = np.asarray(multihost_utils.broadcast_one_to_all(data)).astype(np.uint8)
  return bytes(data[:256]).rstrip(b"\0").decode(), struct.unpack(">H", bytes(data[256:]))[0]


class ProcessGroup:
  """Process 0's streams to the others (or a follower's stream from process 0). Create with
  `ProcessGroup.connect` right after `jax.distributed` is initialised, on every process."""

  def __init__(self, process_id: int, num_processes: int, streams: dict[int, socket.socket]):
    self.process_id, self.num_processes = process_id, num_processes
    self._streams = streams  # process 0: follower id -> stream; a follower: {0: stream}
    self._closing = False
    self._send_lock = threading.Lock()
    self._cleanups: list[Callable[[], None]] = []
    self._inbox: queue.Queue[Message] = queue.Queue()
    for peer, sock in streams.items():
      threading.Thread(target=self._watch, args=(peer, sock), daemon=True,
                       name=f"flashrl-watch-{peer}").start()

  @property
  def is_leader(self) -> bool:
    return self.process_id == 0

  @classmethod
  def connect(cls, host: str, *, timeout_s: float = 300.0) -> ProcessGroup:
    """Process 0 listens on `host` (its address as the others reach it), the others connect."""
    pid, n = jax.process_index(), jax.process_count()
    server = None
    port = 0
    if pid == 0:
      server = socket.create_server((host, 0))
      server.settimeout(timeout_s)
      port = server.getsockname()[1]
    host, port = _broadcast_address(host, port)
    if pid == 0:
      streams = {}
      try:
        while len(streams) < n - 1:
          sock, _ = server.accept()
          sock.settimeout(None)
          hello = _recv_exact(sock, 4)
          if hello is None:
            raise ConnectionError("a process closed its stream before saying who it is")
          streams[struct.unpack(">I", hello)[0]] = sock
      except socket.timeout:
        missing = sorted(set(range(1, n)) - set(streams))
        raise TimeoutError(f"processes {missing} did not connect to process 0 at {host}:{port} "
                           f"within {timeout_s:.0f}s") from None
      finally:
        server.close()
      return cls(pid, n, streams)
    deadline = time.monotonic() + timeout_s
    while True:
      try:
        sock = socket.create_connection((host, port), timeout=10)
        break
      except OSError as error:
        if time.monotonic() > deadline:
          raise TimeoutError(f"process {pid} could not reach process 0 at {host}:{port}: "
                             f"{error}") from None
        time.sleep(0.2)
    sock.settimeout(None)
    sock.sendall(struct.pack(">I", pid))
    return cls(pid, n, {0: sock})

  def add_cleanup(self, fn: Callable[[], None]) -> None:
    """Runs `fn` if this process is stopped because another one was lost (e.g. stop servers)."""
    self._cleanups.append(fn)

  def send(self, message: Message) -> None:
    """Process 0: sends `message` to every other process."""
    if message.op is Op.STOP:
      self._closing = True  # the others exit next: their streams closing is no loss
    payload = message.encode()
    with self._send_lock:
      for peer, sock in self._streams.items():
        try:
          _send_frame(sock, payload)
        except OSError as error:
          self._lost(peer, f"its stream failed: {error}")

  def receive(self) -> Message:
    """A follower: the next message from process 0 (waits as long as it takes)."""
    return self._inbox.get()

  def close(self) -> None:
    self._closing = True
    for sock in self._streams.values():
      try:
        sock.close()
      except OSError:
        pass

  def _watch(self, peer: int, sock: socket.socket) -> None:
    while True:
      try:
        payload = _recv_frame(sock)
      except OSError as error:
        payload, reason = None, str(error)
      else:
        reason = "its stream closed"
      if payload is None:
        if not self._closing:
          self._lost(peer, f"{reason}: it exited or its host is gone")
        return
      message = Message.decode(payload)
      if message.op is Op.STOP:
        self._closing = True
      if message.op is Op.LOST:
        self._lost(int(message.args["process"]), "reported by process 0")
      self._inbox.put(message)

  def _lost(self, peer: int, detail: str) -> None:
    if self._closing:
      return
    self._closing = True
    text = (f"flashrl: process {peer} of {self.num_processes} was lost ({detail}); process "
            f"{self.process_id} stops too.")
    print(text, file=sys.stderr, flush=True)
    log.error(text)
    if self.is_leader and self._send_lock.acquire(timeout=2.0):
      payload = Message(Op.LOST, {"process": peer}).encode()
      for other, sock in self._streams.items():
        if other != peer:
          try:
            _send_frame(sock, payload)
          except OSError:
            pass
    for fn in self._cleanups:
      try:
        fn()
      except Exception as error:  # noqa: BLE001 - exiting anyway; the others must still run
        print(f"flashrl: cleanup failed: {error!r}", file=sys.stderr, flush=True)
    os._exit(EXIT_LOST)  # another thread may be inside a collective that can never complete
