"""The census's counting logic on toy labels (the by-eye CSV -> counts, tail estimate, recall)."""

import csv
import json

import numpy as np
import pytest

from dpscale.benchmarks import dedup_census as dc


def _labels(spec):
    return [{"rank": r, "test_index": 100 + r, "train_index": r, "label": lab, "note": ""}
            for r, lab in spec]


def test_counts_top_block_tail_estimate_and_recall():
    top = [(0, "dup"), (1, "dup"), (2, "unsure"), (3, "dup"), (4, "diff"), (5, "diff")]
    tail = [(10, "dup"), (20, "diff"), (30, "diff"), (40, "diff")]
    out = dc.census(_labels(top + tail), judged_until=6, total=46, matched={100, 102, 103, 110, 999})
    assert out["top"] == {"dup": 3, "unsure": 1, "diff": 2}
    assert out["last_dup_rank"] == 3 and out["ranks_after_last_dup"] == 2
    (tail_stratum,) = out["tail"]
    assert tail_stratum["size"] == 40 and tail_stratum["sampled"] == 4
    assert tail_stratum["estimate"] == pytest.approx(10.0)  # 1 of 4 sampled, 40 in the tail
    assert out["count"]["clear"] == 3 and out["count"]["clear_plus_unsure"] == 4
    assert out["count"]["with_tail_estimate"] == pytest.approx(13.0)
    lo, hi = out["count"]["range_95"]
    assert 3 <= lo < 13 < hi <= 4 + 40
    d = out["dedup"]
    assert d["clear_found"] == 2 and d["recall_on_clear"] == pytest.approx(2 / 3)
    assert d["unsure_found"] == 1 and d["tail_dups_found"] == 1
    assert d["matched_not_dup_in_judged_block"] == [102, 110, 999]
    assert d["matched_in_top_block_judged_diff"] == []
    # 2 of 3 found in the block, the tail's 10 estimated duplicates all found (1 of 1 sampled)
    assert d["recall_with_tail_estimate"] == pytest.approx((2 + 10) / (3 + 10))


def test_an_unjudged_rank_in_the_top_block_is_refused():
    with pytest.raises(ValueError, match="not all judged"):
        dc.census(_labels([(0, "dup"), (2, "diff")]), judged_until=3, total=10)


def test_wilson_interval_covers_zero_counts():
    lo, hi = dc.wilson(0, 100)
    assert lo == 0.0 and 0.02 < hi < 0.05
    lo, hi = dc.wilson(50, 100)
    assert lo < 0.5 < hi


def test_labels_csv_is_validated(tmp_path):
    path = tmp_path / "l.csv"
    with open(path, "w", newline="") as h:
        w = csv.writer(h)
        w.writerow(["rank", "test_index", "train_index", "label", "note"])
        w.writerow([0, 5, 7, "maybe", ""])
    with pytest.raises(ValueError, match="not in"):
        dc.read_labels(str(path))


def test_nearest_is_mirror_aware_and_ranks_from_features(tmp_path):
    rng = np.random.default_rng(0)
    train = rng.normal(size=(20, 8))
    train /= np.linalg.norm(train, axis=1, keepdims=True)
    test = rng.normal(size=(3, 8))
    test /= np.linalg.norm(test, axis=1, keepdims=True)
    mirror = test.copy()
    test[0] = train[4]        # a plain copy of train 4
    mirror[1] = train[9]      # a mirrored copy of train 9
    np.savez(tmp_path / "features.npz", resolution=8, train=train.astype(np.float16),
             test=test.astype(np.float16), test_mirror=mirror.astype(np.float16))
    best, index, mirrored = dc.nearest(test, mirror, train)
    assert index[0] == 4 and not mirrored[0] and best[0] == pytest.approx(1, abs=1e-6)
    assert index[1] == 9 and mirrored[1]
    dc.rank(str(tmp_path))
    ranking = dc.read_ranking(str(tmp_path))
    assert {r["test_index"] for r in ranking[:2]} == {0, 1}  # both exact copies (similarity 1)
    assert ranking[2]["test_index"] == 2


