"""Dataset loading (JSONL / Parquet, bad rows reported by number) and synthetic long-tail tasks."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flashrl_jax import envs
from flashrl_jax.envs import LengthDistribution, LengthLaw, SyntheticConfig, SyntheticTask


def _write_jsonl(path, lines):
  path.write_text("\n".join(lines) + "\n")
  return path


def test_jsonl_good_rows(tmp_path):
  path = _write_jsonl(tmp_path / "d.jsonl", [
      json.dumps({"prompt": "1+1", "answer": 2, "id": "a"}),
      "",
      json.dumps({"prompt": "code", "tests": ["assert f() == 1", "assert f() != 2"],
                  "reference_time": 0.5}),
  ])
  data = envs.load_dataset(path)
  assert data.errors == ()
  assert data.samples[0] == envs.Sample("1+1", "2", id="a")
  code = data.samples[1]
  assert (code.answer, code.tests, code.reference_time, code.id) == (
      "", "assert f() == 1\nassert f() != 2", 0.5, "row3")


def test_jsonl_bad_rows_reported_with_line_numbers(tmp_path):
  path = _write_jsonl(tmp_path / "d.jsonl", [
      json.dumps({"prompt": "ok", "answer": "1"}),
      '{"prompt": "broken", ',
      json.dumps({"answer": "no prompt"}),
      json.dumps({"prompt": "no answer"}),
      json.dumps({"prompt": "bad time", "answer": "1", "reference_time": -1}),
      json.dumps([1, 2]),
      json.dumps({"prompt": "also ok", "answer": "2"}),
  ])
  data = envs.load_dataset(path)
  assert [s.prompt for s in data.samples] == ["ok", "also ok"]
  assert [e.row for e in data.errors] == [2, 3, 4, 5, 6]
  messages = [str(e) for e in data.errors]
  assert "malformed JSON" in messages[0] and messages[0].startswith("row 2:")
  assert "'prompt'" in messages[1] and "'answer'" in messages[2]
  assert "reference_time" in messages[3] and "object" in messages[4]
  with pytest.raises(envs.DatasetError, match="row 2"):
    envs.load_dataset(path, strict=True)


def test_parquet_good_and_bad_rows(tmp_path):
  table = pa.table({"prompt": ["a", None, "c"], "answer": ["1", "2", None],
                    "reference_time": [0.1, None, 2.0]})
  path = tmp_path / "d.parquet"
  pq.write_table(table, path)
  data = envs.load_dataset(path)
  assert [s.prompt for s in data.samples] == ["a"]
  assert data.samples[0].reference_time == pytest.approx(0.1)
  assert [(e.row, "prompt" in e.message, "answer" in e.message) for e in data.errors] == [
      (2, True, False), (3, False, True)]


def test_unknown_suffix_needs_explicit_format(tmp_path):
  path = _write_jsonl(tmp_path / "d.txt", [json.dumps({"prompt": "p", "answer": "a"})])
  with pytest.raises(ValueError, match="format"):
    envs.load_dataset(path)
  assert len(envs.load_dataset(path, fmt=envs.DatasetFormat.JSONL)) == 1


def test_save_and_reload_roundtrip(tmp_path):
  samples = envs.generate_synthetic(SyntheticConfig(), num=20, seed=3)
  envs.save_jsonl(samples, tmp_path / "s.jsonl")
  assert envs.load_dataset(tmp_path / "s.jsonl").samples == tuple(samples)


@pytest.mark.parametrize("task", list(SyntheticTask))
def test_synthetic_deterministic_and_correct(task):
  cfg = SyntheticConfig(task=task, lengths=LengthDistribution(median=6, max_len=40))
  a = envs.generate_synthetic(cfg, num=50, seed=7)
  assert a == envs.generate_synthetic(cfg, num=50, seed=7)
  assert a != envs.generate_synthetic(cfg, num=50, seed=8)
  for s in a:
    assert set(s.prompt + s.answer) <= set("0123456789+= abcdefghijklmnopqrstuvwxyz")
    if task is SyntheticTask.RUNNING_SUM:  # answers are the true partial sums
      terms = [int(t) for t in s.prompt.split()[1].split("+")]
      assert s.answer == " ".join(str(v) for v in np.cumsum(terms))
      assert envs.answer_length(s) == len(terms)
    elif task is SyntheticTask.REPEAT:
      _, digit, _, n, _ = s.prompt.split()
      assert s.answer == digit * int(n) and envs.answer_length(s) == int(n)
    else:
      _, lo, _, hi, _ = s.prompt.split()
      assert s.answer.split() == [str(v) for v in range(int(lo), int(hi) + 1)]


@pytest.mark.parametrize("dist, ratio", [
    (LengthDistribution(LengthLaw.LOGNORMAL, median=20, sigma=0.5, max_len=10_000),
     np.exp(2.326 * 0.5)),
    (LengthDistribution(LengthLaw.LOGNORMAL, median=20, sigma=1.0, max_len=10_000),
     np.exp(2.326 * 1.0)),
    (LengthDistribution(LengthLaw.PARETO, median=20, alpha=1.5, max_len=100_000), 50 ** (1 / 1.5)),
])
def test_length_tail_matches_configuration(dist, ratio):
  lengths = dist.sample(np.random.default_rng(0), 20_000)
  q50, q99 = np.quantile(lengths, [0.5, 0.99])
  assert q50 == pytest.approx(dist.median, rel=0.1)
  assert q99 / q50 == pytest.approx(ratio, rel=0.15)


def test_length_clipping_and_constant():
  lengths = LengthDistribution(LengthLaw.PARETO, median=5, alpha=0.8, min_len=2, max_len=30).sample(
      np.random.default_rng(1), 5000)
  assert lengths.min() >= 2 and lengths.max() == 30
  const = LengthDistribution(LengthLaw.CONSTANT, median=9).sample(np.random.default_rng(1), 10)
  assert (const == 9).all()
  with pytest.raises(ValueError):
    LengthDistribution(min_len=5, max_len=4)
