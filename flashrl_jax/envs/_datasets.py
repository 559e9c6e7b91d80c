"""Load prompt/answer datasets from JSONL or Parquet without letting one bad row sink a run.

Real RL datasets are scraped and hand-edited; a single malformed line should be reported (with the
file, its row number and the field, so it can be fixed) while the rest still trains. `load_dataset`
therefore returns the good samples *and* the row errors; `strict=True` turns any error into a
`DatasetError`.

Row numbers are 1-based in both formats (for JSONL they are line numbers, blank lines included).
The common public layouts are read as they are published (`DatasetLayout`):

  GENERIC  the project's own rows: `prompt`, `answer` (may be omitted when `tests` is given: code
           tasks graded by tests alone), optional `tests` (a string or a list of strings, joined by
           newlines), `reference_time` (seconds, >= 0), `id` (defaults to `row<N>`), `task`.
  GSM8K    `question`; `answer` is the worked solution ending in `#### <final answer>`.
  MATH     `problem`; `answer` when present (MATH-500), else the last `\\boxed{}` of `solution`.
  DAPO     `prompt` as chat messages (the last user message is the question) or a string;
           `reward_model.ground_truth` is the answer (DAPO-Math-17k, verl's RL parquet layout).

`question_field` / `answer_field` (dotted paths into nested rows, e.g. `reward_model.ground_truth`)
override a layout's choice for other files. Every field a layout does not consume goes into
`Sample.metadata` (or the row's `metadata` object, when it has one).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import pathlib
from typing import Any, Iterator

from flashrl_jax._enums import parse_enum
from flashrl_jax.envs._math_extract import last_boxed
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


class DatasetLayout(enum.Enum):
  GENERIC = "generic"
  GSM8K = "gsm8k"
  MATH = "math"
  DAPO = "dapo"


@dataclasses.dataclass(frozen=True)
class DatasetFileConfig:
  """A dataset file as an RLVR task.

  Attributes:
    path: a `.jsonl` / `.parquet` file.
    layout: which public layout its rows follow (see the module docstring).
    question_field, answer_field: dotted paths overriding the layout's fields ("" keeps them).
    name: the task name in per-dataset metrics (default: the file's stem).
    strict: fail on the first load if any row is bad (default: report bad rows and skip them).
  """

  path: str
  layout: DatasetLayout = DatasetLayout.GENERIC
  question_field: str = ""
  answer_field: str = ""
  name: str = ""
  strict: bool = False

  def __post_init__(self):
    object.__setattr__(self, "layout", parse_enum(DatasetLayout, self.layout, "layout"))
    if not self.path:
      raise ValueError("DatasetFileConfig.path is required.")

  @property
  def task_name(self) -> str:
    return self.name or pathlib.Path(self.path).stem


@dataclasses.dataclass(frozen=True)
class RowError:
  row: int  # 1-based
  message: str
  field: str | None = None  # the offending field, when one is to blame

  def __str__(self) -> str:
    where = f"field {self.field!r}: " if self.field else ""
    return f"row {self.row}: {where}{self.message}"


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


class _FieldError(ValueError):
  def __init__(self, field: str | None, message: str):
    super().__init__(message)
    self.field = field


def _as_text(value: Any, field: str) -> str:
  if isinstance(value, str):
    return value
  # bool is an int subclass, but `true` as an answer is almost surely a data bug.
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return str(value)
  raise _FieldError(field, f"must be a string or a number, got {type(value).__name__}")


def _get(row: dict, path: str) -> Any:
  """`row["a"]["b"]` for path `a.b`; None when any part is missing."""
  value: Any = row
  for part in path.split("."):
    if not isinstance(value, dict):
      return None
    value = value.get(part)
  return value


def _required_text(row: dict, path: str) -> str:
  value = _get(row, path)
  if value is None:
    raise _FieldError(path, "missing required field")
  return _as_text(value, path)


def _gsm8k_answer(text: str, field: str) -> str:
  if "####" not in text:
    raise _FieldError(field, "a GSM8K answer must end with '#### <final answer>'")
  final = text.rsplit("####", 1)[1].strip().replace(",", "")
  if not final:
    raise _FieldError(field, "nothing after '####'")
  return final


def _math_answer(row: dict) -> str:
  if _get(row, "answer") is not None:
    return _as_text(row["answer"], "answer")
  solution = _get(row, "solution")
  if solution is None:
    raise _FieldError("answer", "missing: a MATH row needs 'answer' or a 'solution' with \\boxed{}")
  boxed = last_boxed(_as_text(solution, "solution"))
  if boxed is None or not boxed.strip():
    raise _FieldError("solution", "has no \\boxed{...} answer")
  return boxed.strip()


def _dapo_question(row: dict, field: str) -> str:
  prompt = _get(row, field)
  if isinstance(prompt, str):
    return prompt
  if isinstance(prompt, (list, tuple)) and prompt:
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    if users and isinstance(users[-1].get("content"), str):
      return users[-1]["content"]
    raise _FieldError(field, "chat messages need a user message with string 'content'")
  if prompt is None:
    raise _FieldError(field, "missing required field")
  raise _FieldError(field, f"must be a string or a list of chat messages, got "
                           f"{type(prompt).__name__}")


# (question field, answer field) per layout; the answer parsers below turn a row into the final answer.
_FIELDS = {DatasetLayout.GENERIC: ("prompt", "answer"), DatasetLayout.GSM8K: ("question", "answer"),
           DatasetLayout.MATH: ("problem", "answer"),
           DatasetLayout.DAPO: ("prompt", "reward_model.ground_truth")}
_CONSUMED = {DatasetLayout.GENERIC: {"prompt", "answer", "tests", "reference_time", "id", "task"},
             DatasetLayout.GSM8K: {"question", "answer"},
             DatasetLayout.MATH: {"problem", "answer", "solution"},
             DatasetLayout.DAPO: {"prompt", "reward_model"}}


def _metadata(row: dict, consumed: set[str]) -> dict | None:
  if isinstance(row.get("metadata"), dict):
    return row["metadata"]
  rest = {k: v for k, v in row.items() if k not in consumed and k != "metadata"}
  return rest or None


def _generic(row: dict, row_number: int, question_field: str, answer_field: str) -> Sample:
  prompt = _required_text(row, question_field)
  tests = row.get("tests")
  if tests is not None:
    if isinstance(tests, (list, tuple)) and all(isinstance(t, str) for t in tests):
      tests = "\n".join(tests)
    elif not isinstance(tests, str):
      raise _FieldError("tests", "must be a string or a list of strings")
  answer_value = _get(row, answer_field)
  if answer_value is None and tests is None:
    raise _FieldError(answer_field, "missing required field (needed unless 'tests' is given)")
  answer = "" if answer_value is None else _as_text(answer_value, answer_field)
  ref = row.get("reference_time")
  if ref is not None:
    if isinstance(ref, bool) or not isinstance(ref, (int, float)) or not math.isfinite(ref) or ref < 0:
      raise _FieldError("reference_time", f"must be a finite number >= 0, got {ref!r}")
    ref = float(ref)
  raw_id = row.get("id")
  sample_id = f"row{row_number}" if raw_id is None else _as_text(raw_id, "id")
  task = "" if row.get("task") is None else _as_text(row["task"], "task")
  return Sample(prompt=prompt, answer=answer, tests=tests, reference_time=ref, id=sample_id,
                task=task, metadata=_metadata(row, _CONSUMED[DatasetLayout.GENERIC]))


def row_to_sample(row: Any, row_number: int, config: DatasetFileConfig | None = None) -> Sample:
  """Validates one decoded row; raises `_FieldError` (a ValueError) naming the bad field."""
  layout = config.layout if config else DatasetLayout.GENERIC
  if not isinstance(row, dict):
    raise _FieldError(None, f"row must be an object, got {type(row).__name__}")
  question_field = (config and config.question_field) or _FIELDS[layout][0]
  answer_field = (config and config.answer_field) or _FIELDS[layout][1]
  if layout is DatasetLayout.GENERIC:
    return _generic(row, row_number, question_field, answer_field)
  if layout is DatasetLayout.DAPO:
    question = _dapo_question(row, question_field)
  else:
    question = _required_text(row, question_field)
  if config and config.answer_field:
    answer = _required_text(row, answer_field)
  elif layout is DatasetLayout.GSM8K:
    answer = _gsm8k_answer(_required_text(row, answer_field), answer_field)
  elif layout is DatasetLayout.MATH:
    answer = _math_answer(row)
  else:
    answer = _required_text(row, answer_field)
  if not answer.strip():
    raise _FieldError(answer_field, "the answer is empty")
  consumed = _CONSUMED[layout] | {question_field.split(".")[0], answer_field.split(".")[0]}
  index = _get(row, "extra_info.index") if layout is DatasetLayout.DAPO else row.get("id")
  sample_id = f"row{row_number}" if index is None else str(index)
  task = (config.task_name if config else "")
  return Sample(prompt=question, answer=answer.strip(), id=sample_id, task=task,
                metadata=_metadata(row, consumed))


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


def load_dataset(path: str | pathlib.Path | DatasetFileConfig, *, fmt: DatasetFormat | None = None,
                 strict: bool | None = None) -> LoadedDataset:
  """Loads every valid row; bad rows become `RowError`s (or a `DatasetError` if strict).

  `path` is a file (GENERIC layout) or a `DatasetFileConfig` (any layout; its `strict` applies
  unless `strict` is given here).
  """
  config = path if isinstance(path, DatasetFileConfig) else None
  path = pathlib.Path(config.path if config else path)
  strict = (config.strict if config else False) if strict is None else strict
  fmt = fmt or DatasetFormat.from_path(path)
  rows = _jsonl_rows(path) if fmt is DatasetFormat.JSONL else _parquet_rows(path)
  samples, errors = [], []
  for number, row, decode_error in rows:
    if decode_error is not None:
      errors.append(RowError(number, decode_error))
      continue
    try:
      samples.append(row_to_sample(row, number, config))
    except _FieldError as e:
      errors.append(RowError(number, str(e), e.field))
  if strict and errors:
    raise DatasetError(str(path), tuple(errors))
  return LoadedDataset(samples=tuple(samples), errors=tuple(errors), path=str(path))


def save_jsonl(samples: list[Sample] | tuple[Sample, ...], path: str | pathlib.Path) -> None:
  """Writes samples in the GENERIC layout `load_dataset` reads (demos materialise tasks with it)."""
  with pathlib.Path(path).open("w", encoding="utf-8") as f:
    for s in samples:
      row = {k: v for k, v in dataclasses.asdict(s).items() if v is not None}
      f.write(json.dumps(row) + "\n")

