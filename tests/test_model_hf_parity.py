"""HF round trip: random tiny transformers model -> save -> load_hf -> logits match -> save_hf ->
transformers reloads -> logits match again. Every family, several KV-head counts, tied/untied."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from flashrl_jax import model as M
from tests.hf_helpers import FAMILIES, hf_logits, make_hf_model, rel_err

CASES = [(f, kv, tie) for f in FAMILIES for kv in (1, 2, 4) for tie in (False,)] + [
    ("qwen3", 2, True), ("llama", 4, True)]


@pytest.mark.parametrize("family,num_kv_heads,tie", CASES)
def test_round_trip_matches_transformers(tmp_path, family, num_kv_heads, tie):
  hf_model = make_hf_model(family, num_kv_heads=num_kv_heads, tie=tie)
  hf_model.save_pretrained(tmp_path / "hf")
  ids = np.random.default_rng(0).integers(0, 96, size=(2, 11))
  expected = hf_logits(hf_model, ids)

  ours = M.load_hf(str(tmp_path / "hf"))
  assert ours.config.family is M.Family(family)
  assert ours.config.num_kv_heads == num_kv_heads
  got = np.asarray(ours(jnp.asarray(ids, jnp.int32)))
  assert got.shape == (2, 11, 96)
  assert rel_err(got, expected) < 1e-4

  M.save_hf(ours, str(tmp_path / "back"))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
  assert rel_err(hf_logits(reloaded, ids), expected) < 1e-4
  # And our own loader reads what our saver wrote.
  again = M.load_hf(str(tmp_path / "back"))
  np.testing.assert_array_equal(np.asarray(again(jnp.asarray(ids, jnp.int32))), got)


def test_bf16_round_trip(tmp_path):
  hf_model = make_hf_model("qwen3")
  hf_model.save_pretrained(tmp_path / "hf")
  ids = np.random.default_rng(1).integers(0, 96, size=(1, 9))
  ours = M.load_hf(str(tmp_path / "hf"), dtype=jnp.bfloat16)
  assert ours.embed[...].dtype == jnp.bfloat16
  got = np.asarray(ours(jnp.asarray(ids, jnp.int32)))
  assert rel_err(got, hf_logits(hf_model, ids)) < 5e-2
  M.save_hf(ours, str(tmp_path / "bf16"))
  with open(tmp_path / "bf16" / "config.json") as f:
    assert json.load(f)["dtype"] == "bfloat16"
  from safetensors import safe_open
  with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as f:
    assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"))
  assert rel_err(hf_logits(reloaded.float(), ids), got) < 5e-2


def test_sharded_checkpoint_index(tmp_path):
  hf_model = make_hf_model("qwen2")
  hf_model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
  assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
  ids = np.arange(8)[None]
  ours = M.load_hf(str(tmp_path / "hf"))
  assert rel_err(np.asarray(ours(jnp.asarray(ids))), hf_logits(hf_model, ids)) < 1e-4
  files = M.save_hf(ours, str(tmp_path / "ours"), max_shard_bytes=20_000)
  assert "model.safetensors.index.json" in files
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours")).eval()
  assert rel_err(hf_logits(reloaded, ids), hf_logits(hf_model, ids)) < 1e-4