def test_dedup_report_matched_test_indices(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"removed": [
        {"private_split": "test", "private_index": 3}, {"private_split": "test", "private_index": 3},
        {"private_split": "test", "private_index": 8}]}))
    assert dc.dedup_matched(str(path)) == {3, 8}


def test_recall_of_a_report_counts_all_decisions_and_the_pixel_checks_alone(tmp_path, capsys):
    labels = tmp_path / "labels.csv"
    with open(labels, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["rank", "test_index", "train_index", "label", "note"])
        w.writeheader()
        w.writerows(_labels([(0, "dup"), (1, "dup"), (2, "diff"), (3, "dup"), (10, "dup"), (20, "diff")]))
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"removed": [
        {"private_split": "test", "private_index": 100, "decided_by": "grid"},
        {"private_split": "test", "private_index": 101, "decided_by": "copy"},
        {"private_split": "test", "private_index": 110, "decided_by": "refined"}]}))
    dc.main(["recall", str(labels), str(report), "--judged-until", "4", "--total", "30"])
    out = json.loads(capsys.readouterr().out)
    assert out["all decisions"]["clear_found"] == 2 and out["all decisions"]["tail_dups_found"] == 1
    assert out["credited to grid + refined (removed pairs)"]["clear_found"] == 1
    assert out["all decisions"]["recall_on_clear"] == pytest.approx(2 / 3)


def test_a_judged_sample_extrapolates_to_its_population():
    rows = _labels([(0, "dup"), (1, "dup"), (2, "dup"), (3, "diff")])
    out = dc.judged_sample(rows, 100)
    assert out["dup"]["estimate"] == pytest.approx(75.0) and out["diff"]["sampled"] == 1
    lo, hi = out["dup"]["ci95"]
    assert lo < 75 < hi <= 100


def test_strata_estimate_each_part_of_the_tail_from_its_own_sample():
    top = [(0, "dup"), (1, "diff")]
    tail = [(2, "dup"), (3, "diff"), (10, "diff"), (20, "diff"), (30, "dup"), (40, "diff")]
    out = dc.census(_labels(top + tail), judged_until=2, total=52, strata=[10])
    assert [s["ranks"] for s in out["tail"]] == [[2, 10], [10, 52]]
    assert out["tail"][0]["estimate"] == pytest.approx(8 * 1 / 2)
    assert out["tail"][1]["estimate"] == pytest.approx(42 * 1 / 4)
    assert out["count"]["with_tail_estimate"] == pytest.approx(1 + 4 + 10.5)


def test_labels_that_no_longer_fit_the_ranking_are_refused():
    ranking = [{"rank": r, "test_index": 100 + r, "train_index": r} for r in range(3)]
    dc.check_against_ranking(_labels([(0, "dup"), (2, "diff")]), ranking)
    moved = _labels([(1, "dup")])
    moved[0]["test_index"] = 7
    with pytest.raises(ValueError, match="other pairs"):
        dc.check_against_ranking(moved, ranking)


def test_montage_pairs_are_split_into_numbered_sheets_with_their_csvs(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "features.npz", resolution=8, train=rng.normal(size=(20, 8)).astype(np.float16),
             test=rng.normal(size=(12, 8)).astype(np.float16), test_mirror=rng.normal(size=(12, 8)).astype(np.float16))
    dc.rank(str(tmp_path))
    drawn = []
    monkeypatch.setattr(dc, "montage", lambda data, rows, path: drawn.append((path, [r["rank"] for r in rows])))
    dc.main(["montage", "data", str(tmp_path), "--count", "12", "--per-sheet", "5"])
    assert drawn == [(str(tmp_path / f"census_ranks00000_{k}.png"), ranks)
                     for k, ranks in ((1, [0, 1, 2, 3, 4]), (2, [5, 6, 7, 8, 9]), (3, [10, 11]))]
    with open(tmp_path / "census_ranks00000_3.csv") as handle:
        assert [int(r["rank"]) for r in csv.DictReader(handle)] == [10, 11]
    drawn.clear()
    dc.main(["montage", "data", str(tmp_path), "--count", "12"])  # the default: one sheet
    assert drawn == [(str(tmp_path / "census_ranks00000.png"), list(range(12)))]
