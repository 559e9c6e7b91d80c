"""Failpoint plans parse into typed entries, refuse malformed ones, and fire once each."""

import os

import pytest

from flashrl_jax import _failpoints as failpoints
from flashrl_jax._failpoints import Action, Failpoint, Point


def test_plans_parse_and_bad_entries_are_refused_naming_them():
  assert failpoints.parse("train@2=kill, handoff@5=kill_server:0,published@3=corrupt") == (
      Failpoint(Point.TRAIN, 2, Action.KILL), Failpoint(Point.HANDOFF, 5, Action.KILL_SERVER, 0),
      Failpoint(Point.PUBLISHED, 3, Action.CORRUPT))
  assert failpoints.parse("") == ()
  for bad in ("train=kill", "train@x=kill", "nowhere@1=kill", "train@1=explode",
              "train@1=kill_server", "train@1=kill:2"):
    with pytest.raises(ValueError, match="failpoint"):
      failpoints.parse(bad)


def test_a_failpoint_fires_once_at_its_point_and_version(tmp_path, monkeypatch):
  path = tmp_path / "weight_v000003"
  path.mkdir()
  (path / "model.safetensors").write_bytes(b"x" * 100)
  monkeypatch.setattr(failpoints, "_plan", failpoints.parse("published@3=corrupt"))
  monkeypatch.setattr(failpoints, "_fired", set())
  failpoints.hit("published", 2, path=str(path))
  failpoints.hit("export", 3, path=str(path))
  assert os.path.getsize(path / "model.safetensors") == 100
  failpoints.hit("published", 3, path=str(path))
  assert os.path.getsize(path / "model.safetensors") == 50
  failpoints.hit("published", 3, path=str(path))
  assert os.path.getsize(path / "model.safetensors") == 50
