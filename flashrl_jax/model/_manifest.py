"""The checksum manifest of an exported weight directory, and its verification.

Why in `model`: the trainer writes it (`trainer.export_version`) and the rollout server checks it
before a weight update replaces the weights it serves, so both sides read one definition. A
manifest (`manifest.json`) lists every other file of the directory with its size and sha256; a
directory that does not match it (a truncated, garbled, missing or extra file) is refused whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat

MANIFEST = "manifest.json"
MAX_JSON_BYTES = 16 << 20  # config, index and manifest files are small; anything larger is refused
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class CorruptVersionError(ValueError):
  """An exported version's files do not match its manifest."""


def sha256_file(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def regular_file(path: str, what: str) -> str:
  """`path` if it is a regular file (following links); ValueError otherwise.

  A FIFO or a device in a weight directory would block or never end a read on the engine thread.
  """
  try:
    mode = os.stat(path).st_mode
  except OSError as e:
    raise FileNotFoundError(f"{what} {path} is missing: {e.strerror}.") from None
  if not stat.S_ISREG(mode):
    raise ValueError(f"{what} {path} is not a regular file.")
  return path


def read_small_json(path: str, what: str):
  """A small JSON file (config, index, manifest); ValueError naming it if it cannot be read."""
  regular_file(path, what)
  if os.path.getsize(path) > MAX_JSON_BYTES:
    raise ValueError(f"{what} {path} is larger than {MAX_JSON_BYTES} bytes.")
  try:
    with open(path, "rb") as f:
      return json.loads(f.read())
  except (ValueError, RecursionError) as e:
    raise ValueError(f"{what} {path} is not valid JSON: {e}") from None


def plain_name(name: object, where: str) -> str:
  """A file name that stays inside its directory (no separators, no `..`)."""
  if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
      or "\\" in name or "\0" in name):
    raise ValueError(f"{where} names {name!r:.100}, which is not a plain file name in the "
                     "directory.")
  return name


def verify_version(path: str) -> dict:
  """Checks every file of an exported version against its manifest; returns the manifest.

  Raises:
    CorruptVersionError: naming the missing, extra, resized or modified file, or the malformed
      manifest.
  """
  manifest_path = os.path.join(path, MANIFEST)
  try:
    manifest = read_small_json(manifest_path, "manifest")
  except (OSError, ValueError) as e:
    raise CorruptVersionError(f"{path} has no readable {MANIFEST}: {e}") from e
  files = manifest.get("files") if isinstance(manifest, dict) else None
  if not isinstance(files, dict) or not all(
      isinstance(e, dict) and isinstance(e.get("sha256"), str) and _HEX64.match(e["sha256"])
      and isinstance(e.get("bytes"), int) and not isinstance(e["bytes"], bool)
      for e in files.values()):
    raise CorruptVersionError(f"{manifest_path} is malformed: `files` must map names to "
                              "{sha256, bytes}.")
  try:
    for name in files:
      plain_name(name, manifest_path)
    present = set(os.listdir(path)) - {MANIFEST}
  except (OSError, ValueError) as e:
    raise CorruptVersionError(str(e)) from None
  if present != set(files):
    raise CorruptVersionError(f"{path}: files {sorted(present)} differ from the manifest's "
                              f"{sorted(files)}.")
  for name, entry in files.items():
    file = os.path.join(path, name)
    try:
      regular_file(file, "weight file")
    except (OSError, ValueError) as e:
      raise CorruptVersionError(str(e)) from None
    if os.path.getsize(file) != entry["bytes"]:
      raise CorruptVersionError(f"{file} has {os.path.getsize(file)} bytes, the manifest says "
                                f"{entry['bytes']}.")
    if sha256_file(file) != entry["sha256"]:
      raise CorruptVersionError(f"{file} does not match its sha256 in {manifest_path}.")
  return manifest
