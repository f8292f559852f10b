"""Measure ``dpscale dedup``: recall on planted copies, false positives, CIFAR-10 train vs test.

    dpscale ingest folder:/work/shared/data/cifar10-jpeg.tar.gz /tmp/cifar10
    python benchmarks/dedup.py planted /tmp/cifar10 /tmp/dedup-bench
    python benchmarks/dedup.py cifar /tmp/cifar10 /tmp/dedup-cifar --crop-scales ''

``planted``: private = 1,000 random CIFAR-10 test images; public = 10,000 random train
images + four copies of every private image (mirror; crop keeping 80-95% of each side
at a random position, rescaled back to 32x32 bicubic; JPEG quality 75; all three
together). Recall per transform = share of the copies removed; false-positive rate = share
of the 10,000 train images removed (some may be true CIFAR near duplicates of test
images: they are listed and drawn, not hidden). ``cifar``: all of train vs all of test
(``--crop-scales ''``: whole + mirror views only, which fits this 2-core machine).
Both write a PNG montage of removed pairs to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from PIL import Image

from dpscale.data.dataset import IngestedDataset
from dpscale.dedup.image_hash import HashConfig, jpeg_roundtrip
from dpscale.stages import dedup as stage
from dpscale.stages.ingest import IngestConfig
from dpscale.stages.ingest import run as ingest

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def crop_rescale(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    h, w = image.shape[:2]
    s = rng.uniform(0.8, 0.95)
    cw, ch = int(round(w * s)), int(round(h * s))
    x, y = rng.integers(0, w - cw + 1), rng.integers(0, h - ch + 1)
    crop = Image.fromarray(image[y:y + ch, x:x + cw])
    return np.asarray(crop.resize((w, h), Image.Resampling.BICUBIC))


TRANSFORMS = {
    "flip": lambda im, rng: im[:, ::-1].copy(),
    "crop": crop_rescale,
    "jpeg": lambda im, rng: jpeg_roundtrip(im, 75),
    "flip_crop_jpeg": lambda im, rng: jpeg_roundtrip(crop_rescale(im[:, ::-1], rng), 75),
}


def _save(root: str, split: str, cls: str, name: str, image: np.ndarray) -> None:
    os.makedirs(os.path.join(root, split, cls), exist_ok=True)
    Image.fromarray(image).save(os.path.join(root, split, cls, name + ".png"))


def montage(pairs: list[dict], public: IngestedDataset, private: IngestedDataset,
            path: str, *, columns: int = 4, scale: int = 3) -> None:
    """Side-by-side public | private pairs, ``columns`` pairs per row, upscaled."""
    tiles = []
    for p in pairs:
        (a,) = public.examples(p["public_split"], [p["public_index"]])
        (b,) = private.examples(p["private_split"], [p["private_index"]])
        gap = np.full((a.image.shape[0], 2, 3), 255, np.uint8)
        tiles.append(np.concatenate([a.image, gap, b.image], axis=1))
    if not tiles:
        return
    h, w, _ = tiles[0].shape
    rows = -(-len(tiles) // columns)
    sheet = np.full((rows * (h + 6), columns * (w + 10), 3), 255, np.uint8)
    for i, t in enumerate(tiles):
        r, c = divmod(i, columns)
        sheet[r * (h + 6):r * (h + 6) + h, c * (w + 10):c * (w + 10) + w] = t
    Image.fromarray(sheet).resize((sheet.shape[1] * scale, sheet.shape[0] * scale),
                                  Image.Resampling.NEAREST).save(path)


def planted(cifar: str, work: str, args: tuple[str, ...]) -> dict:
    ds = IngestedDataset(cifar)
    rng = np.random.default_rng(0)
    priv_idx = np.sort(rng.choice(ds.num_examples("test"), 1000, replace=False))
    pub_idx = np.sort(rng.choice(ds.num_examples("train"), 10_000, replace=False))
    names = ds.class_names
    if not os.path.exists(os.path.join(work, "public", "manifest.json")):
        for e in ds.examples("test", priv_idx):
            _save(os.path.join(work, "private_src"), "test", names[e.label],
                  e.key.replace("/", "_"), e.image)
            for kind, f in TRANSFORMS.items():
                _save(os.path.join(work, "public_src"), "train", names[e.label],
                      f"planted_{kind}_{e.key.replace('/', '_')}", f(e.image, rng))
        for e in ds.examples("train", pub_idx):
            _save(os.path.join(work, "public_src"), "train", names[e.label],
                  "orig_" + e.key.replace("/", "_"), e.image)
        for side in ("public", "private"):
            ingest(IngestConfig(f"folder:{os.path.join(work, side + '_src')}",
                                os.path.join(work, side), overwrite=True))
    start = time.perf_counter()
    result = stage.run(stage.DedupConfig(os.path.join(work, "public"),
                                         os.path.join(work, "private"),
                                         os.path.join(work, "out"), overwrite=True,
                                         pipeline_args=args))
    seconds = time.perf_counter() - start
    removed = result.report["removed"]
    for p in removed:  # "flip" must not count "flip_crop_jpeg": compare the whole kind
        name = p["public_key"].rsplit("/", 1)[1]
        p["kind"] = (next(k for k in sorted(TRANSFORMS, key=len, reverse=True)
                          if name.startswith(f"planted_{k}_")) if name.startswith("planted_")
                     else "unrelated")
    summary: dict = {"seconds": round(seconds, 1),
                     "num_candidate_pairs": result.report["num_candidate_pairs"]}
    for kind in TRANSFORMS:
        hits = [p for p in removed if p["kind"] == kind]
        right = [p for p in hits if p["public_key"].split(f"planted_{kind}_")[1]
                 == p["private_key"].rsplit("/", 1)[1]]
        summary[f"recall_{kind}"] = f"{len(hits)}/1000"
        summary[f"matched_to_own_source_{kind}"] = f"{len(right)}/{len(hits)}"
    unrelated = [p for p in removed if p["kind"] == "unrelated"]
    summary["false_positives"] = f"{len(unrelated)}/10000"
    summary["false_positive_pairs"] = [(p["public_key"], p["private_key"], p["distance"])
                                       for p in unrelated]
    distances = {kind: [p["distance"] for p in removed if p["kind"] == kind]
                 for kind in TRANSFORMS}
    # A public image goes iff its closest candidate is within the threshold, so one run
    # at the default threshold also gives every lower threshold.
    summary["recall_and_fp_by_threshold"] = {
        f"{t:g}": {"recall_all_transforms": round(sum(
            p["kind"] in TRANSFORMS and p["distance"] <= t for p in removed) / 4000, 4),
                     "false_positives": sum(p["kind"] == "unrelated" and p["distance"] <= t
                                            for p in removed)}
        for t in (0.1, 0.125, 0.15, 0.175, 0.2, 0.225, 0.25)}
    summary["distance_p50_p99"] = {k: [round(float(np.percentile(v, q)), 3) for q in (50, 99)]
                                   for k, v in distances.items() if v}
    pub, priv = IngestedDataset(os.path.join(work, "public")), IngestedDataset(
        os.path.join(work, "private"))
    montage(unrelated[:24], pub, priv, os.path.join(RESULTS, "dedup_planted_fp.png"))
    sample = [p for kind in TRANSFORMS for p in removed if p["kind"] == kind][::250][:16]
    montage(sample, pub, priv, os.path.join(RESULTS, "dedup_planted_hits.png"))
    return summary


def cifar_train_vs_test(cifar: str, work: str, args: tuple[str, ...], *,
                        crop_scales: tuple[float, ...]) -> dict:
    start = time.perf_counter()
    result = stage.run(stage.DedupConfig(cifar, cifar, os.path.join(work, "out"),
                                         public_splits=("train",), private_splits=("test",),
                                         crop_scales=crop_scales, overwrite=True,
                                         pipeline_args=args))
    seconds = time.perf_counter() - start
    removed = sorted(result.report["removed"], key=lambda p: p["distance"])
    ds = IngestedDataset(cifar)
    exact = sum(p["public_id"] == p["private_id"] for p in removed)
    montage(removed[::max(1, len(removed) // 32)][:32], ds, ds,
            os.path.join(RESULTS, "dedup_cifar_pairs.png"))
    closest = removed[-16:]  # the pairs nearest the threshold: the doubtful ones
    montage(closest, ds, ds, os.path.join(RESULTS, "dedup_cifar_pairs_near_threshold.png"))
    hist = np.histogram([p["distance"] for p in removed],
                        bins=[0, 0.001, 0.05, 0.1, 0.15, 0.2, 0.25])[0].tolist()
    return {"seconds": round(seconds, 1), "num_removed": len(removed),
            "num_candidate_pairs": result.report["num_candidate_pairs"],
            "identical_pixels": exact,
            "distinct_test_images_matched": len({p["private_index"] for p in removed}),
            "distance_histogram_[0,.001,.05,.1,.15,.2,.25]": hist,
            "first_pairs": [(p["public_key"], p["private_key"], p["distance"], p["view"])
                            for p in removed[:10]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=["planted", "cifar"])
    parser.add_argument("cifar", help="ingested CIFAR-10 (dpscale ingest folder:...tar.gz)")
    parser.add_argument("work", help="scratch directory")
    parser.add_argument("--crop-scales", default=None,
                        help="cifar only: private crop views ('' = whole + mirror)")
    parser.add_argument("beam_args", nargs="*", help="Beam options (after --)")
    a = parser.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    if a.what == "planted":
        out = planted(a.cifar, a.work, tuple(a.beam_args))
    else:
        scales = (HashConfig.crop_scales if a.crop_scales is None
                  else tuple(float(s) for s in a.crop_scales.split(",") if s))
        out = cifar_train_vs_test(a.cifar, a.work, tuple(a.beam_args), crop_scales=scales)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
