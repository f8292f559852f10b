"""Experiment: a learned copy-detection embedding for dedup, trained on the public images only.

Why: on the by-eye labels of the CIFAR-10 census (``dedup_census.py``) the pixel checks of
``dedup.verify`` and ``dedup.refine`` are saturated: a cross-validated classifier on every
aligned-pair feature tried accepts only a few more real duplicates at the same number of
look-alikes than the hand-set cuts (400 vs 392 of 490; ``benchmarks/results/dedup.md``). The duplicates they lose are copies
whose pixels changed: strong recolouring, re-sharpening, zooms the affine fit cannot follow.
A learned embedding can be taught those changes directly: a small CNN is trained so that an
image and its re-crops / rescalings / recolourings / blurs land close together while other
public images land apart (the contrastive NT-Xent loss of SimCLR, Chen et al. 2020, used for
copy detection as in SSCD, Pizzi et al. 2022). Trained on the *public* split only: nothing
private enters the model. Not part of ``dpscale dedup`` (yet): this script measures whether
it would help, on the same labels as everything else. Its outputs (counts, montages, label
sheets) describe the private (test) split without noise, like dedup's own report: a
diagnostic for benchmark data, not to be run on or published for data you must keep private.

    D=/tmp/s5/cifar10 L=benchmarks/results/dedup_census_labels.csv
    python benchmarks/dedup_copy_embedding.py train $D /tmp/s5/emb --epochs 12     # public split only
    python benchmarks/dedup_copy_embedding.py census $D /tmp/s5/emb $L \\
        benchmarks/results/dedup_refined_labels.csv
    python benchmarks/dedup_copy_embedding.py search $D /tmp/s5/emb $L --dedup-report R \\
        --threshold 0.9 --montage-dir benchmarks/results
    python benchmarks/dedup_copy_embedding.py margin $D /tmp/s5/emb $L --dedup-report R \\
        --montage-dir benchmarks/results --pick 10:0.5:8

``census``: the census pairs' cosine (better mirror state) against their labels, alone and
as a third check beside the grid and refinement. ``search``: every test image's nearest train
image by the embedding (both mirror states, all 50,000), how many of the census duplicates that
finds at each threshold, alone and added to a ``dpscale dedup`` report; the same for the nearest
image used only as an extra candidate that dedup's pixel checks then decide; and montages of a
seeded random 40 of the test images each adds to dedup's matches, for judging by eye.
``margin``: the cosine normalised by how crowded each end's public neighbourhood is
(``normalised``), against the raw cosine at equal look-alike cost on the census labels (also held
out: cut on the even ranks, counted on the odd), then over all pairs; ``--pick k:beta:allowance``
draws that setting's additions to dedup for judging by eye. ``views`` (dpscale copy models only):
1.33x crop views of either end scored beside the whole image, for strong zooms. ``mutual``: a
bonus for mutual nearest neighbours, and the copy score's recall over all pairs at a range of
cuts (``--lower-cut high:low`` draws what lowering the cut adds). ``local`` (dpscale copy models
only): the local agreement of ``dedup.local_match`` added to the copy score at a range of
weights, at equal look-alike cost on the census labels and over all pairs, and the picked
weight's recall at a range of cuts: what ``dpscale dedup --copy-local-weight`` decides.
"""

from __future__ import annotations

import argparse
import dataclasses
import csv
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpscale.benchmarks.dedup_census import census, dedup_matched, montage, nearest, read_labels
from dpscale.benchmarks.dedup_refine_rules import (LABELS, better_mirror_state, counts,
                                                   read_census_pairs, read_judged_pairs)
from dpscale.dedup.copy_score import local_background, normalised, top_k, with_local_agreement

THRESHOLDS = (0.8, 0.85, 0.9, 0.92, 0.94, 0.96)


# ---------------------------------------------------------------- model and training (torch)

def augment(x, generator):
    """A batch of copy-like edits of float images in [0, 1] (n, 3, H, W): re-crop to 55-100% of a
    side with aspect 0.74-1.35 and rescale back, per-channel gains, contrast, brightness,
    saturation (10% grey), gamma, blur or sharpen, noise. The realistic copy edits of
    ``benchmarks/dedup.py``'s planted set, made stronger; no mirroring (dedup compares both
    mirror states itself)."""
    import torch
    import torch.nn.functional as F

    n = x.shape[0]

    def u(lo, hi, *shape):
        return torch.empty(n, *shape).uniform_(lo, hi, generator=generator)

    side, aspect = u(0.55, 1.0), torch.exp(u(-0.3, 0.3))
    sx, sy = (side * aspect.sqrt()).clamp(max=1.0), (side / aspect.sqrt()).clamp(max=1.0)
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0], theta[:, 1, 1] = sx, sy
    theta[:, 0, 2], theta[:, 1, 2] = (1 - sx) * u(-1, 1), (1 - sy) * u(-1, 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    x = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    x = x * u(0.8, 1.2, 3, 1, 1)
    mean = x.mean((1, 2, 3), keepdim=True)
    x = (x - mean) * u(0.6, 1.4, 1, 1, 1) + mean * u(0.7, 1.3, 1, 1, 1)
    grey = x.mean(1, keepdim=True)
    saturation = u(0.3, 1.5, 1, 1, 1)
    saturation[torch.rand(n, generator=generator) < 0.1] = 0.0
    x = (grey + (x - grey) * saturation).clamp(0, 1) ** torch.exp(u(-0.4, 0.4, 1, 1, 1))
    k = torch.tensor([1.0, 2.0, 1.0])
    k = (k[:, None] * k[None]) / 16
    blurred = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), k.expand(3, 1, 3, 3), groups=3)
    x = x + u(-0.8, 1.0, 1, 1, 1) * (blurred - x)  # < 0: sharpen, > 0: blur
    x = x + torch.randn(x.shape, generator=generator) * u(0.0, 0.03, 1, 1, 1)
    return x.clamp(0, 1)


def build(width: int = 32, dim: int = 128):
    """Five 3x3 conv blocks (GroupNorm, ReLU; two stride-2), a 2x2 average pool that keeps the
    coarse layout (a copy shares it, a look-alike often does not), a linear head, L2 norm."""
    import torch.nn.functional as F
    from torch import nn

    def block(i, o, stride):
        return nn.Sequential(nn.Conv2d(i, o, 3, stride, 1, bias=False), nn.GroupNorm(8, o), nn.ReLU())

    class CopyEmbedding(nn.Module):
        def __init__(self):
            super().__init__()
            w = width
            self.features = nn.Sequential(block(3, w, 1), block(w, 2 * w, 2), block(2 * w, 2 * w, 1),
                                          block(2 * w, 4 * w, 2), block(4 * w, 4 * w, 1))
            self.head = nn.Linear(4 * w * 4, dim)

        def forward(self, x):
            h = F.adaptive_avg_pool2d(self.features((x - 0.5) / 0.25), 2).flatten(1)
            return F.normalize(self.head(h), dim=1)

    return CopyEmbedding()


