"""A `sim_vs_measured` pass read back from its files: the runs and calibrations it kept."""

import json
import os

from experiments import _pass_files


def test_a_passes_saved_runs_are_found_in_the_order_they_ran(tmp_path):
  # Tried: a pass directory holding sync r0, α=2 r0 and r1 (α=2 first), an α=4 run cut off before
  # its run.json was written, a calibration per layout before the runs and only the sync one after.
  def save(name: str, start: float) -> None:
    (tmp_path / name).mkdir()
    (tmp_path / name / "run.json").write_text(json.dumps({"start": start, "end": start + 40}))
  save("longtail_sync", 100.0)
  save("longtail_async_a2", 50.0)
  save("longtail_async_a2_r1", 200.0)
  (tmp_path / "longtail_async_a4").mkdir()
  for name in ("sync", "async", "sync_after"):
    (tmp_path / f"longtail_calibration_{name}.json").write_text(json.dumps({"layout": name}))
  runs = _pass_files.saved_runs(str(tmp_path), "longtail", ["sync", "1", "2", "4"])
  assert [(r.mode, r.repeat, r.start) for r in runs] == [("2", 0, 50.0), ("sync", 0, 100.0),
                                                         ("2", 1, 200.0)]
  assert runs[0].workdir == str(tmp_path / "longtail_async_a2") and runs[0].alpha == 2
  assert runs[1].layout == "sync" and runs[2].info == {"start": 200.0, "end": 240.0}
  assert _pass_files.saved_runs(str(tmp_path), "balanced", ["sync"]) == []
  before = _pass_files.saved_calibrations(str(tmp_path), "longtail", "")
  after = _pass_files.saved_calibrations(str(tmp_path), "longtail", "_after")
  assert before == {"sync": {"layout": "sync"}, "async": {"layout": "async"}}
  assert after == {"sync": {"layout": "sync_after"}}
  # Where each run is kept is where a pass writes it.
  assert (_pass_files.run_dir("o", "balanced", "4", 1)
          == os.path.join("o", "balanced_async_a4_r1"))
