"""The one override mechanism (dotted field paths on the typed, frozen config): typos fail naming the
field that exists, command-line strings become the field's type, a dict is a whole new section,
the config's own validation still runs, and every short flag names a real field."""

import os
import sys

import pytest

from flashrl_jax import envs
from flashrl_jax.controller import (AgenticConfig, Mode, OverrideError, RunConfig, TaskConfig,
                                    field_type, override, parse_assignment)
from flashrl_jax.fleet import PauseMode
from flashrl_jax.losses import LossName

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments._cli import FLAGS  # noqa: E402


def base() -> RunConfig:
  return RunConfig(model_path="m", workdir="w", task=TaskConfig(synthetic=envs.SyntheticConfig()),
                   async_ratio=2)


@pytest.mark.parametrize("path,message", [
    ("rollout.num_server", "did you mean 'num_servers'"),
    ("trian.loss.name", "did you mean 'train'"),
    ("train.loss.clip_lo", "did you mean 'clip_low'"),
    ("steps.count", "steps is a value"),
])
def test_a_misspelt_path_fails_naming_the_fields(path, message):
  with pytest.raises(OverrideError, match=message):
    override(base(), {path: "1"})


def test_command_line_strings_become_typed_values():
  config = override(base(), {
      "steps": "7", "train.optimizer.learning_rate": "3e-4", "dynamic_filter": "true",
      "rollout.pause_mode": "in_place", "train.loss.name": "ppo", "train.loss.dual_clip": "3",
      "rollout.backend": "sglang", "rollout.sglang_urls": "http://a:1, http://b:2",
      "train.optimizer.total_steps": "none"})
  assert config.steps == 7 and config.train.optimizer.learning_rate == 3e-4
  assert config.dynamic_filter is True and config.rollout.pause_mode is PauseMode.IN_PLACE
  assert config.train.loss.name is LossName.PPO and config.train.loss.dual_clip == 3.0
  assert config.rollout.sglang_urls == ("http://a:1", "http://b:2")
  assert config.train.optimizer.total_steps is None
  assert base().steps == 20  # the original is untouched


@pytest.mark.parametrize("overrides,message", [
    ({"steps": "seven"}, "steps is an integer"),
    ({"steps": 2.5}, "steps is an integer"),
    ({"dynamic_filter": "maybe"}, "true or false"),
    ({"mode": "sink"}, "'sync', 'async'"),
    ({"rollout": "fast"}, "config section"),
    ({"steps": None}, "cannot be None"),
    ({"train.loss": {"nme": "ppo"}}, "did you mean 'name'"),
])
def test_bad_values_fail_naming_the_field(overrides, message):
  with pytest.raises(OverrideError, match=message):
    override(base(), overrides)


def test_a_dict_is_a_whole_new_section_and_paths_into_it_apply_after_it():
  tuned = override(base(), {"train.loss.clip_low": 0.5})
  # Given in either order, the section is built first (its own defaults), then the path applies.
  for overrides in ({"train.loss.clip_high": 0.4, "train.loss": {"name": "ppo"}},
                    {"train.loss": {"name": "ppo"}, "train.loss.clip_high": 0.4}):
    config = override(tuned, overrides)
    assert config.train.loss.name is LossName.PPO
    assert config.train.loss.clip_low == 0.2  # LossConfig's default, not the 0.5 set before
    assert config.train.loss.clip_high == 0.4


def test_paths_below_an_unset_section_fail():
  with pytest.raises(OverrideError, match="task.env is None"):
    override(base(), {"task.env.failure.slow_prob": 0.1})
  agentic = override(base(), {"task.synthetic": None, "task.env": {"kind": "frozen_lake"}})
  assert agentic.task.env.kind is envs.EnvKind.FROZEN_LAKE
  assert override(agentic, {"task.env.failure.slow_prob": "0.1"}).task.env.failure.slow_prob == 0.1


def test_the_configs_own_validation_runs():
  with pytest.raises(ValueError, match="contradicts"):
    override(base(), {"mode": "sync", "async_ratio": 2})
  with pytest.raises(ValueError, match="needs --sglang_urls"):
    override(base(), {"rollout.backend": "sglang"})
  with pytest.raises(ValueError, match="num_env_groups=1 < batch_size=8"):
    override(base(), {"agentic": AgenticConfig(num_env_groups=1)})


def test_sync_mode_without_a_ratio_is_on_policy():
  config = override(base(), {"mode": "sync"})
  assert config.mode is Mode.SYNC and config.async_ratio == 0
  assert override(base(), {"mode": "async"}).async_ratio == 2


def test_every_short_flag_names_a_field():
  for flag, (path, _) in FLAGS.items():
    field_type(path)  # raises on a path that no longer exists
  assert len({path for path, _ in FLAGS.values()}) == len(FLAGS)


def test_assignments():
  assert parse_assignment("rollout.top_p=0.9") == ("rollout.top_p", "0.9")
  assert parse_assignment("train.loss={\"name\": \"a=b\"}") == ("train.loss", "{\"name\": \"a=b\"}")
  with pytest.raises(OverrideError):
    parse_assignment("rollout.top_p")
