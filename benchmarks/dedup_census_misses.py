"""Where `dpscale dedup` loses the census duplicates it misses, recomputed with dedup's own modules.

For every census pair (test image, its EfficientNet-nearest train image; labels from
``dedup_census.py``) this recomputes in memory what the default method does with it: the
descriptor similarity of the train copy to the test image's best view and its rank among all
public images (``descriptor.describe_views`` / ``describe``; ranks as in ``knn.search``), then
``verify.distances`` in that view's mirror state. A census duplicate dedup did not match is lost
at the first failing stage: (a) not in the top k, (b) similarity < min_similarity, (c) coarse
pass, (d) fine pass, (e) accepted but the train copy went to another test image (report).

Then candidate changes, measured on the same labels they were designed from (so not a
validated setting): the census pair as an extra candidate (descriptor kNN union the
EfficientNet nearest train image; aimed at a/b), and, aimed at d, the fine pass with half-pixel
shifts, a lower detail band, or a higher threshold (``FINE_VARIANTS`` x ``THRESHOLDS``, on the
census pairs that reach the fine pass). Found = missed census ``dup`` pairs now accepted; false
positives = census ``diff`` pairs accepted. A threshold change is also counted on the report's
list of rejected pairs nearest the cut (every candidate, mostly unjudged).

    python benchmarks/dedup_census_misses.py /tmp/w17/data/cifar10 /tmp/w20/census \\
        benchmarks/results/dedup_census_labels.csv /tmp/w17/out2/dedup_report.NOT-PRIVATE.json \\
        --output /tmp/w20/census_misses.NOT-PRIVATE.json \\
        --montage benchmarks/results/dedup_census_fine_misses.png \\
        --near-montage benchmarks/results/dedup_census_near_0.14.png      # 66 s, load ~6
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Sequence

import numpy as np

from dpscale.benchmarks.dedup_census import dedup_matched, montage, read_labels, read_ranking
from dpscale.data.dataset import IngestedDataset
from dpscale.dedup import descriptor, knn, verify
from dpscale.dedup.method import Method
from dpscale.files import open_for_writing

# (pre-blur px, detail sigma px, shift step px) of the fine pass; the first is dedup's own
FINE_VARIANTS = ((1.0, 3.0, 1.0), (1.0, 3.0, 0.5), (1.5, 3.0, 1.0), (2.0, 4.0, 1.0))
THRESHOLDS = (0.12, 0.14, 0.16)
STAGES = ("a: not in top k", "b: similarity < min", "c: coarse pass", "d: fine pass",
          "e: credited elsewhere", "found")


def half_grid(size: int, step_t: float) -> tuple:
    """``verify.alignment_grid`` with shifts every ``step_t`` px instead of whole pixels."""
    window, step = size * verify.WINDOW // verify.SIZE, verify.SIZE // size
    centre = (size - 1) / 2
    x = np.arange(size)[(size - window) // 2:(size + window) // 2]
    grid = []
    for s in verify.SCALES:
        limit = verify.MAX_SHIFT + (int(16 * (1 - s)) if s < 1 else 0)
        limit = int(np.ceil(limit / step))
        shifts, mats = [], []
        for t in np.arange(-limit, limit + 1e-9, step_t):
            pos = centre + s * (x - centre) + t
            if pos.min() >= -0.01 and pos.max() <= size - 1 + 0.01:
                shifts.append(t)
                mats.append(verify._interpolation(pos, size))
        grid.append((s, np.array(shifts), np.stack(mats)))
    return tuple(grid)


def fine_distances(public: np.ndarray, private: np.ndarray, *, pre_blur: float,
                   detail_sigma: float, shift_step: float) -> np.ndarray:
    """``verify``'s fine pass with another band / shift step (px of 32), in memory only.

    Swaps ``verify._blur`` / ``DETAIL_SIGMA`` / ``alignment_grid`` for the call: dedup/ is unchanged.
    """
    saved = verify._blur, verify.DETAIL_SIGMA, verify.alignment_grid

    def blur(n: int, size: int) -> np.ndarray:
        m = verify.sampling_matrix(n, verify.SIZE, 0.0, 1.0, pre_blur)
        return m.reshape(size, verify.SIZE // size, n).mean(1)

    verify._blur, verify.DETAIL_SIGMA = blur, detail_sigma
    if shift_step != 1.0:
        verify.alignment_grid = lambda size: half_grid(size, shift_step)
    try:
        return verify._distances(verify._luma(public, verify.SIZE, detail=True),
                                 verify._luma(private, verify.SIZE, detail=True), verify.SIZE)
    finally:
        verify._blur, verify.DETAIL_SIGMA, verify.alignment_grid = saved


def descriptor_ranks(private: np.ndarray, public_desc: np.ndarray, copy: np.ndarray,
                     *, block: int = 64) -> dict[str, np.ndarray]:
    """Per private image: the copy's best-view similarity, that view, and its 0-based rank.

    Rank = public images with a strictly higher best-view similarity (what ``knn.search`` keeps).
    """
    n = len(private)
    sim, view, rank = np.empty(n, np.float32), np.empty(n, np.int8), np.empty(n, np.int64)
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        views = descriptor.describe_views(private[lo:hi])  # [V, b, D]
        s = np.einsum("vbd,nd->vbn", views, public_desc, optimize=True)
        best = s.max(0)  # [b, n]
        rows = np.arange(hi - lo)
        c = copy[lo:hi]
        sim[lo:hi] = best[rows, c]
        view[lo:hi] = s[:, rows, c].argmax(0)
        rank[lo:hi] = (best > best[rows, c][:, None]).sum(1)
        # sanity: the top-k of knn.search itself contains the copy iff its rank < k
        top = knn.search(views, public_desc, 10)
        if not np.array_equal((top.public == c[:, None]).any(1), rank[lo:hi] < 10):
            raise AssertionError("rank disagrees with knn.search's top 10")
    return {"similarity": sim, "view": view, "rank": rank}


def analyse(data: str, work: str, labels_path: str, report_path: str, *, ks: Sequence[int]
            ) -> dict:
    method = Method()
    labels = read_labels(labels_path)
    ranking = {r["rank"]: r for r in read_ranking(work)}
    for r in labels:
        r["census_mirrored"] = ranking[r["rank"]]["mirrored"]
    matched = dedup_matched(report_path)
    with open(report_path) as handle:
        removed = {p["public_index"]: p["private_index"] for p in json.load(handle)["removed"]}

    ds = IngestedDataset(data)
    train = ds.split_images("train")
    public_desc = np.concatenate([descriptor.describe(train[lo:lo + 5000])
                                  for lo in range(0, len(train), 5000)])
    tests = np.array([r["test_index"] for r in labels])
    copies = np.array([r["train_index"] for r in labels])
    private = np.asarray(ds.get("test", tests)[0])
    d = descriptor_ranks(private, public_desc, copies)
    mirrored = np.array([descriptor.view_of(int(v))[1] for v in d["view"]])
    a, b = train[copies], private
    coarse, fine = verify.distances(a, b, mirrored)
    coarse_o, fine_o = verify.distances(a, b, ~mirrored)  # the other mirror state

    rows = []
    for i, r in enumerate(labels):
        row = {**{k: r[k] for k in ("rank", "test_index", "train_index", "label")},
               "block": "top" if r["rank"] < 1000 else "tail",
               "dedup_matched": r["test_index"] in matched,
               "census_mirrored": r["census_mirrored"],
               "similarity": round(float(d["similarity"][i]), 4),
               "knn_rank": int(d["rank"][i]), "view": descriptor.view_name(int(d["view"][i])),
               "coarse": round(float(coarse[i]), 4), "fine": round(float(fine[i]), 4),
               "coarse_other": round(float(coarse_o[i]), 4),
               "fine_other": round(float(fine_o[i]), 4),
               "train_removed_for": removed.get(r["train_index"])}
        row["verified"] = bool(fine[i] <= method.threshold)
        row["verified_either"] = bool(min(fine[i], fine_o[i]) <= method.threshold)
        rows.append(row)

    def stage(row: dict, k: int) -> str:
        if row["knn_rank"] >= k:
            return STAGES[0]
        if row["similarity"] < method.min_similarity:
            return STAGES[1]
        if row["coarse"] > verify.COARSE_CUT:
            return STAGES[2]
        if not row["verified"]:
            return STAGES[3]
        if row["train_removed_for"] not in (None, row["test_index"]):
            return STAGES[4]
        return STAGES[5]

    out: dict = {"settings": {"k": method.k, "min_similarity": method.min_similarity,
                              "coarse_cut": verify.COARSE_CUT, "threshold": method.threshold}}
    missed = [r for r in rows if r["label"] == "dup" and not r["dedup_matched"]]
    for block in ("top", "tail"):
        ms = [r for r in missed if r["block"] == block]
        out[f"missed_{block}"] = len(ms)
        for k in ks:
            out[f"stages_{block}_k{k}"] = dict(Counter(stage(r, k) for r in ms))
        a_rows = [r for r in ms if r["knn_rank"] >= method.k]
        if a_rows:
            rk = np.array([r["knn_rank"] for r in a_rows])
            sm = np.array([r["similarity"] for r in a_rows])
            out[f"stage_a_{block}"] = {
                "rank_min_median_max": [int(rk.min()), int(np.median(rk)), int(rk.max())],
                "similarity_min_median_max": [float(sm.min()), float(np.median(sm)),
                                              float(sm.max())],
                "best_view_mirrored": sum("mirrored" in r["view"] for r in a_rows),
                "census_mirrored": sum(r["census_mirrored"] for r in a_rows),
                "verified_if_candidate": sum(r["verified"] for r in a_rows),
                "verified_either_mirror": sum(r["verified_either"] for r in a_rows)}
        for name, field in (("b", "similarity"), ("c", "coarse"), ("d", "fine")):
            v = [r[field] for r in ms if stage(r, method.k).startswith(name)]
            if v:
                out[f"stage_{name}_{block}_{field}_min_median_max"] = [
                    min(v), float(np.median(v)), max(v)]
        d_rows = [r for r in ms if stage(r, method.k).startswith("d")]
        out[f"stage_d_{block}_mirrored"] = {
            "best_view": sum("mirrored" in r["view"] for r in d_rows),
            "census": sum(r["census_mirrored"] for r in d_rows),
            "other_state_passes": sum(r["fine_other"] <= method.threshold for r in d_rows)}
        out[f"verified_if_candidate_{block}"] = sum(r["verified"] for r in ms)
        out[f"verified_either_mirror_{block}"] = sum(r["verified_either"] for r in ms)

    # change 1 (aimed at a/b): the census pair (EfficientNet nearest) is a candidate too
    def candidate(r: dict) -> bool:
        return r["knn_rank"] < method.k and r["similarity"] >= method.min_similarity

    for block in ("top", "tail"):
        new = [r for r in rows if r["block"] == block and not candidate(r) and r["verified"]]
        res = Counter(f"{r['label']} accepted" for r in new)
        res["missed dup now found"] = sum(r["label"] == "dup" and not r["dedup_matched"]
                                          for r in new)
        out[f"change_union_{block}"] = dict(sorted(res.items()))

    # changes 2-3 (aimed at d): a lower fine band / threshold, on pairs reaching the fine pass
    fine_rows = [i for i, r in enumerate(rows) if candidate(r) and r["coarse"] <= verify.COARSE_CUT]
    pub, priv = a[fine_rows], b[fine_rows]
    priv = np.where(mirrored[fine_rows][:, None, None, None], priv[:, :, ::-1], priv)
    with open(report_path) as handle:
        near = json.load(handle)["near_threshold_rejected"]
    by_pair = {(r["test_index"], r["train_index"]): r["label"] for r in rows}
    if max(p["distance"] for p in near) < max(THRESHOLDS):
        out["report near list ends at"] = max(p["distance"] for p in near)
    for pre, detail, step in FINE_VARIANTS:
        f = fine_distances(pub, priv, pre_blur=pre, detail_sigma=detail, shift_step=step)
        base = np.array([rows[i]["fine"] for i in fine_rows])
        if (pre, detail, step) == FINE_VARIANTS[0] and not np.allclose(f, base, atol=1e-4):
            raise AssertionError("the in-memory fine pass does not reproduce verify.distances")
        for t in THRESHOLDS:
            key = f"fine_pre{pre}_detail{detail}_step{step}_t{t}"
            res: Counter = Counter()
            for j, i in enumerate(fine_rows):
                r = rows[i]
                if f[j] <= t:
                    res[f"{r['block']} {r['label']} accepted"] += 1
                    if r["label"] == "dup" and not r["dedup_matched"] and \
                            r["train_removed_for"] in (None, r["test_index"]):
                        res[f"{r['block']} missed dup now found"] += 1
                elif r["verified"]:
                    res[f"{r['block']} {r['label']} lost"] += 1
            if (pre, detail, step) == FINE_VARIANTS[0] and t <= max(p["distance"] for p in near):
                new = [p for p in near if p["distance"] <= t]
                res["report near list: newly accepted pairs (all candidates)"] = len(new)
                for p in new:
                    lab = by_pair.get((p["private_index"], p["public_index"]), "not judged")
                    res[f"report near list: newly accepted, census label {lab}"] += 1
            out[key] = dict(sorted(res.items()))
    out["rows"] = rows
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("data")
    p.add_argument("work")
    p.add_argument("labels")
    p.add_argument("dedup_report")
    p.add_argument("--ks", type=int, nargs="+", default=[10, 30])
    p.add_argument("--output", default=None, help="JSON with every row (private diagnostic)")
    p.add_argument("--montage", default=None,
                   help="PNG of every second top-block miss lost at the fine pass (by distance)")
    p.add_argument("--near-montage", default=None,
                   help="PNG of a seeded random 40 of the report's rejected pairs at 0.12-0.14 "
                        "that are not census pairs (what the cut at 0.14 would add, unjudged)")
    a = p.parse_args(argv)
    out = analyse(a.data, a.work, a.labels, a.dedup_report, ks=a.ks)
    if a.montage:
        d = sorted((r for r in out["rows"] if r["block"] == "top" and r["label"] == "dup"
                    and not r["dedup_matched"] and r["knn_rank"] < Method().k
                    and r["similarity"] >= Method().min_similarity
                    and r["coarse"] <= verify.COARSE_CUT and not r["verified"]),
                   key=lambda r: r["fine"])
        montage(a.data, [dict(r, tag=f"#{r['rank']} f={r['fine']:.2f}",
                              mirrored="mirrored" in r["view"]) for r in d[::2]], a.montage,
                scale=2)
    if a.output:  # per-pair rows of the private (test) images: 0600, like dedup's own report
        with open_for_writing(a.output, private=True) as handle:
            json.dump(out, handle, indent=1)
    if a.near_montage:
        with open(a.dedup_report) as handle:
            near = json.load(handle)["near_threshold_rejected"]
        judged = {(r["test_index"], r["train_index"]) for r in out["rows"]}
        pool = [p for p in near if p["distance"] <= 0.14
                and (p["private_index"], p["public_index"]) not in judged]
        pick = np.random.default_rng(0).choice(len(pool), min(40, len(pool)), replace=False)
        rows = [{"rank": -1, "test_index": pool[i]["private_index"],
                 "train_index": pool[i]["public_index"],
                 "tag": f"t{pool[i]['private_index']} f={pool[i]['distance']:.3f}",
                 "similarity": pool[i]["similarity"], "mirrored": "mirrored" in pool[i]["view"]}
                for i in sorted(pick)]
        montage(a.data, rows, a.near_montage, scale=2)
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
