"""The refinement's cuts against every by-eye label, in memory (the comparisons behind dedup.md).

Two label sets: the census pairs (``dedup_census_labels.csv``: a test image and its
EfficientNet-nearest train image; decided in the better of the two mirror states, the grid's
distance the smaller of the two) and the refined pairs judged from dedup's own runs
(``dedup_refined_labels.csv``: decided in the candidate view's mirror state). Both go through
``dedup.refine`` as it is now (one fit); each rule is a set of cuts on its output:
``v2`` (Pearson's correlation of the blurred luma >= 0.96, detail >= 0.8, scale 0.7-1.4,
anisotropy <= 1.4) and ``v4`` (the module's own cuts). Counts are dup / unsure / diff accepted;
census pairs count as accepted when the grid or the rule accepts them. Also: why the census
duplicates that both checks reject are rejected.

    python benchmarks/dedup_refine_rules.py /tmp/w17/data/cifar10 \\
        benchmarks/results/dedup_census_labels.csv benchmarks/results/dedup_refined_labels.csv
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from dpscale.data.dataset import IngestedDataset
from dpscale.dedup import refine, verify

LABELS = ("dup", "unsure", "diff")


def _v2(r: refine.Refined) -> np.ndarray:
    return ((r.ecc_distance <= 0.04) & (r.detail_distance <= 0.2) & (r.anisotropy <= 1.4)
            & (r.scale >= 0.7) & (r.scale <= 1.4))


RULES: dict[str, Callable[[refine.Refined], np.ndarray]] = {
    "v2": _v2, "v4": lambda r: r.accepted}


def counts(accepted: np.ndarray, labels: np.ndarray) -> dict[str, int]:
    return {label: int((accepted & (labels == label)).sum()) for label in LABELS}


def _pick(r0: refine.Refined, r1: refine.Refined, use1: np.ndarray) -> refine.Refined:
    """Per pair, r1's values where ``use1``, else r0's."""
    return refine.Refined(**{f.name: np.where(use1, getattr(r1, f.name), getattr(r0, f.name))
                             for f in dataclasses.fields(refine.Refined)})


def _subset(r: refine.Refined, mask: np.ndarray) -> refine.Refined:
    return refine.Refined(**{f.name: getattr(r, f.name)[mask] for f in dataclasses.fields(refine.Refined)})


def why_rejected(r: refine.Refined) -> Counter:
    """For pairs both checks reject: which of the v4 cuts each one fails."""
    lo, hi = refine.SCALE_RANGE
    out: Counter = Counter()
    for e, k, d, s, a in zip(r.ecc_distance, r.rank_distance, r.detail_distance, r.scale,
                             r.anisotropy):
        if not np.isfinite(e):
            out["ECC did not converge"] += 1
            continue
        parts = []
        if not lo <= s <= hi or a > refine.MAX_ANISOTROPY:
            parts.append("warp not a re-crop")
        if k > 1 - refine.MIN_RANK:
            parts.append("rank")
        if d > 1 - refine.MIN_DETAIL:
            parts.append("detail")
        out[" + ".join(parts)] += 1
    return out


def read_census_pairs(ds: IngestedDataset, path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The census labels' pairs: (train images, test images, labels)."""
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    pub = np.asarray(ds.get("train", np.array([int(r["train_index"]) for r in rows]))[0])
    priv = np.asarray(ds.get("test", np.array([int(r["test_index"]) for r in rows]))[0])
    return pub, priv, np.array([r["label"] for r in rows])


def read_judged_pairs(ds: IngestedDataset, path: str) -> tuple[list[dict], np.ndarray, np.ndarray, np.ndarray]:
    """The refined pairs judged from dedup's runs: (rows, public images, private images as stored,
    mirrored: the candidate view's mirror state)."""
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    pub = np.asarray(ds.get("train", np.array([int(x["public_index"]) for x in rows]))[0])
    priv = np.asarray(ds.get("test", np.array([int(x["private_index"]) for x in rows]))[0])
    return rows, pub, priv, np.array(["mirrored" in x["view"] for x in rows])


def better_mirror_state(pub: np.ndarray, priv: np.ndarray) -> tuple[np.ndarray, refine.Refined]:
    """The grid's fine distance (the smaller of the two mirror states) and the refinement in the
    mirror state ECC fits better: how census pairs are decided here."""
    off, on = np.zeros(len(pub), bool), np.ones(len(pub), bool)
    grid = np.minimum(verify.distances(pub, priv, off)[1], verify.distances(pub, priv, on)[1])
    r0, r1 = refine.refine(pub, priv, off), refine.refine(pub, priv, on)
    return grid, _pick(r0, r1, r1.ecc_distance < r0.ecc_distance)


def analyse(data: str, census_path: str, refined_path: str) -> dict:
    ds = IngestedDataset(data)
    pub, priv, labels = read_census_pairs(ds, census_path)
    grid, r = better_mirror_state(pub, priv)
    by_grid = grid <= verify.THRESHOLD
    out: dict = {"census": {"total": counts(np.ones(len(labels), bool), labels),
                            "grid": counts(by_grid, labels)}}
    for name, rule in RULES.items():
        out["census"][f"grid + {name}"] = counts(by_grid | rule(r), labels)
    missed = (labels == "dup") & ~by_grid & ~RULES["v4"](r)
    out["census"]["dup rejected by grid and v4"] = dict(why_rejected(_subset(r, missed)))

    judged, pub, priv, mirrored = read_judged_pairs(ds, refined_path)
    rj = refine.refine(pub, priv, mirrored)
    jl = np.array([x["label"] for x in judged])
    samples = np.array([x["sample"] for x in judged])
    groups = {"v1-v3 samples (design of v4)": ~np.char.startswith(samples, "v4"),
              "v4 samples": np.char.startswith(samples, "v4")}
    out["refined pairs"] = {}
    for group, member in groups.items():
        entry = {"total": counts(member, jl)}
        for name, rule in RULES.items():
            entry[name] = counts(member & rule(rj), jl)
        out["refined pairs"][group] = entry
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="ingested CIFAR-10 (train and test splits)")
    p.add_argument("census_labels")
    p.add_argument("refined_labels")
    args = p.parse_args(argv)
    print(json.dumps(analyse(args.data, args.census_labels, args.refined_labels), indent=1))


if __name__ == "__main__":
    main()
