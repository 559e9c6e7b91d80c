"""Dataset files (JSONL / Parquet in the generic, GSM8K, MATH and DAPO layouts; bad rows reported by
file, row and field; a file-backed task scored by math-verify) and synthetic long-tail tasks."""

import asyncio
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flashrl_jax import envs
from flashrl_jax.envs import (DatasetFileConfig, DatasetLayout, LengthDistribution, LengthLaw,
                              SyntheticConfig, SyntheticTask)

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "gsm8k_tiny.jsonl")


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
  assert [(e.row, e.field) for e in data.errors] == [(2, "prompt"), (3, "answer")]


def test_unknown_suffix_needs_explicit_format(tmp_path):
  path = _write_jsonl(tmp_path / "d.txt", [json.dumps({"prompt": "p", "answer": "a"})])
  with pytest.raises(ValueError, match="format"):
    envs.load_dataset(path)
  assert len(envs.load_dataset(path, fmt=envs.DatasetFormat.JSONL)) == 1


def test_save_and_reload_roundtrip(tmp_path):
  samples = envs.generate_synthetic(SyntheticConfig(), num=20, seed=3)
  samples[0] = envs.Sample("q", "1", task="t", metadata={"level": 3, "tags": ["a"]}, id="x")
  envs.save_jsonl(samples, tmp_path / "s.jsonl")
  assert envs.load_dataset(tmp_path / "s.jsonl").samples == tuple(samples)


def test_gsm8k_fixture_through_the_run_task_and_math_verify():
  """The committed GSM8K-layout fixture: final answers parsed from '####', cycled in order by the
  run's prompt stream, and scored by math-verify (right answers in other spellings too)."""
  from flashrl_jax.controller import PromptSource, RunConfig, TaskConfig, task_source
  config = RunConfig(model_path="m", workdir="w", task=TaskConfig(
      dataset=DatasetFileConfig(FIXTURE, layout="gsm8k", strict=True)))
  assert config.task.reward is envs.RewardKind.MATH
  source = PromptSource(task_source(config))
  samples = [source.next()[1] for _ in range(6)]
  assert [s.answer for s in samples] == ["27", "150", "5000", "4.5", "-7", "27"]
  assert samples[0].prompt.startswith("Mia has 3 boxes")
  assert samples[0].task == "gsm8k_tiny" and samples[0].id == "row1"
  reward = envs.make_reward_fn(config.task.reward_config())

  async def score(response, sample):
    return (await reward(sample.prompt, response, sample)).reward

  async def all_scores():
    return [await score(r, samples[i]) for i, r in [
        (0, "3*12-9 = 27, so the answer is 27."), (1, r"\boxed{150}"), (2, r"\boxed{5,000}"),
        (3, r"\boxed{\frac{9}{2}}"), (4, "The answer is -7."), (0, r"\boxed{28}"),
        (4, "The answer is 7.")]]

  assert asyncio.run(all_scores()) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def _write_parquet(path, rows):
  pq.write_table(pa.Table.from_pylist(rows), path)
  return path


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_public_layouts(tmp_path, suffix):
  def write(name, rows):
    path = tmp_path / f"{name}.{suffix}"
    if suffix == "jsonl":
      return _write_jsonl(path, [json.dumps(r) for r in rows])
    return _write_parquet(path, rows)

  math = write("math", [
      {"problem": "Find x if 2x = 3.", "solution": r"So $x = \boxed{\frac{3}{2}}$.", "answer": None,
       "level": "L1"},
      {"problem": "1+1?", "solution": "It is 2.", "answer": "2", "level": "L1"}])
  data = envs.load_dataset(DatasetFileConfig(str(math), layout=DatasetLayout.MATH, strict=True))
  assert [(s.prompt, s.answer) for s in data.samples] == [
      ("Find x if 2x = 3.", r"\frac{3}{2}"), ("1+1?", "2")]
  assert data.samples[0].metadata == {"level": "L1"}  # fields no layout reads
  dapo = write("dapo", [{
      "data_source": "math_dapo", "ability": "MATH",
      "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3?"}],
      "reward_model": {"ground_truth": "5", "style": "rule"}, "extra_info": {"index": "a1"}}])
  (sample,) = envs.load_dataset(DatasetFileConfig(str(dapo), layout="dapo", strict=True)).samples
  assert (sample.prompt, sample.answer, sample.id) == ("2+3?", "5", "a1")
  assert sample.metadata["data_source"] == "math_dapo"
  custom = write("custom", [{"input": {"text": "3*3"}, "target": 9, "split": "train"}])
  (sample,) = envs.load_dataset(DatasetFileConfig(
      str(custom), layout="gsm8k", question_field="input.text", answer_field="target",
      name="mine")).samples
  assert (sample.prompt, sample.answer, sample.task, sample.metadata) == (
      "3*3", "9", "mine", {"split": "train"})


def test_malformed_rows_name_file_row_and_field(tmp_path):
  path = _write_jsonl(tmp_path / "gsm.jsonl", [
      json.dumps({"question": "ok", "answer": "x\n#### 4"}),
      json.dumps({"question": "no marker", "answer": "it is 4"}),
      json.dumps({"question": ["not", "text"], "answer": "#### 4"}),
      json.dumps({"answer": "#### 4"}),
      json.dumps({"question": "empty", "answer": "####  "}),
  ])
  config = DatasetFileConfig(str(path), layout="gsm8k")
  data = envs.load_dataset(config)
  assert len(data.samples) == 1
  assert [(e.row, e.field) for e in data.errors] == [
      (2, "answer"), (3, "question"), (4, "question"), (5, "answer")]
  assert "'#### <final answer>'" in data.errors[0].message
  with pytest.raises(envs.DatasetError) as error:
    envs.load_dataset(DatasetFileConfig(str(path), layout="gsm8k", strict=True))
  text = str(error.value)
  assert text.startswith(f"{path}: 4 bad row(s): row 2: field 'answer': ")
  assert "row 3: field 'question': must be a string or a number, got list" in text
  dapo = _write_jsonl(tmp_path / "dapo.jsonl", [
      json.dumps({"prompt": [{"role": "assistant", "content": "hi"}],
                  "reward_model": {"ground_truth": "1"}}),
      json.dumps({"prompt": "q", "reward_model": {"style": "rule"}})])
  errors = envs.load_dataset(DatasetFileConfig(str(dapo), layout="dapo")).errors
  assert [(e.row, e.field) for e in errors] == [(1, "prompt"), (2, "reward_model.ground_truth")]
  with pytest.raises(ValueError, match="layout='sharegpt' is not one of"):
    DatasetFileConfig("x.jsonl", layout="sharegpt")


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
