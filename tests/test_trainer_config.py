"""Mesh strings, rules tables, configs and the optimizer (single device, no model step)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from flashrl_jax.losses import LossConfig
from flashrl_jax.testing import tiny_config
from flashrl_jax.trainer import (ROLLOUT_RULES, TRAIN_RULES, BatchConfig, DistributedConfig,
                                 MeshConfig, OptimizerConfig, Schedule, TrainConfig, apply_update,
                                 create_train_state, decay_mask, learning_rate_schedule,
                                 logical_to_spec, make_mesh, make_optimizer)


def test_mesh_parse():
  assert MeshConfig.parse("data:1,fsdp:4,tensor:2") == MeshConfig(1, 4, 2)
  assert MeshConfig.parse(" tensor:2 , fsdp:4 ") == MeshConfig(1, 4, 2)
  assert MeshConfig.parse("") == MeshConfig()
  assert str(MeshConfig(2, 2, 2)) == "data:2,fsdp:2,tensor:2"
  assert MeshConfig.parse("fsdp:4,tensor:2").num_devices == 8


@pytest.mark.parametrize("spec, message", [
    ("fsdp4", "is not 'axis:size'"),
    ("model:2", "unknown axis 'model'"),
    ("fsdp:two", "must be an integer"),
    ("fsdp:0", "positive integer"),
    ("fsdp:2,fsdp:2", "given twice"),
])
def test_bad_mesh_strings(spec, message):
  with pytest.raises(ValueError, match=message):
    MeshConfig.parse(spec)


def test_mesh_size_must_match_devices():
  with pytest.raises(ValueError, match="needs 8 devices .* but 1 are available"):
    make_mesh("fsdp:4,tensor:2")
  mesh = make_mesh("fsdp:1")
  assert mesh.axis_names == ("data", "fsdp", "tensor") and mesh.devices.size == 1


def test_rules_tables():
  mesh = make_mesh("")
  fake = type("Mesh", (), {"shape": {"data": 2, "fsdp": 4, "tensor": 2}})()
  assert logical_to_spec(("embed", "heads", "head_dim"), TRAIN_RULES, fake) == P("fsdp", "tensor",
                                                                                 None)
  assert logical_to_spec(("embed", "heads", "head_dim"), ROLLOUT_RULES, fake) == P(None, "tensor",
                                                                                   None)
  assert logical_to_spec(("batch", "length"), TRAIN_RULES, fake) == P(("data", "fsdp"), None)
  # A mesh axis that does not divide the dimension is dropped (replicated) for that array.
  assert logical_to_spec(("embed", "kv_heads"), TRAIN_RULES, fake, (32, 1)) == P("fsdp", None)
  assert logical_to_spec(("batch",), TRAIN_RULES, fake, (6,)) == P("data")
  assert logical_to_spec(("unknown", None), TRAIN_RULES, mesh) == P(None, None)


def test_config_validation():
  with pytest.raises(ValueError, match="cosine schedule needs total_steps"):
    OptimizerConfig(schedule="cosine")
  with pytest.raises(ValueError, match="schedule='linear' is not one of"):
    OptimizerConfig(schedule="linear")
  with pytest.raises(ValueError, match="must be < row_length"):
    BatchConfig(row_length=16, max_response_length=16)
  with pytest.raises(ValueError, match="advantage='ppo' is not one of"):
    TrainConfig(advantage="ppo")
  with pytest.raises(ValueError, match="temperature must be > 0"):
    TrainConfig(temperature=0.0)
  assert TrainConfig(loss=LossConfig(kl_coef=0.1)).uses_reference
  assert TrainConfig(ppo_epochs=2, num_minibatches=3).updates_per_step == 6
  with pytest.raises(ValueError, match="coordinator"):
    DistributedConfig(num_processes=2)
  env = {"FLASHRL_COORDINATOR": "10.0.0.1:1234", "FLASHRL_NUM_PROCESSES": "4",
         "FLASHRL_PROCESS_ID": "3"}
  assert DistributedConfig.from_env(env) == DistributedConfig("10.0.0.1:1234", 4, 3)


def test_schedule():
  lr = learning_rate_schedule(OptimizerConfig(learning_rate=1.0, warmup_steps=4,
                                              schedule=Schedule.COSINE, total_steps=14,
                                              min_lr_ratio=0.1))
  np.testing.assert_allclose([lr(0), lr(2), lr(4), lr(9), lr(14)], [0, 0.5, 1.0, 0.55, 0.1],
                             atol=1e-6)
  constant = learning_rate_schedule(OptimizerConfig(learning_rate=0.3))
  assert float(constant(0)) == float(constant(1000)) == pytest.approx(0.3)


def test_weight_decay_mask_skips_norms_and_biases():
  config = tiny_config("qwen2")  # has [heads, head_dim] q/k/v biases: 2-D but not decayed
  _, state = create_train_state(config, TrainConfig(), make_mesh(""))
  flat = dict(nnx.to_flat_state(decay_mask(state.params)))
  decayed = {"/".join(map(str, k)) for k, v in flat.items() if v.get_value()}
  assert "embed" in decayed and "lm_head" in decayed and "layers/0/mlp/up_proj" in decayed
  assert "layers/0/attn/q_proj" in decayed and "layers/0/attn/o_proj" in decayed
  assert not any(k.endswith(("scale", "_bias")) for k in decayed)
  assert any(k.endswith("q_bias") for k in map(lambda k: "/".join(map(str, k)), flat))


def test_non_finite_gradients_skip_the_update():
  optimizer = make_optimizer(OptimizerConfig(learning_rate=0.1))
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  opt_state = optimizer.init(params)
  grads = {"w": jnp.ones((3, 2)), "b": jnp.array([jnp.nan, 1.0])}
  new_params, new_state, norm, skipped = apply_update(optimizer, params, opt_state, grads)
  assert int(skipped) == 1 and not np.isfinite(float(norm))
  jax.tree.map(np.testing.assert_array_equal, new_params, params)
  jax.tree.map(np.testing.assert_array_equal, new_state, opt_state)
  grads["b"] = jnp.array([1.0, 1.0])
  new_params, new_state, _, skipped = apply_update(optimizer, params, opt_state, grads)
  assert int(skipped) == 0 and not np.allclose(new_params["w"], params["w"])
  counts = [int(c) for _, c in optax.tree_utils.tree_get_all_with_path(new_state, "count")]
  assert counts and all(c == 1 for c in counts)