def nt_xent(z1, z2, temperature: float = 0.07):
    """SimCLR's loss: each view must pick its partner among the 2n - 1 other views of the batch."""
    import torch
    import torch.nn.functional as F

    n = z1.shape[0]
    z = torch.cat([z1, z2])
    sim = z @ z.T / temperature
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    target = torch.cat([torch.arange(n) + n, torch.arange(n)])
    return F.cross_entropy(sim, target)


def koleo(z, eps: float = 1e-8):
    """The Kozachenko-Leonenko entropy estimate's loss: minus the mean log distance of each
    embedding to its nearest other in the batch. Why: it spreads the public images over the
    sphere, so look-alikes (one scene, one pose) sit further apart; SSCD (Pizzi et al. 2022)
    found this regulariser the largest single gain for copy detection."""
    import torch

    d = torch.cdist(z, z).masked_fill(torch.eye(len(z), dtype=torch.bool), float("inf"))
    return -torch.log(d.min(1).values + eps).mean()


def _as_float(images: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255.0


def train(images: np.ndarray, out: str, *, epochs: int, batch: int = 256, lr: float = 2e-3,
          seed: int = 0, koleo_weight: float = 0.0, log_every: int = 50) -> dict:
    """Train on ``images`` (uint8 [n, 32, 32, 3], the public split); writes weights.pt + train.json.
    ``koleo_weight`` > 0 adds ``koleo`` of both views' embeddings to the loss."""
    import torch

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    x = _as_float(images)
    net = build()
    opt = torch.optim.AdamW(net.parameters(), lr, weight_decay=1e-4)
    per_epoch = len(x) // batch
    if per_epoch == 0:
        raise ValueError(f"{len(x)} images < one batch of {batch}")
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=epochs * per_epoch)
    start, losses = time.time(), []
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for step in range(per_epoch):
            xb = x[order[step * batch:(step + 1) * batch]]
            z1, z2 = net(augment(xb, generator)), net(augment(xb, generator))
            loss = nt_xent(z1, z2)
            if koleo_weight:
                loss = loss + koleo_weight * 0.5 * (koleo(z1) + koleo(z2))
            opt.zero_grad()
            loss.backward()
            opt.step()
            schedule.step()
            losses.append(loss.item())
            if len(losses) % log_every == 0:
                print(f"epoch {epoch} step {len(losses)}: loss {np.mean(losses[-log_every:]):.3f}, "
                      f"{time.time() - start:.0f} s", flush=True)
    os.makedirs(out, exist_ok=True)
    torch.save(net.state_dict(), os.path.join(out, "weights.pt"))
    info = {"images": len(x), "epochs": epochs, "batch": batch, "lr": lr, "seed": seed,
            "koleo_weight": koleo_weight,
            "seconds": round(time.time() - start, 1), "final_loss": float(np.mean(losses[-log_every:]))}
    with open(os.path.join(out, "train.json"), "w") as handle:
        json.dump(info, handle, indent=1)
    return info


def load(out: str):
    import torch

    net = build()
    net.load_state_dict(torch.load(os.path.join(out, "weights.pt")))
    return net.eval()


def embed(net, images: np.ndarray, *, batch: int = 1000) -> np.ndarray:
    import torch

    with torch.no_grad():
        return np.concatenate([net(_as_float(images[i:i + batch])).numpy()
                               for i in range(0, len(images), batch)]) if len(images) else np.zeros((0, 128))


def embeddings(out: str, public: np.ndarray, private: np.ndarray) -> tuple[np.ndarray, ...]:
    """Both sides in both mirror states, from this script's torch model or, if ``out`` holds
    one, from dpscale's own JAX copy model (``dpscale train-copy-model``). Several models,
    comma-separated: their ensemble, whose cosine is the mean of the models' cosines (each
    model's unit embeddings side by side, divided by the square root of their number)."""
    from dpscale.dedup import copy_model

    if "," in out:
        parts = [embeddings(one, public, private) for one in out.split(",")]
        return tuple(np.concatenate(side, axis=1) / np.sqrt(len(parts)) for side in zip(*parts))
    if os.path.isfile(os.path.join(out, copy_model.WEIGHTS)):
        params = copy_model.load(out).params
        return tuple(copy_model.embed(params, x, mirrored=m) for x in (public, private) for m in (False, True))
    net = load(out)
    return tuple(embed(net, x[:, :, ::-1] if m else x) for x in (public, private) for m in (False, True))


# ---------------------------------------------------------------- measurements

def pair_cosine(net, public: np.ndarray, private: np.ndarray) -> np.ndarray:
    """Per pair, the better of the two mirror states of the private image."""
    p = embed(net, public)
    return np.maximum((p * embed(net, private)).sum(1), (p * embed(net, private[:, :, ::-1])).sum(1))


def census_table(data: str, out: str, census_path: str, refined_path: str) -> dict:
    from dpscale.data.dataset import IngestedDataset
    from dpscale.dedup import verify

    ds = IngestedDataset(data)
    net = load(out)
    pub, priv, labels = read_census_pairs(ds, census_path)
    cos = pair_cosine(net, pub, priv)
    grid, refined_state = better_mirror_state(pub, priv)
    pixel = (grid <= verify.THRESHOLD) | refined_state.accepted
    table = {"total": counts(np.ones(len(labels), bool), labels), "grid + refine": counts(pixel, labels)}
    for t in THRESHOLDS:
        table[f"cosine >= {t}"] = counts(cos >= t, labels)
        table[f"grid + refine + cosine >= {t}"] = counts(pixel | (cos >= t), labels)
    for label in sorted(set(labels), key=LABELS.index):
        table[f"cosine percentiles 5/25/50/75/95, {label}"] = [
            round(float(v), 3) for v in np.percentile(cos[labels == label], [5, 25, 50, 75, 95])]

    judged, pub, priv, mirrored = read_judged_pairs(ds, refined_path)
    priv = np.where(mirrored[:, None, None, None], priv[:, :, ::-1], priv)
    jl = np.array([x["label"] for x in judged])
    jcos = (embed(net, pub) * embed(net, priv)).sum(1)
    refined = {"total": counts(np.ones(len(jl), bool), jl)}
    for t in THRESHOLDS:
        refined[f"cosine >= {t}"] = counts(jcos >= t, jl)
    return {"census pairs": table, "refined pairs judged from dedup runs (candidate view)": refined}


