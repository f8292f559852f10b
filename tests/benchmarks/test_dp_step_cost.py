"""benchmarks/dp_step_cost.py reports each step's own seconds and flags the one that got slower."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root holds benchmarks/

from benchmarks.dp_step_cost import compare, per_step_seconds, summarize


def _write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_per_step_seconds_come_from_both_record_files_and_skip_steps_after_an_epsilon_log(tmp_path):
    _write(
        tmp_path / "metrics.jsonl",
        [
            {"step": 1, "update_norm": 1.0, "epsilon_spent": 0.1},
            {"step": 2, "update_norm": 1.0},
            {"step": 3, "update_norm": 1.0},
        ],
    )
    _write(
        tmp_path / "diagnostics.NOT-PRIVATE.jsonl",
        [{"step": 1, "seconds": 10.0}, {"step": 2, "seconds": 13.0}, {"step": 3, "seconds": 14.5}],
    )
    assert per_step_seconds(tmp_path) == {3: 1.5}  # step 2 follows the log of step 1


def _times(dp: float, nonprivate: float) -> dict[str, list[dict[int, float]]]:
    return {"dp": [{4: dp, 5: dp}, {4: dp, 5: dp}], "nonprivate": [{4: nonprivate, 5: nonprivate}] * 2}


def test_a_row_holds_each_steps_own_seconds_per_run_beside_the_ratio():
    row = summarize("wrn-16-4:64:1", 64, _times(2.7, 2.2), {"dp": [2000, 2100], "nonprivate": [1400, 1300]})
    assert (row["dp_step_s"], row["nonprivate_step_s"]) == (2.7, 2.2)
    assert row["dp_runs_s"] == [2.7, 2.7] and row["nonprivate_runs_s"] == [2.2, 2.2]
    assert abs(row["ratio_median"] - 2.7 / 2.2) < 1e-12
    assert row["dp_peak_mb"] == 2100 / 1024


def test_a_slower_non_private_step_is_flagged_even_when_the_ratio_looks_better():
    rss = {"dp": [1], "nonprivate": [1]}
    then = summarize("wrn-16-4:64:1", 64, _times(2.7, 2.2), rss) | {"commit": "127f8d3", "load_before": 1.1}
    now = summarize("wrn-16-4:64:1", 64, _times(5.4, 11.5), rss)
    assert now["ratio_median"] < then["ratio_median"]  # DP looks cheaper than ever...
    dp_line, nonprivate_line = compare(now, [then], tolerance=0.2)
    assert "SLOWER" in dp_line and "SLOWER" in nonprivate_line  # ...while both steps got slower
    assert "127f8d3" in nonprivate_line and "x5.23" in nonprivate_line
    same = compare(summarize("wrn-16-4:64:1", 64, _times(2.8, 2.1), rss), [then], tolerance=0.2)
    assert not any("SLOWER" in line for line in same)
    other_batch = then | {"batch": 256}
    assert compare(now, [other_batch], tolerance=0.2) == ["wrn-16-4:64:1 B=64: nothing earlier to compare with"]
