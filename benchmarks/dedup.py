"""Measure ``dpscale dedup``: realistic planted copies, false positives, CIFAR-10 montages.

    dpscale ingest folder:/work/shared/data/cifar10-jpeg.tar.gz /tmp/cifar10
    python -m benchmarks.dedup planted /tmp/cifar10 /tmp/dedup-planted
    python -m benchmarks.dedup montages /tmp/cifar10 OUT_OF_A_CIFAR_RUN   # after `dpscale dedup`
    python -m benchmarks.dedup subset /tmp/cifar10 /tmp/cifar10-train5k 5000

``planted``: private = 1,000 random CIFAR-10 test images (seed 0); public = 10,000 random
train images + one copy of every private image per transform, each with its own random
parameters: the changes real near duplicates show (a re-crop shifted by 1-2 px, a 0.9-1.1
rescale, brightness/contrast/colour casts, JPEG, a mirror, an 80-95% crop, and two
combinations). Recall = copies removed and matched to their own source; false positives =
train images removed. CIFAR-10 holds real train/test near duplicates, so every "false
positive" is drawn (``dedup_planted_fp.png``) and judged by eye, not assumed false.
``montages``: 40 random removed pairs and the 40 removed + 40 rejected pairs closest to the
cut of a CIFAR-10 run, as PNGs under benchmarks/results/ (private | public, distance).
With ``--copy-model DIR`` (``dpscale train-copy-model``), ``planted`` runs dedup with the copy
decision too (its false-positive sheet: ``dedup_planted_fp_copy.png``); ``montages --copy-only``
draws only the copy decision's sheets of a run made with it: a random 40 of its pairs, the 40
accepted and the 40 rejected closest to its cut (``dedup_cifar_copy_*.png``, caption s = score).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time

import numpy as np
from PIL import Image, ImageDraw, ImageEnhance

from dpscale.data.dataset import IngestedDataset
from dpscale.dedup import refine
from dpscale.stages import dedup as stage
from dpscale.stages.ingest import IngestConfig
from dpscale.stages.ingest import run as ingest

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ONE_PROCESS = ("--direct_running_mode=in_memory",)


def shift(im: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A re-crop 1-2 px off: translate, the new border repeats the edge."""
    dx, dy = 0, 0
    while not (dx or dy):
        dx, dy = rng.integers(-2, 3, size=2)
    h, w = im.shape[:2]
    padded = np.pad(im, ((2, 2), (2, 2), (0, 0)), mode="edge")
    return padded[2 - dy : 2 - dy + h, 2 - dx : 2 - dx + w].copy()


def rescale(im: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Zoom by 0.9-1.1 (at least 3% off) about a point near the centre, bilinear."""
    s = rng.uniform(0.9, 1.1)
    s = s if abs(s - 1) >= 0.03 else 1 + 0.03 * (1 if s >= 1 else -1)
    h, w = im.shape[:2]
    cx, cy = rng.uniform(0.4, 0.6) * w + 8, rng.uniform(0.4, 0.6) * h + 8
    padded = np.pad(im, ((8, 8), (8, 8), (0, 0)), mode="edge")
    inv = 1 / s
    out = Image.fromarray(padded).transform(
        padded.shape[1::-1],
        Image.Transform.AFFINE,
        (inv, 0, cx * (1 - inv), 0, inv, cy * (1 - inv)),
        resample=Image.Resampling.BILINEAR,
    )
    return np.asarray(out)[8 : 8 + h, 8 : 8 + w].copy()


def colour(im: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Saturation 0.7-1.3, brightness x0.8-1.2 and +-15 levels, per-channel gain 0.9-1.1."""
    x = np.asarray(ImageEnhance.Color(Image.fromarray(im)).enhance(rng.uniform(0.7, 1.3)), np.float32)
    x = (x * rng.uniform(0.8, 1.2) + rng.uniform(-15, 15)) * rng.uniform(0.9, 1.1, size=3)
    return np.clip(np.round(x), 0, 255).astype(np.uint8)


def jpeg(im: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    buf = io.BytesIO()
    Image.fromarray(im).save(buf, format="JPEG", quality=int(rng.integers(50, 91)))
    return np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))