def recall_table(best: np.ndarray, block_dup: set[int], dedup: set[int] | None) -> dict:
    """Census block duplicates found at each threshold (a test image counts when it has *a*
    train image at or above it), alone and added to dedup's matches."""
    out: dict = {"census block duplicates": len(block_dup)}
    if dedup is not None:
        out["dedup"] = {"matched": len(dedup), "block duplicates found": len(block_dup & dedup)}
    for t in THRESHOLDS:
        hit = set(np.flatnonzero(best >= t).tolist())
        row = {"matched": len(hit), "block duplicates found": len(block_dup & hit)}
        if dedup is not None:
            both = hit | dedup
            row.update({"added to dedup": len(hit - dedup), "with dedup: matched": len(both),
                        "with dedup: block duplicates found": len(block_dup & both)})
        out[f"cosine >= {t}"] = row
    return out


def search(data: str, out: str, census_path: str, *, report: str | None, threshold: float,
           montage_dir: str | None, seed: int = 0) -> dict:
    from dpscale.data.dataset import IngestedDataset

    ds = IngestedDataset(data)
    net = load(out)
    train_images = ds.split_images("train")
    test_images = ds.split_images("test")
    start = time.time()
    e_train = embed(net, train_images)
    e_test, e_mirror = embed(net, test_images), embed(net, test_images[:, :, ::-1])
    best, index, mirrored = nearest(e_test, e_mirror, e_train)
    seconds = time.time() - start
    with open(census_path) as handle:
        block_dup = {int(r["test_index"]) for r in csv.DictReader(handle)
                     if int(r["rank"]) < 1000 and r["label"] == "dup"}
    dedup = None if report is None else dedup_matched(report)
    result = {"embed and search seconds": round(seconds, 1), **recall_table(best, block_dup, dedup)}
    # The embedding as a candidate source only: its nearest train image, decided by dedup's own
    # pixel checks (grid, then refinement) in the mirror state the embedding chose.
    verified = pixel_checks(ds, index, np.arange(len(test_images)), mirrored)
    found = set(np.flatnonzero(verified).tolist())
    row = {"matched": len(found), "block duplicates found": len(block_dup & found)}
    if dedup is not None:
        row.update({"added to dedup": len(found - dedup), "with dedup: matched": len(found | dedup),
                    "with dedup: block duplicates found": len(block_dup & (found | dedup))})
    result["nearest by cosine, verified by grid + refine"] = row
    if montage_dir is not None and dedup is not None:
        sheets = {f"added_{threshold}": set(np.flatnonzero(best >= threshold).tolist()) - dedup,
                  "verified_added": found - dedup}
        result["montages"] = {}
        for name, members in sheets.items():
            added = np.array(sorted(members), np.int64)
            path = os.path.join(montage_dir, f"dedup_copy_embedding_{name}.png")
            drawn = draw_sheet(data, path, added, index, best, mirrored, seed=seed, score_name="cosine")
            result["montages"][path] = {"added": len(added), "drawn": drawn}
    return result


