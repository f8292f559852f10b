"""The label comparison: each rejected pair is blamed on the cuts it fails, counts per label."""

import numpy as np

from dpscale.benchmarks import dedup_refine_rules as rr
from dpscale.dedup import refine


def _refined(rows):
    cols = list(zip(*rows))
    return refine.Refined(*(np.array(c, np.float32) for c in cols))


def test_why_rejected_names_every_failing_cut():
    inf = float("inf")
    r = _refined([(0.01, 0.2, 0.05, 1.0, 1.0),    # rank
                  (0.01, 0.01, 0.5, 2.0, 1.0),    # detail, scale
                  (inf, inf, inf, 0.0, inf)])     # no fit
    assert rr.why_rejected(r) == {"rank": 1, "warp not a re-crop + detail": 1, "ECC did not converge": 1}


def test_rules_and_counts():
    r = _refined([(0.01, 0.01, 0.05, 1.0, 1.0),   # both rules accept
                  (0.05, 0.01, 0.05, 1.0, 1.0),   # Pearson fails v2 only (the rank is fine)
                  (0.01, 0.01, 0.05, 1.45, 1.0)])  # scale 1.45: v4 only
    labels = np.array(["dup", "diff", "unsure"])
    assert rr.counts(rr.RULES["v2"](r), labels) == {"dup": 1, "unsure": 0, "diff": 0}
    assert rr.counts(rr.RULES["v4"](r), labels) == {"dup": 1, "unsure": 1, "diff": 1}
    both = rr._pick(r, _refined([(9, 9, 9, 9, 9)] * 3), np.array([False, True, False]))
    assert both.ecc_distance.tolist() == [np.float32(0.01), 9, np.float32(0.01)]