def mirror(im: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return im[:, ::-1].copy()


def crop(im: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Keep 80-95% of each side at a random position, bicubic back to full size."""
    h, w = im.shape[:2]
    s = rng.uniform(0.8, 0.95)
    cw, ch = int(round(w * s)), int(round(h * s))
    x, y = rng.integers(0, w - cw + 1), rng.integers(0, h - ch + 1)
    return np.asarray(Image.fromarray(im[y : y + ch, x : x + cw]).resize((w, h), Image.Resampling.BICUBIC))


TRANSFORMS = {
    "shift": shift,
    "rescale": rescale,
    "colour": colour,
    "jpeg": jpeg,
    "mirror": mirror,
    "crop": crop,
    "mirror+shift+colour+jpeg": lambda im, r: jpeg(colour(shift(mirror(im, r), r), r), r),
    "rescale+shift+colour+jpeg": lambda im, r: jpeg(colour(shift(rescale(im, r), r), r), r),
}


def _save(root: str, split: str, name: str, image: np.ndarray) -> None:
    os.makedirs(os.path.join(root, split, "c"), exist_ok=True)
    Image.fromarray(image).save(os.path.join(root, split, "c", name + ".png"))


def _caption(p: dict) -> str:
    """Grid pairs: d = fine distance; refined: r = 1 - rank correlation, t = 1 - detail correlation;
    copy decision (accepted or rejected): s = normalised copy score."""
    if p.get("decided_by") == "copy" or (p.get("copy_score") is not None and p["distance"] is None):
        return f"s={p['copy_score']:.3f}"
    if p.get("decided_by") == "refined":
        return f"r{p['refined_rank_distance']:.3f} t{p['refined_detail_distance']:.2f}"
    return "d=-" if p["distance"] is None else f"d={p['distance']:.3f}"


def refined_margin(p: dict) -> float:
    """How far inside ``dedup.refine``'s cuts a refined pair is (0: on a cut, 1: perfect)."""
    return min(
        1 - p["refined_rank_distance"] / (1 - refine.MIN_RANK),
        1 - p["refined_detail_distance"] / (1 - refine.MIN_DETAIL),
    )


def montage(
    pairs: list[dict], public: IngestedDataset, private: IngestedDataset, path: str, *, columns: int = 5, scale: int = 3
) -> None:
    """private | public side by side, captioned with the distance and view."""
    side = 32 * scale
    cw, ch = 2 * side + 4, side + 14
    rows = max(1, -(-len(pairs) // columns))
    sheet = Image.new("RGB", (columns * (cw + 10), rows * (ch + 6)), "white")
    draw = ImageDraw.Draw(sheet)
    for k, p in enumerate(pairs):
        r, c = divmod(k, columns)
        x0, y0 = c * (cw + 10), r * (ch + 6)
        (a,) = private.examples(p["private_split"], [p["private_index"]])
        (b,) = public.examples(p["public_split"], [p["public_index"]])
        for dx, im in ((0, a.image), (side + 4, b.image)):
            sheet.paste(Image.fromarray(im).resize((side, side), Image.Resampling.NEAREST), (x0 + dx, y0))
        view = p["view"].replace(" crop", "").replace("mirrored", "m")
        draw.text((x0, y0 + side + 1), f"{k}: {_caption(p)} {view}", fill="black")
    sheet.save(path)


def planted(
    data: str,
    work: str,
    *,
    copy_model: str | None = None,
    copy_cut: float | None = None,
    copy_local_weight: float | None = None,
) -> dict:
    ds = IngestedDataset(data)
    rng = np.random.default_rng(0)
    priv_idx = np.sort(rng.choice(ds.num_examples("test"), 1000, replace=False))
    pub_idx = np.sort(rng.choice(ds.num_examples("train"), 10_000, replace=False))
    private, _ = ds.get("test", priv_idx)
    public, _ = ds.get("train", pub_idx)
    src = os.path.join(work, "src")
    for i, im in enumerate(private):
        _save(os.path.join(src, "private"), "test", f"p{i:04d}", im)
    for j, im in enumerate(public):
        _save(os.path.join(src, "public"), "train", f"u{j:05d}", im)
    for t, fn in enumerate(TRANSFORMS.values()):
        trng = np.random.default_rng(100 + t)
        for i, im in enumerate(private):
            _save(os.path.join(src, "public"), "train", f"x{t}_{i:04d}", fn(im, trng))
    paths = {}
    for side in ("public", "private"):
        paths[side] = os.path.join(work, side)
        ingest(
            IngestConfig(f"folder:{os.path.join(src, side)}", paths[side], overwrite=True, pipeline_args=ONE_PROCESS)
        )
    start = time.time()
    copy = (
        {}
        if copy_model is None
        else {
            "copy_model": copy_model,
            **({} if copy_cut is None else {"copy_cut": copy_cut}),
            **({} if copy_local_weight is None else {"copy_local_weight": copy_local_weight}),
        }
    )
    res = stage.run(
        stage.DedupConfig(paths["public"], paths["private"], os.path.join(work, "out"), overwrite=True, **copy)
    )
    seconds = time.time() - start
    removed = res.report["removed"]
    names = list(TRANSFORMS)
    per = {n: [0, 0] for n in names}  # removed, matched to own source
    fps = []
    for p in removed:
        stem = os.path.basename(p["public_key"])[:-4]
        if stem.startswith("u"):
            fps.append(p)
            continue
        t, i = stem[1:].split("_")
        per[names[int(t)]][0] += 1
        per[names[int(t)]][1] += int(os.path.basename(p["private_key"])[1:5] == i)
    montage(
        fps[:60],
        IngestedDataset(paths["public"]),
        IngestedDataset(paths["private"]),
        os.path.join(RESULTS, "dedup_planted_fp_copy.png" if copy else "dedup_planted_fp.png"),
    )
    near = res.report["near_threshold_rejected"]
    missed = [p for p in near if not os.path.basename(p["public_key"]).startswith("u")]
    summary = {
        "seconds": round(seconds, 1),
        "per_transform": per,
        "recall": sum(v[1] for v in per.values()) / (1000 * len(names)),
        "unrelated_removed": len(fps),
        "unrelated_total": 10_000,
        "fp_pairs": [
            (p["public_key"], p["private_key"], p["decided_by"], p["distance"], p.get("copy_score")) for p in fps
        ],
        "removed_by_decision": {d: sum(p["decided_by"] == d for p in removed) for d in ("grid", "refined", "copy")},
        "planted_rejected_near_cut": len(missed),
        "private_expanded": res.report["num_private_expanded"],
        "candidates": res.report["num_candidate_pairs"],
        "verified": res.report["num_verified_pairs"],
    }
    print(json.dumps(summary, indent=1))
    return summary


def copy_montages(data: str, out: str) -> None:
    """The copy decision's pairs of a run made with ``--copy-model``, for judging by eye."""
    report = json.load(open(os.path.join(out, stage.REPORT)))
    ds = IngestedDataset(data)
    copied = [p for p in report["removed"] if p["decided_by"] == "copy"]
    if not copied:
        raise SystemExit(f"{out}: no pair was decided by the copy decision (run dedup with --copy-model)")
    rng = np.random.default_rng(7)  # its own seed: not a sample drawn before
    pick = [copied[i] for i in np.sort(rng.choice(len(copied), min(40, len(copied)), replace=False))]
    montage(pick, ds, ds, os.path.join(RESULTS, "dedup_cifar_copy_random40.png"))
    montage(
        sorted(copied, key=lambda p: p["copy_score"])[:40],
        ds,
        ds,
        os.path.join(RESULTS, "dedup_cifar_copy_closest_to_cut.png"),
    )
    montage(
        report["copy_decision"]["near_cut_rejected"][:40],
        ds,
        ds,
        os.path.join(RESULTS, "dedup_cifar_copy_rejected_closest_to_cut.png"),
    )
    print(f"copy decision: {len(copied)} public removed, {len({p['private_index'] for p in copied})} private images")


def montages(data: str, out: str) -> None:
    report = json.load(open(os.path.join(out, stage.REPORT)))
    ds = IngestedDataset(data)
    removed = report["removed"]
    rng = np.random.default_rng(0)
    pick = [removed[i] for i in np.sort(rng.choice(len(removed), min(40, len(removed)), replace=False))]
    montage(pick, ds, ds, os.path.join(RESULTS, "dedup_cifar_random40.png"))
    grid = [p for p in removed if p["decided_by"] == "grid"]
    closest = sorted(grid, key=lambda p: -p["distance"])[:40]
    montage(closest, ds, ds, os.path.join(RESULTS, "dedup_cifar_removed_closest_to_cut.png"))
    refined = [p for p in removed if p["decided_by"] == "refined"]
    if refined:  # the pairs only the second decision accepted: a random 40 and the 40 nearest its cuts
        rng = np.random.default_rng(1)  # its own seed: the sample that validated the cuts
        pick = [refined[i] for i in np.sort(rng.choice(len(refined), min(40, len(refined)), replace=False))]
        montage(pick, ds, ds, os.path.join(RESULTS, "dedup_cifar_refined_random40.png"))
        montage(
            sorted(refined, key=refined_margin)[:40],
            ds,
            ds,
            os.path.join(RESULTS, "dedup_cifar_refined_closest_to_cut.png"),
        )
    montage(
        report["near_threshold_rejected"][:40], ds, ds, os.path.join(RESULTS, "dedup_cifar_rejected_closest_to_cut.png")
    )
    print(
        f"removed {len(removed)} public, {report['num_private_matched']} private matched, "
        f"{report['num_candidate_pairs']} candidates"
    )


def subset(data: str, out: str, n: int) -> None:
    """The first ``n`` train images plus all of test, ingested again (for scaling runs)."""
    ds = IngestedDataset(data)
    src = out + "-src"
    idx = np.arange(n)
    for split, images in (("train", ds.get("train", idx)[0]), ("test", ds.split_images("test"))):
        for i, im in enumerate(images):
            _save(src, split, f"{i:05d}", im)
    ingest(IngestConfig(f"folder:{src}", out, overwrite=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["planted", "montages", "subset"])
    parser.add_argument("data")
    parser.add_argument("work")
    parser.add_argument("n", type=int, nargs="?", default=5000)
    parser.add_argument("--copy-model", default=None, help="planted: run dedup with this copy model too")
    parser.add_argument("--copy-cut", type=float, default=None, help="planted: with --copy-model")
    parser.add_argument("--copy-local-weight", type=float, default=None, help="planted: with --copy-model")
    parser.add_argument("--copy-only", action="store_true", help="montages: only the copy decision's sheets")
    a = parser.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    if (a.copy_cut is not None or a.copy_local_weight is not None) and a.copy_model is None:
        parser.error("--copy-cut and --copy-local-weight set the copy decision: give --copy-model too")
    if a.what == "planted":
        planted(a.data, a.work, copy_model=a.copy_model, copy_cut=a.copy_cut, copy_local_weight=a.copy_local_weight)
    elif a.what == "montages" and a.copy_only:
        copy_montages(a.data, a.work)
    elif a.what == "montages":
        montages(a.data, a.work)
    else:
        subset(a.data, a.work, a.n)


if __name__ == "__main__":
    main()