def census_columns(census_path: str) -> tuple[list[dict], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The census labels as rows and as columns: test index, train index, label, even rank."""
    rows = read_labels(census_path)
    return (rows, np.array([r["test_index"] for r in rows]), np.array([r["train_index"] for r in rows]),
            np.array([r["label"] for r in rows]), np.array([r["rank"] % 2 == 0 for r in rows]))


def census_pair_cosine(private: np.ndarray, private_mirrored: np.ndarray, public: np.ndarray,
                       private_index: np.ndarray, public_index: np.ndarray) -> np.ndarray:
    """Cosine of each (private, public) pair of unit embeddings, the better of the private image's
    two mirror states."""
    pub = public[public_index]
    return np.maximum((pub * private[private_index]).sum(1), (pub * private_mirrored[private_index]).sum(1))


def pixel_accepted(dataset, census_path: str) -> np.ndarray:
    """Per census pair: does dedup's pixel decision (grid, then refinement) accept it?"""
    from dpscale.dedup import verify

    pub, priv, _ = read_census_pairs(dataset, census_path)
    grid, refined_state = better_mirror_state(pub, priv)
    return (grid <= verify.THRESHOLD) | refined_state.accepted


def best_allowed(score: np.ndarray, labels: np.ndarray, already: np.ndarray, allowance: int) -> tuple[float, dict]:
    """The lowest cut on ``score`` that adds at most ``allowance`` ``diff`` pairs to those
    ``already`` accepted, and the union's counts at that cut: the comparison of two scores at
    the same look-alike cost. The cut sits ``CUT_MARGIN`` above the first look-alike left out,
    so that the same pair scored by another float32 summation order (``margin`` scores all
    pairs by matrix products) stays out too. A pair scored ``-inf`` is never accepted (a pair
    the scored decision cannot reach)."""
    candidates = ~already & np.isfinite(score)
    diff_scores = np.sort(score[candidates & (labels == "diff")])[::-1]
    cut = float(diff_scores[allowance]) + CUT_MARGIN if allowance < len(diff_scores) else -np.inf
    return cut, counts(already | (candidates & (score >= cut)), labels)


def census_row(score: np.ndarray, labels: np.ndarray, pixel: np.ndarray, even: np.ndarray,
               allowance: int) -> tuple[float, dict]:
    """``best_allowed``'s cut and counts, and held out: the cut set on the even ranks (half the
    allowance), counted on the odd."""
    cut, union = best_allowed(score, labels, pixel, allowance)
    even_cut, _ = best_allowed(score[even], labels[even], pixel[even], allowance // 2)
    odd = counts(pixel[~even] | (np.isfinite(score[~even]) & (score[~even] >= even_cut)), labels[~even])
    return cut, {"cut": round(cut, 4), **union, "odd ranks at the even ranks' cut": odd}


def draw_sheet(data: str, path: str, added: np.ndarray, index: np.ndarray, score: np.ndarray,
               mirrored: np.ndarray, *, seed: int, score_name: str = "score") -> int:
    """A seeded random 40 of the test images ``added`` with the train image ``index`` names, as a
    montage at ``path`` and a label sheet beside it; how many were drawn."""
    drawn = np.sort(np.random.default_rng(seed).choice(added, min(40, len(added)), replace=False))
    montage(data, [{"rank": i, "test_index": int(t), "train_index": int(index[t]), "similarity": float(score[t]),
                    "mirrored": bool(mirrored[t])} for i, t in enumerate(drawn)], path)
    write_label_sheet(path.replace(".png", ".csv"),
                      [(int(t), int(index[t]), float(score[t]), bool(mirrored[t])) for t in drawn],
                      score_name=score_name)
    return len(drawn)


CUT_MARGIN = 1e-5
MARGIN_KS = (5, 10, 20)
MARGIN_BETAS = (0.0, 0.5, 1.0)
ALLOWANCES = (0, 4, 8, 16, 32)


def margin(data: str, out: str, census_path: str, *, report: str | None, montage_dir: str | None,
           pick: tuple[int, float, int] | None, judged_until: int = 1000, strata: Sequence[int] = (3000,),
           seed: int = 0) -> dict:
    """Background-normalised cosines (``normalised``) against the census labels, at equal
    look-alike cost, then over all 50,000 x 10,000 pairs: added to dedup's matches. Each census
    row also gives the odd ranks' counts at the cut set on the even ranks alone (with half the
    allowance): a comparison not judged on the labels that set its cut. With ``pick`` and a
    report, the picked setting added to dedup's matches is also counted like ``dedup_census.py
    count`` (ranks < ``judged_until`` judged, the tail sampled in ``strata``): recall including
    the tail samples."""
    from dpscale.data.dataset import IngestedDataset

    ds = IngestedDataset(data)
    train_images = ds.split_images("train")
    test_images = ds.split_images("test")
    start = time.time()
    e_train, e_train_m, e_test, e_test_m = embeddings(out, train_images, test_images)
    k_max = max(MARGIN_KS)
    test_sims, test_index, test_mirrored = top_k(e_test, e_test_m, e_train, k=k_max)
    train_sims, _, _ = top_k(e_train, e_train_m, e_train, k=k_max, exclude_self=True)
    seconds = time.time() - start

    rows, c_test, c_train, labels, even = census_columns(census_path)
    block_dup = {r["test_index"] for r in rows if r["rank"] < judged_until and r["label"] == "dup"}
    pixel = pixel_accepted(ds, census_path)
    c_cos = census_pair_cosine(e_test, e_test_m, e_train, c_test, c_train)
    dedup = None if report is None else dedup_matched(report)

    result: dict = {"embed and search seconds": round(seconds, 1),
                    "census pairs": {"total": counts(np.ones(len(labels), bool), labels),
                                     "grid + refine": counts(pixel, labels)},
                    "all pairs": {}}
    chosen = None
    for k in MARGIN_KS:
        for beta in MARGIN_BETAS:
            if beta == 0.0 and k != MARGIN_KS[0]:
                continue  # the raw cosine does not depend on k
            name = "cosine" if beta == 0.0 else f"k={k} beta={beta}"
            c_score = normalised(c_cos, test_sims[c_test, k - 1], train_sims[c_train, k - 1], beta)
            # per test image: its best-scoring candidate among its k_max nearest by cosine
            all_score = normalised(test_sims, test_sims[:, k - 1:k], train_sims[test_index, k - 1], beta)
            best_col = all_score.argmax(1)
            rows_ = np.arange(len(all_score))
            best = all_score[rows_, best_col]
            census_rows, all_rows = {}, {}
            for allowance in ALLOWANCES:
                cut, census_rows[f"+{allowance} diff"] = census_row(c_score, labels, pixel, even, allowance)
                hit = set(np.flatnonzero(best >= cut).tolist())
                row = {"cut": round(cut, 4), "matched": len(hit), "block duplicates found": len(block_dup & hit)}
                if dedup is not None:
                    row.update({"added to dedup": len(hit - dedup),
                                "with dedup: block duplicates found": len(block_dup & (hit | dedup))})
                all_rows[f"+{allowance} diff"] = row
                if pick == (k, beta, allowance) or (beta == 0.0 and pick == (0, 0.0, allowance)):
                    chosen = (name, allowance, hit, test_index[rows_, best_col], best,
                              test_mirrored[rows_, best_col])
            result["census pairs"][name] = census_rows
            result["all pairs"][name] = all_rows
    if pick is not None and chosen is None:
        raise SystemExit(f"--pick {pick}: no such score (k in {MARGIN_KS} or 0 for the raw cosine, "
                         f"beta in {MARGIN_BETAS}, allowance in {ALLOWANCES})")
    if dedup is None or chosen is None:
        return result
    name, allowance, hit, index, best, mirrored = chosen
    counted = census(rows, judged_until=judged_until, total=len(test_images), strata=strata,
                     matched=hit | dedup)["dedup"]
    result["picked, with dedup, counted with the tail samples"] = {
        key: counted[key] for key in ("matched", "clear_found", "recall_on_clear", "tail_dups_sampled",
                                      "tail_dups_found", "recall_with_tail_estimate")}
    if montage_dir is not None:
        added = np.array(sorted(hit - dedup), np.int64)
        tag = name.replace(" ", "_").replace("=", "")
        path = os.path.join(montage_dir, f"dedup_copy_embedding_margin_{tag}_{allowance}.png")
        result["montage"] = {path: {"added": len(added),
                                    "drawn": draw_sheet(data, path, added, index, best, mirrored, seed=seed)}}
    return result


TAIL_KEYS = ("clear_found", "recall_on_clear", "tail_dups_found", "recall_with_tail_estimate")


def tail_counted(rows: Sequence[dict], *, judged_until: int, total: int, strata: Sequence[int],
                 matched: set[int]) -> dict:
    """``dedup_census.census``'s recall of ``matched`` (zeros when nothing is matched)."""
    counted = census(rows, judged_until=judged_until, total=total, strata=strata, matched=matched).get("dedup")
    return {key: (counted[key] if counted else 0) for key in TAIL_KEYS}



def all_pairs_row(best: np.ndarray, cut: float, *, rows: Sequence[dict], dedup: set[int] | None,
                  judged_until: int, strata: Sequence[int]) -> tuple[set[int], dict]:
    """The test images whose best score reaches ``cut``, and their row: how many, and with a
    dedup report, how many they add to its matches and the recall of both (``tail_counted``)."""
    hit = set(np.flatnonzero(best >= cut).tolist())
    row = {"cut": round(cut, 4), "matched": len(hit)}
    if dedup is not None:
        row.update({"added to dedup": len(hit - dedup), **tail_counted(
            rows, judged_until=judged_until, total=len(best), strata=strata, matched=hit | dedup)})
    return hit, row

CROP = 24  # px of a 32-px image: a view zoomed 1.33x, the middle of the tail misses' 1.2-1.6x
CROP_AT = ((4, 4), (0, 0), (0, 8), (8, 0), (8, 8))  # (top, left): the centre and the four corners
VIEW_SCORES = ("whole", "private crops", "public crops", "both")


def crop_view(images: np.ndarray, at: tuple[int, int]) -> np.ndarray:
    """The CROP x CROP window at ``at`` of each 32-px image, resized back to 32 px."""
    from dpscale.dedup import copy_model

    top, left = at
    return copy_model.thumbnails(np.ascontiguousarray(images[:, top:top + CROP, left:left + CROP]))


def views(data: str, out: str, census_path: str, *, report: str | None, k: int = 10, beta: float = 0.5,
          candidates: int = 20, judged_until: int = 1000, strata: Sequence[int] = (3000,),
          montage_dir: str | None = None, pick: int | None = None, seed: int = 0,
          census_only: bool = False) -> dict:
    """Zoomed views beside the whole image: does scoring crops of either end find the strong
    zooms (1.2-1.6x) the whole-image score misses, at the same look-alike cost? Each end's crop
    views (``CROP_AT``) are embedded with dpscale's JAX copy model in ``out``; a view's background
    is its k-th nearest public *whole* image (a public view's own image left out), so every
    score is ``normalised`` like the copy decision's. A pair's score is the best over: whole vs
    whole, a private crop vs the public whole image, the private whole image vs a public crop.
    Cuts are set on the census labels at equal look-alike cost (``best_allowed``, also held out),
    then applied over all pairs (each private view's ``candidates`` nearest public images or
    public crops) and counted with the census tail; ``census_only``: the census pairs alone
    (minutes instead of a quarter of an hour), no all-pairs rows."""
    from dpscale.data.dataset import IngestedDataset
    from dpscale.dedup import copy_model

    ds = IngestedDataset(data)
    params = copy_model.load(out).params
    train_images = ds.split_images("train")
    test_images = ds.split_images("test")
    start = time.time()

    def both_states(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return copy_model.embed(params, images), copy_model.embed(params, images, mirrored=True)

    rows, ci, cj, labels, even = census_columns(census_path)
    tr_w, tr_wm = both_states(train_images)
    te_w, te_wm = both_states(test_images)
    # crop views of every image, or with ``census_only`` of the census pairs' images alone (the
    # other rows stay zero and are never read)
    need_tr = np.arange(len(train_images)) if not census_only else np.unique(cj)
    need_te = np.arange(len(test_images)) if not census_only else np.unique(ci)

    def crop_states(images: np.ndarray, need: np.ndarray, at: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        plain, mirrored = np.zeros((2, len(images), tr_w.shape[1]), np.float32)
        plain[need], mirrored[need] = both_states(crop_view(images[need], at))
        return plain, mirrored

    tr_c = [crop_states(train_images, need_tr, at) for at in CROP_AT]
    te_c = [crop_states(test_images, need_te, at) for at in CROP_AT]
    embed_seconds = time.time() - start

    def kth(queries: tuple[np.ndarray, np.ndarray], need: np.ndarray, exclude_self: bool = False) -> np.ndarray:
        """Each needed row's k-th nearest public whole image (its own public image left out with
        ``exclude_self``: row j of a public view is train image j)."""
        out = np.zeros(len(queries[0]), np.float32)
        sims, index, _ = top_k(queries[0][need], queries[1][need], tr_w, k=k + 1)
        keep = index != need[:, None] if exclude_self else np.ones(index.shape, bool)
        col = np.argmax((np.cumsum(keep, 1) == k) & keep, axis=1)
        out[need] = sims[np.arange(len(need)), col]
        return out

    bg_tr_w, bg_te_w = kth((tr_w, tr_wm), need_tr, exclude_self=True), kth((te_w, te_wm), need_te)
    bg_tr_c = [kth(v, need_tr, exclude_self=True) for v in tr_c]
    bg_te_c = [kth(v, need_te) for v in te_c]

    # census pairs: every combination's score, then the best over each family of views

    def pair_cos(q: tuple[np.ndarray, np.ndarray], p: np.ndarray) -> np.ndarray:
        return census_pair_cosine(q[0], q[1], p, ci, cj)

    whole = normalised(pair_cos((te_w, te_wm), tr_w), bg_te_w[ci], bg_tr_w[cj], beta)
    priv = np.max([normalised(pair_cos(v, tr_w), b[ci], bg_tr_w[cj], beta) for v, b in zip(te_c, bg_te_c)], 0)
    pub = np.max([normalised(pair_cos((te_w, te_wm), v[0]), bg_te_w[ci], b[cj], beta)
                  for v, b in zip(tr_c, bg_tr_c)], 0)
    census_scores = {"whole": whole, "private crops": np.maximum(whole, priv),
                     "public crops": np.maximum(whole, pub), "both": np.maximum(whole, np.maximum(priv, pub))}

    # all pairs: per private image, the best score of each family and the public image it names
    n = len(test_images)
    best = {name: np.full(n, -np.inf, np.float32) for name in VIEW_SCORES}
    best_j = {name: np.zeros(n, np.int64) for name in VIEW_SCORES}
    best_m = {name: np.zeros(n, bool) for name in VIEW_SCORES}

    def consider(names: Sequence[str], queries: tuple[np.ndarray, np.ndarray], reference: np.ndarray,
                 q_bg: np.ndarray, p_bg: np.ndarray) -> None:
        sims, index, mirrored = top_k(*queries, reference, k=candidates)
        score = normalised(sims, q_bg[:, None], p_bg[index], beta)
        col = score.argmax(1)
        r = np.arange(n)
        s, j, m = score[r, col], index[r, col], mirrored[r, col]
        for name in names:
            better = s > best[name]
            best[name][better], best_j[name][better], best_m[name][better] = s[better], j[better], m[better]

    if not census_only:
        consider(VIEW_SCORES, (te_w, te_wm), tr_w, bg_te_w, bg_tr_w)
        for v, b in zip(te_c, bg_te_c):
            consider(("private crops", "both"), v, tr_w, b, bg_tr_w)
        for v, b in zip(tr_c, bg_tr_c):
            consider(("public crops", "both"), (te_w, te_wm), v[0], bg_te_w, b)
    seconds = time.time() - start

    pixel = pixel_accepted(ds, census_path)
    dedup = None if report is None else dedup_matched(report)
    result: dict = {"embed seconds": round(embed_seconds, 1), "embed, background and search seconds": round(seconds, 1),
                    "k": k, "beta": beta, "census pairs": {"total": counts(np.ones(len(labels), bool), labels),
                                                           "grid + refine": counts(pixel, labels)},
                    "all pairs": {}}
    for name in VIEW_SCORES:
        c_rows, a_rows = {}, {}
        for allowance in ALLOWANCES:
            cut, c_rows[f"+{allowance} diff"] = census_row(census_scores[name], labels, pixel, even, allowance)
            if census_only:
                continue
            hit, a_rows[f"+{allowance} diff"] = all_pairs_row(best[name], cut, rows=rows, dedup=dedup,
                                                              judged_until=judged_until, strata=strata)
            if montage_dir is not None and dedup is not None and allowance == pick and name == "both":
                whole_hit = set(np.flatnonzero(best["whole"] >= c_rows[f"+{allowance} diff"]["cut"]).tolist())
                added = np.array(sorted(hit - dedup - whole_hit), np.int64)  # what the views add
                path = os.path.join(montage_dir, f"dedup_copy_views_added_{allowance}.png")
                drawn = draw_sheet(data, path, added, best_j[name], best[name], best_m[name], seed=seed)
                result["montage"] = {path: {"added by the views": len(added), "drawn": drawn}}
        result["census pairs"][name] = c_rows
        result["all pairs"][name] = a_rows
    return result


MUTUAL_BONUSES = (0.0, 0.02, 0.05, 0.1, 0.2)
FRONTIER_CUTS = (0.5, 0.48, 0.46, 0.44, 0.42, 0.4, 0.38, 0.36, 0.34)


@dataclasses.dataclass(frozen=True)
class Candidates:
    """Every test image's ``candidates`` nearest train images by a copy model, scored as the copy
    decision scores them (``normalised``, background of the ``k``-th nearest public image)."""

    dataset: Any
    train_images: np.ndarray
    test_images: np.ndarray
    embeddings: tuple[np.ndarray, ...]  # train, train mirrored, test, test mirrored
    sims: np.ndarray
    index: np.ndarray
    mirrored: np.ndarray
    train_sims: np.ndarray
    score: np.ndarray


def scored_candidates(data: str, out: str, *, k: int, beta: float, candidates: int) -> Candidates:
    from dpscale.data.dataset import IngestedDataset

    ds = IngestedDataset(data)
    train_images, test_images = ds.split_images("train"), ds.split_images("test")
    tr, tr_m, te, te_m = embeddings(out, train_images, test_images)
    sims, index, mirrored = top_k(te, te_m, tr, k=candidates)
    train_sims = top_k(tr, tr_m, tr, k=k, exclude_self=True)[0]
    score = normalised(sims, sims[:, k - 1:k], train_sims[index, k - 1], beta)
    return Candidates(ds, train_images, test_images, (tr, tr_m, te, te_m), sims, index, mirrored, train_sims, score)


def mutual(data: str, out: str, census_path: str, *, report: str | None, k: int = 10, beta: float = 0.5,
           candidates: int = 20, judged_until: int = 1000, strata: Sequence[int] = (3000,),
           montage_dir: str | None = None, pick: tuple[float, int] | None = None,
           lower_cut: tuple[float, float] | None = None, seed: int = 0) -> dict:
    """Mutual nearest neighbours as evidence: a look-alike of a common scene has many near
    neighbours on both sides, a copy and its twin tend to be each other's nearest. A pair scores
    its ``normalised`` score plus ``bonus`` when the public image is the private image's best-scoring
    candidate *and* the private image is the public image's nearest private image (cosine, both
    mirror states). Each bonus is compared at equal look-alike cost on the census labels (also held
    out), then over all pairs (each private image's best candidate), counted with the census tail.
    Bonus 0 is the copy decision's score; with a report it is also counted at ``FRONTIER_CUTS``:
    what a lower ``--copy-cut`` buys and costs; ``lower_cut`` = (high, low) draws a seeded 40 of the
    test images a cut of ``low`` adds to dedup's matches and to a cut of ``high``."""
    start = time.time()
    c = scored_candidates(data, out, k=k, beta=beta, candidates=candidates)
    ds, test_images, score = c.dataset, c.test_images, c.score
    tr, tr_m, te, te_m = c.embeddings
    test_sims, test_index, test_mirrored, train_sims = c.sims, c.index, c.mirrored, c.train_sims
    nearest_private = top_k(tr, tr_m, te, k=1)[1][:, 0]  # cos(mirror a, b) is cos(a, mirror b)
    n = len(test_images)
    col = score.argmax(1)
    best, best_j, best_m = score[np.arange(n), col], test_index[np.arange(n), col], test_mirrored[np.arange(n), col]
    is_mutual = nearest_private[best_j] == np.arange(n)
    seconds = time.time() - start

    rows, ci, cj, labels, even = census_columns(census_path)
    c_cos = census_pair_cosine(te, te_m, tr, ci, cj)
    c_score = normalised(c_cos, test_sims[ci, k - 1], train_sims[cj, k - 1], beta)
    c_mutual = (best_j[ci] == cj) & (nearest_private[cj] == ci)
    pixel = pixel_accepted(ds, census_path)
    dedup = None if report is None else dedup_matched(report)
    result: dict = {"embed and search seconds": round(seconds, 1), "k": k, "beta": beta,
                    "mutual over all private images": int(is_mutual.sum()),
                    "census pairs": {"total": counts(np.ones(len(labels), bool), labels),
                                     "grid + refine": counts(pixel, labels),
                                     "mutual": counts(c_mutual, labels)},
                    "all pairs": {}}
    if dedup is not None:  # the copy decision's own score (no bonus) at a range of cuts
        result["cut frontier, bonus 0"] = {}
        for cut in FRONTIER_CUTS:
            hit = set(np.flatnonzero(best >= cut).tolist())
            result["cut frontier, bonus 0"][f"{cut:.2f}"] = {
                "census pairs": counts(pixel | (c_score >= cut), labels), "added to dedup": len(hit - dedup),
                **tail_counted(rows, judged_until=judged_until, total=n, strata=strata, matched=hit | dedup)}
        if montage_dir is not None and lower_cut is not None:
            high, low = lower_cut
            added = np.flatnonzero((best >= low) & (best < high))
            added = np.array(sorted(set(added.tolist()) - dedup), np.int64)  # what lowering the cut adds
            path = os.path.join(montage_dir, f"dedup_copy_cut_{high}_to_{low}_added.png")
            drawn = draw_sheet(data, path, added, best_j, best, best_m, seed=seed)
            result["cut montage"] = {path: {"added by the lower cut": len(added), "drawn": drawn}}
    for bonus in MUTUAL_BONUSES:
        c_total = c_score + bonus * c_mutual
        total = best + bonus * is_mutual
        c_rows, a_rows = {}, {}
        for allowance in ALLOWANCES:
            cut, c_rows[f"+{allowance} diff"] = census_row(c_total, labels, pixel, even, allowance)
            hit, row = all_pairs_row(total, cut, rows=rows, dedup=dedup, judged_until=judged_until, strata=strata)
            if dedup is not None and montage_dir is not None and pick == (bonus, allowance):
                plain = set(np.flatnonzero(best >= c_rows[f"+{allowance} diff"]["cut"]).tolist())
                added = np.array(sorted(hit - dedup - plain), np.int64)  # what the bonus adds
                path = os.path.join(montage_dir, f"dedup_copy_mutual_added_{bonus}_{allowance}.png")
                drawn = draw_sheet(data, path, added, best_j, total, best_m, seed=seed)
                result["montage"] = {path: {"added by the bonus": len(added), "drawn": drawn}}
            a_rows[f"+{allowance} diff"] = row
        result["census pairs"][f"bonus {bonus}"] = c_rows
        result["all pairs"][f"bonus {bonus}"] = a_rows
    return result


LOCAL_WEIGHTS = (0.0, 0.5, 1.0, 2.0, 3.0)
LOCAL_CUTS = (0.62, 0.6, 0.58, 0.56, 0.54, 0.52, 0.5, 0.48, 0.46)


def local_scores(score: np.ndarray, share: np.ndarray, weight: float) -> np.ndarray:
    """Every candidate's copy score with the local agreement, as ``copy_score.decide`` computes it:
    ``score`` [n, candidates] normalised cosines, ``share`` their local agreements."""
    return with_local_agreement(score, share, weight, local_background(share))


def candidate_column(candidates: np.ndarray, private_index: np.ndarray, public_index: np.ndarray) -> np.ndarray:
    """Per (private, public) pair: the public image's column among the private image's candidates,
    -1 where it is not one of them (the copy decision never scores such a pair)."""
    hit = candidates[private_index] == public_index[:, None]
    return np.where(hit.any(axis=1), hit.argmax(axis=1), -1)


def local(data: str, out: str, census_path: str, *, report: str | None, weights: Sequence[float] = LOCAL_WEIGHTS,
          picked: float = 2.0, cuts: Sequence[float] = LOCAL_CUTS, k: int = 10, beta: float = 0.5,
          candidates: int = 20, judged_until: int = 1000, strata: Sequence[int] = (3000,)) -> dict:
    """The copy score plus ``weight`` x the pair's local agreement (``dedup.local_match``) minus
    the median agreement of the private image's ``candidates``, as ``dedup.copy_score.decide``
    scores its first pass: each weight at equal look-alike cost on the census labels (also held
    out), then over all pairs (each private image's best candidate) counted with the census tail;
    the ``picked`` weight also at ``cuts``. A census pair is scored as its candidate pair (the
    mirror state the search chose); one whose train image is not among its test image's
    candidates cannot be accepted by the copy decision (only by the pixel checks)."""
    from dpscale.dedup import copy_model, local_match

    if not os.path.isfile(os.path.join(out, copy_model.WEIGHTS)):
        raise SystemExit(f"local: {out!r} is not a dpscale copy model (dpscale train-copy-model)")
    if picked not in weights:
        raise SystemExit(f"local: --picked {picked} is not one of --weights {list(weights)}")
    start = time.time()
    c = scored_candidates(data, out, k=k, beta=beta, candidates=candidates)
    ds, score, test_index = c.dataset, c.score, c.index
    agreement = local_match.Agreement(copy_model.load(out).params, copy_model.thumbnails(c.train_images),
                                      copy_model.thumbnails(c.test_images), show_progress=True)
    n = len(c.test_images)
    share = agreement(np.arange(n), test_index, c.mirrored)
    seconds = time.time() - start

    rows, ci, cj, labels, even = census_columns(census_path)
    column = candidate_column(test_index, ci, cj)
    pixel = pixel_accepted(ds, census_path)
    dedup = None if report is None else dedup_matched(report)
    result: dict = {"embed, search and match seconds": round(seconds, 1), "k": k, "beta": beta,
                    "census pairs": {"total": counts(np.ones(len(labels), bool), labels),
                                     "grid + refine": counts(pixel, labels),
                                     "among the candidates": counts(column >= 0, labels)},
                    "all pairs": {}}

    def over_all_pairs(best: np.ndarray, cut: float) -> dict:
        return all_pairs_row(best, cut, rows=rows, dedup=dedup, judged_until=judged_until, strata=strata)[1]

    for weight in weights:
        total = local_scores(score, share, weight)
        best = total.max(axis=1)
        c_total = np.where(column >= 0, total[ci, np.maximum(column, 0)], -np.inf)
        c_rows, a_rows = {}, {}
        for allowance in ALLOWANCES:
            cut, c_rows[f"+{allowance} diff"] = census_row(c_total, labels, pixel, even, allowance)
            a_rows[f"+{allowance} diff"] = over_all_pairs(best, cut)
        result["census pairs"][f"weight {weight}"] = c_rows
        result["all pairs"][f"weight {weight}"] = a_rows
        if weight == picked:
            result[f"cut frontier, weight {weight}"] = {
                f"{cut:.2f}": {"census pairs": counts(pixel | (c_total >= cut), labels), **over_all_pairs(best, cut)}
                for cut in cuts}
    return result


def write_label_sheet(path: str, pairs: Sequence[tuple[int, int, float, bool]], *,
                      score_name: str = "cosine") -> None:
    """The montage's pairs with an empty ``label`` column, to fill in by eye. A sheet that exists
    is kept if it holds the same pairs (its labels survive a re-run) and refused if not."""
    if os.path.exists(path):
        with open(path) as handle:
            old = [(int(r["test_index"]), int(r["train_index"])) for r in csv.DictReader(handle)]
        if old != [(t, j) for t, j, _, _ in pairs]:
            raise SystemExit(f"{path} holds other pairs (labelled by eye?): move it away to redraw")
        return
    with open(path, "w", newline="") as handle:
        w = csv.writer(handle)
        w.writerow(["position", "test_index", "train_index", score_name, "mirrored", "label"])
        for k, (t, j, c, m) in enumerate(pairs):
            w.writerow([k, t, j, f"{c:.4f}", int(m), ""])


def pixel_checks(dataset, train_index: np.ndarray, test_index: np.ndarray, mirrored: np.ndarray) -> np.ndarray:
    """dedup's own decision (``join.verify_candidates``: the grid, then refinement) on the pairs
    (train[train_index[i]], test[test_index[i]]), the test image mirrored where ``mirrored[i]``."""
    from dpscale.dedup import descriptor, verify
    from dpscale.dedup.join import Candidate, verify_candidates

    whole, whole_mirrored = 0, len(descriptor.VIEWS)  # descriptor.view_of: plain views first
    candidates = [Candidate("train", int(j), 0, "test", int(t), whole_mirrored if m else whole, 0.0)
                  for j, t, m in zip(train_index, test_index, mirrored, strict=True)]
    matches = verify_candidates(candidates, dataset, dataset, threshold=verify.THRESHOLD)
    return np.array([m.accepted for m in matches], bool)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train on the public (train) split only")
    t.add_argument("data")
    t.add_argument("out")
    t.add_argument("--epochs", type=int, default=12)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--koleo", type=float, default=0.0, help="weight of the KoLeo spreading term")
    t.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    c = sub.add_parser("census", help="the census and refined pairs' cosines against their labels")
    c.add_argument("data")
    c.add_argument("out")
    c.add_argument("census_labels")
    c.add_argument("refined_labels")
    s = sub.add_parser("search", help="nearest train image of every test image; recall; montage")
    s.add_argument("data")
    s.add_argument("out")
    s.add_argument("census_labels")
    s.add_argument("--dedup-report")
    s.add_argument("--threshold", type=float, default=0.9)
    s.add_argument("--montage-dir")
    m = sub.add_parser("margin", help="background-normalised cosines at equal look-alike cost; recall")
    m.add_argument("data")
    m.add_argument("out", help="a copy model, or several comma-separated (their ensemble)")
    m.add_argument("census_labels")
    m.add_argument("--dedup-report")
    m.add_argument("--montage-dir")
    m.add_argument("--pick", help="k:beta:allowance whose additions to draw (k = 0 for the raw cosine)")
    m.add_argument("--judged-until", type=int, default=1000, help="census ranks below this are all judged")
    m.add_argument("--strata", type=int, nargs="*", default=[3000], help="the census tail's strata cuts")
    v = sub.add_parser("views", help="crop views of either end beside the whole image, at equal look-alike cost")
    v.add_argument("data")
    v.add_argument("out", help="a dpscale copy model (dpscale train-copy-model)")
    v.add_argument("census_labels")
    v.add_argument("--dedup-report")
    v.add_argument("--montage-dir")
    v.add_argument("--pick", type=int, help="allowance whose additions by the views to draw")
    v.add_argument("--judged-until", type=int, default=1000, help="census ranks below this are all judged")
    v.add_argument("--strata", type=int, nargs="*", default=[3000], help="the census tail's strata cuts")
    v.add_argument("--census-only", action="store_true", help="score the census pairs only (no all-pairs search)")
    mu = sub.add_parser("mutual", help="a bonus for mutual nearest neighbours, at equal look-alike cost")
    mu.add_argument("data")
    mu.add_argument("out", help="a copy model, or several comma-separated (their ensemble)")
    mu.add_argument("census_labels")
    mu.add_argument("--dedup-report")
    mu.add_argument("--montage-dir")
    mu.add_argument("--pick", help="bonus:allowance whose additions by the bonus to draw, e.g. 0.05:4")
    mu.add_argument("--lower-cut", help="high:low, e.g. 0.48:0.4: draw what lowering the copy cut adds")
    mu.add_argument("--judged-until", type=int, default=1000, help="census ranks below this are all judged")
    mu.add_argument("--strata", type=int, nargs="*", default=[3000], help="the census tail's strata cuts")
    lo = sub.add_parser("local", help="the local agreement as a second cue, at equal look-alike cost; recall")
    lo.add_argument("data")
    lo.add_argument("out", help="a dpscale copy model (dpscale train-copy-model)")
    lo.add_argument("census_labels")
    lo.add_argument("--dedup-report")
    lo.add_argument("--weights", type=float, nargs="+", default=list(LOCAL_WEIGHTS))
    lo.add_argument("--picked", type=float, default=2.0, help="the weight also counted at --cuts")
    lo.add_argument("--cuts", type=float, nargs="+", default=list(LOCAL_CUTS))
    lo.add_argument("--judged-until", type=int, default=1000, help="census ranks below this are all judged")
    lo.add_argument("--strata", type=int, nargs="*", default=[3000], help="the census tail's strata cuts")
    args = p.parse_args(argv)
    if args.command == "local":
        print(json.dumps(local(args.data, args.out, args.census_labels, report=args.dedup_report,
                               weights=args.weights, picked=args.picked, cuts=args.cuts,
                               judged_until=args.judged_until, strata=args.strata), indent=1))
    elif args.command == "margin":
        pick = None
        if args.pick:
            try:
                k, beta, allowance = args.pick.split(":")
                pick = (int(k), float(beta), int(allowance))
            except ValueError:
                p.error(f"--pick {args.pick!r}: expected k:beta:allowance, e.g. 10:0.5:8")
        print(json.dumps(margin(args.data, args.out, args.census_labels, report=args.dedup_report,
                                montage_dir=args.montage_dir, pick=pick, judged_until=args.judged_until,
                                strata=args.strata), indent=1))
    elif args.command == "mutual":
        picked = None
        if args.pick:
            try:
                bonus, allowance = args.pick.split(":")
                picked = (float(bonus), int(allowance))
            except ValueError:
                p.error(f"--pick {args.pick!r}: expected bonus:allowance, e.g. 0.05:4")
        lower = None
        if args.lower_cut:
            try:
                high, low = (float(v) for v in args.lower_cut.split(":"))
                lower = (high, low)
            except ValueError:
                p.error(f"--lower-cut {args.lower_cut!r}: expected high:low, e.g. 0.48:0.4")
        print(json.dumps(mutual(args.data, args.out, args.census_labels, report=args.dedup_report,
                                montage_dir=args.montage_dir, pick=picked, lower_cut=lower,
                                judged_until=args.judged_until, strata=args.strata), indent=1))
    elif args.command == "views":
        print(json.dumps(views(args.data, args.out, args.census_labels, report=args.dedup_report,
                               montage_dir=args.montage_dir, pick=args.pick, judged_until=args.judged_until,
                               strata=args.strata, census_only=args.census_only), indent=1))
    elif args.command == "train":
        import torch

        torch.set_num_threads(args.threads)
        from dpscale.data.dataset import IngestedDataset

        ds = IngestedDataset(args.data)
        images = ds.split_images("train")
        print(json.dumps(train(images, args.out, epochs=args.epochs, seed=args.seed,
                               koleo_weight=args.koleo), indent=1))
    elif args.command == "census":
        print(json.dumps(census_table(args.data, args.out, args.census_labels, args.refined_labels), indent=1))
    else:
        print(json.dumps(search(args.data, args.out, args.census_labels, report=args.dedup_report,
                                threshold=args.threshold, montage_dir=args.montage_dir), indent=1))


if __name__ == "__main__":
    main()
