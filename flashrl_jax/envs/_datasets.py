"""Load prompt/answer datasets from JSONL or Parquet without letting one bad row sink a run.

Real RL datasets are scraped and hand-edited; a single malformed line should be reported (with its
row number, so it can be fixed) while the rest still trains. `load_dataset` therefore returns the
good samples *and* the row errors; `strict=True` turns any error into a `DatasetError`.

Row numbers are 1-based in both formats (for JSONL they are line numbers, blank lines included).
A row needs `prompt` and `answer`; `answer` may be omitted only when `tests` is given (code tasks
graded by tests alone). Optional: `tests` (a string or a list of strings, joined by newlines),
`reference_time` (seconds, >= 0), `id` (defaults to `row<N>`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import pathlib
from typing import Any, Iterator

from flashrl_jax.envs._types import Sample


class DatasetFormat(enum.Enum):
  JSONL = "jsonl"
  PARQUET = "parquet"

  @classmethod
  def from_path(cls, path: pathlib.Path) -> "DatasetFormat":
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
      return cls.JSONL
    if suffix in (".parquet", ".pq"):
      return cls.PARQUET
    raise ValueError(f"{path}: cannot tell the dataset format from suffix {suffix!r}; pass `fmt=`")


@dataclasses.dataclass(frozen=True)
class RowError:
  row: int  # 1-based
  message: str

  def __str__(self) -> str:
    return f"row {self.row}: {self.message}"


@dataclasses.dataclass(frozen=True)
class LoadedDataset:
  samples: tuple[Sample, ...]
  errors: tuple[RowError, ...]
  path: str = ""

  def __len__(self) -> int:
    return len(self.samples)


class DatasetError(ValueError):
  """Raised in strict mode (or for an unreadable file); carries every row error found."""

  def __init__(self, path: str, errors: tuple[RowError, ...]):
    self.errors = errors
    shown = "; ".join(str(e) for e in errors[:5])
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    super().__init__(f"{path}: {len(errors)} bad row(s): {shown}{more}")


def _as_text(value: Any, field: str) -> str:
  if isinstance(value, str):
    return value
  # bool is an int subclass, but `true` as an answer is almost surely a data bug.
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return str(value)
  raise ValueError(f"field {field!r} must be a string or a number, got {type(value).__name__}")


def row_to_sample(row: Any, row_number: int) -> Sample:
  """Validates one decoded row; raises ValueError with a message naming the bad field."""
  if not isinstance(row, dict):
    raise ValueError(f"row must be an object, got {type(row).__name__}")
  if row.get("prompt") is None:
    raise ValueError("missing required field 'prompt'")
  prompt = _as_text(row["prompt"], "prompt")
  tests = row.get("tests")
  if tests is not None:
    if isinstance(tests, (list, tuple)) and all(isinstance(t, str) for t in tests):
      tests = "\n".join(tests)
    elif not isinstance(tests, str):
      raise ValueError("field 'tests' must be a string or a list of strings")
  if row.get("answer") is None and tests is None:
    raise ValueError("missing required field 'answer' (needed unless 'tests' is given)")
  answer = "" if row.get("answer") is None else _as_text(row["answer"], "answer")
  ref = row.get("reference_time")
  if ref is not None:
    if isinstance(ref, bool) or not isinstance(ref, (int, float)) or not math.isfinite(ref) or ref < 0:
      raise ValueError(f"field 'reference_time' must be a finite number >= 0, got {ref!r}")
    ref = float(ref)
  raw_id = row.get("id")
  sample_id = f"row{row_number}" if raw_id is None else _as_text(raw_id, "id")
  return Sample(prompt=prompt, answer=answer, tests=tests, reference_time=ref, id=sample_id)


def _jsonl_rows(path: pathlib.Path) -> Iterator[tuple[int, Any, str | None]]:
  with path.open("r", encoding="utf-8", errors="replace") as f:
    for number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        yield number, json.loads(line), None
      except json.JSONDecodeError as e:
        yield number, None, f"malformed JSON: {e.msg} (column {e.colno})"


def _parquet_rows(path: pathlib.Path) -> Iterator[tuple[int, Any, str | None]]:
  import pyarrow.parquet as pq  # Imported lazily: only Parquet users pay for pyarrow.

  table = pq.read_table(path)
  for number, row in enumerate(table.to_pylist(), start=1):
    yield number, row, None


def load_dataset(path: str | pathlib.Path, *, fmt: DatasetFormat | None = None,
                 strict: bool = False) -> LoadedDataset:
  """Loads every valid row of `path`; bad rows become `RowError`s (or a `DatasetError` if strict)."""
  path = pathlib.Path(path)
  fmt = fmt or DatasetFormat.from_path(path)
  rows = _jsonl_rows(path) if fmt is DatasetFormat.JSONL else _parquet_rows(path)
  samples, errors = [], []
  for number, row, decode_error in rows:
    if decode_error is not None:
      errors.append(RowError(number, decode_error))
      continue
    try:
      samples.append(row_to_sample(row, number))
    except ValueError as e:
      errors.append(RowError(number, str(e)))
  if strict and errors:
    raise DatasetError(str(path), tuple(errors))
  return LoadedDataset(samples=tuple(samples), errors=tuple(errors), path=str(path))


def save_jsonl(samples: list[Sample] | tuple[Sample, ...], path: str | pathlib.Path) -> None:
  """Writes samples in the format `load_dataset` reads (used by demos to materialise synthetic data)."""
  with pathlib.Path(path).open("w", encoding="utf-8") as f:
    for s in samples:
      row = {k: v for k, v in dataclasses.asdict(s).items() if v is not None}
      f.write(json.dumps(row) + "\n")
