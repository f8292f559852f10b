"""Experiment: fine-tune a copy model (``dpscale train-copy-model``) with hard negatives.

Why: at a high-recall ``--copy-cut`` most of what the copy decision adds are look-alikes of one
scene (a plane on a plain sky, a horse on grass; ``benchmarks/results/dedup.md``). Training
draws its negatives at random, so a batch rarely holds two such look-alikes and the loss seldom
has to tell them apart. Here each batch is built from ``seeds`` random public images and, for
each, its nearest other public images by the current model (the neighbour mirrored where its
better state is the mirrored one), filled up with random images; same loss and copy edits as
``dedup.copy_model.train``. Neighbours at a cosine of ``tau`` or more are left out: they are
likely copies *within* the public set, which must not be pushed apart. Hard negatives are a
common device of metric learning (e.g. the semi-hard negatives of FaceNet, Schroff et al.
2015). Public images only: nothing private enters the model. ``--random`` is the control:
the same steps and learning rate on random batches. ``mine --census-labels`` also reads the
test (private) split and prints its census pairs' cosines without noise: a diagnostic for
benchmark data, not to be run on or published for data you must keep private.

    D=/tmp/s31/cifar10
    python benchmarks/dedup_hard_negatives.py mine $D COPY12 nn.npz            # 50,000 x 16 nearest
    python benchmarks/dedup_hard_negatives.py tune $D COPY12 nn.npz HARD --tau 0.75
    python benchmarks/dedup_hard_negatives.py tune $D COPY12 nn.npz RANDOM --random

Then score it like any copy model (``dedup_copy_embedding.py mutual``, ``dedup.py planted``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

NEIGHBOURS = 16  # nearest public images kept per public image when mining


def hard_negatives(sims: np.ndarray, index: np.ndarray, mirrored: np.ndarray, *, tau: float,
                   per_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per image, its ``per_seed`` nearest neighbours whose cosine is below ``tau`` (nearest first;
    -1 where fewer exist) and whether each is to be mirrored. Rows of ``sims`` are sorted, most
    similar first (``copy_score.top_k``)."""
    eligible = sims < tau
    rank = np.cumsum(eligible, axis=1)
    pick = np.full((len(sims), per_seed), -1, np.int64)
    flip = np.zeros((len(sims), per_seed), bool)
    for r in range(per_seed):
        hit = eligible & (rank == r + 1)
        has = hit.any(1)
        col = hit.argmax(1)
        pick[has, r] = index[has, col[has]]
        flip[has, r] = mirrored[has, col[has]]
    return pick, flip


def hard_batch(rng: np.random.Generator, pick: np.ndarray, flip: np.ndarray, *,
               batch: int) -> tuple[np.ndarray, np.ndarray]:
    """One batch: ``batch // (1 + per_seed)`` random seeds, each followed by its hard negatives,
    every image at most once (its first place), filled up with random other images. Returns the
    image indices and which of them to mirror."""
    n, per_seed = pick.shape
    seeds = rng.choice(n, batch // (1 + per_seed), replace=False)
    members = np.concatenate([seeds[:, None], pick[seeds]], 1).ravel()
    flips = np.concatenate([np.zeros((len(seeds), 1), bool), flip[seeds]], 1).ravel()
    keep = members >= 0
    members, flips = members[keep], flips[keep]
    first = np.sort(np.unique(members, return_index=True)[1])
    members, flips = members[first], flips[first]
    pool = rng.choice(n, min(n, batch), replace=False)
    fill = pool[~np.isin(pool, members)][:batch - len(members)]
    return np.concatenate([members, fill]), np.concatenate([flips, np.zeros(len(fill), bool)])


def fine_tune(params: Any, thumbnails: np.ndarray, pick: np.ndarray, flip: np.ndarray, *, steps: int,
              batch: int = 256, learning_rate: float = 5e-4, temperature: float = 0.07, seed: int = 1,
              random_batches: bool = False, log_every: int = 50) -> tuple[Any, dict]:
    """``steps`` AdamW steps (one-cycle learning rate) from ``params`` on hard-negative batches of
    ``thumbnails`` (uint8, ``copy_model.thumbnails``), or on random batches (the control)."""
    import jax
    import optax

    from dpscale.dedup import copy_model

    optimiser = optax.adamw(optax.cosine_onecycle_schedule(steps, learning_rate), weight_decay=1e-4)
    state = optimiser.init(params)
    step = copy_model.contrastive_step(optimiser, temperature)

    rng, root = np.random.default_rng(seed), jax.random.PRNGKey(seed + 100)
    losses, start = [], time.time()
    for s in range(steps):
        if random_batches:
            members, flips = rng.choice(len(thumbnails), batch, replace=False), np.zeros(batch, bool)
        else:
            members, flips = hard_batch(rng, pick, flip, batch=batch)
        images = thumbnails[members].astype(np.float32) / 255.0
        images[flips] = images[flips][:, :, ::-1]
        params, state, loss = step(params, state, images, jax.random.fold_in(root, s))
        losses.append(float(loss))
        if not np.isfinite(losses[-1]):
            raise FloatingPointError(f"fine-tuning diverged at step {s} (loss {losses[-1]})")
        if log_every and (s % log_every == 0 or s == steps - 1):
            print(f"step {s} loss {np.mean(losses[-log_every:]):.4f} {time.time() - start:.0f}s", flush=True)
    return params, {"steps": steps, "batch": batch, "learning_rate": learning_rate, "seed": seed,
                    "random_batches": random_batches, "final_loss": round(float(np.mean(losses[-50:])), 4),
                    "seconds": round(time.time() - start, 1)}


def _public(data: str) -> tuple[Any, np.ndarray]:
    from dpscale.data.dataset import IngestedDataset

    ds = IngestedDataset(data)
    return ds, ds.split_images("train")


def mine(data: str, model: str, out: str, census_path: str | None) -> dict:
    """Every public (train) image's ``NEIGHBOURS`` nearest other public images (both mirror states)
    into ``out`` (npz); with the census labels, their pairs' cosines by label (to choose ``tau``)."""
    from dpscale.dedup import copy_model
    from dpscale.dedup.copy_score import top_k

    ds, train = _public(data)
    params = copy_model.load(model).params
    e, e_m = copy_model.embed(params, train), copy_model.embed(params, train, mirrored=True)
    sims, index, mirrored = top_k(e, e_m, e, k=NEIGHBOURS, exclude_self=True)
    np.savez(out, sims=sims, index=index, mirrored=mirrored)
    result: dict = {"public images": len(train),
                    "nearest cosine percentiles 50/90/95/99": np.percentile(sims[:, 0], [50, 90, 95, 99]).round(3).tolist(),
                    "public pairs at cosine >= 0.7 / 0.75 / 0.8": [int((sims >= t).sum()) for t in (0.7, 0.75, 0.8)]}
    if census_path is not None:
        from dpscale.benchmarks.dedup_copy_embedding import census_columns, census_pair_cosine

        test = ds.split_images("test")
        t, t_m = copy_model.embed(params, test), copy_model.embed(params, test, mirrored=True)
        _, ci, cj, labels, _ = census_columns(census_path)
        cos = census_pair_cosine(t, t_m, e, ci, cj)
        result["census cosine percentiles 5/10/25/50/75/90"] = {
            label: np.percentile(cos[labels == label], [5, 10, 25, 50, 75, 90]).round(3).tolist()
            for label in ("dup", "unsure", "diff")}
    return result


def tune(data: str, model: str, neighbours: str, out: str, *, tau: float, per_seed: int, steps: int,
         learning_rate: float, seed: int, random_batches: bool) -> dict:
    """Fine-tune ``model`` on the public (train) split and save it (``copy_model.save``) to ``out``."""
    from dpscale.dedup import copy_model

    ds, train = _public(data)
    mined = np.load(neighbours)
    if len(mined["sims"]) != len(train):
        raise SystemExit(f"{neighbours} was mined from {len(mined['sims'])} images, the public split has {len(train)}")
    pick, flip = hard_negatives(mined["sims"], mined["index"], mined["mirrored"], tau=tau, per_seed=per_seed)
    params, info = fine_tune(copy_model.load(model).params, copy_model.thumbnails(train), pick, flip, steps=steps,
                             learning_rate=learning_rate, seed=seed, random_batches=random_batches)
    info.update({"fine_tuned_from": model, "tau": tau, "per_seed": per_seed,
                 "images with every hard negative": int((pick >= 0).all(1).sum())})
    copy_model.save(out, params, info, ds.ids("train"))
    return info


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("mine", help="every public image's nearest other public images")
    m.add_argument("data")
    m.add_argument("model", help="a dpscale copy model (dpscale train-copy-model)")
    m.add_argument("out", help="npz of similarities, indices and mirror flags")
    m.add_argument("--census-labels", help="also the census pairs' cosines by label (reads the private split)")
    t = sub.add_parser("tune", help="fine-tune on hard-negative (or, with --random, random) batches")
    t.add_argument("data")
    t.add_argument("model")
    t.add_argument("neighbours", help="the npz of `mine`")
    t.add_argument("out")
    t.add_argument("--tau", type=float, default=0.75, help="neighbours at this cosine or more are not negatives")
    t.add_argument("--per-seed", type=int, default=3)
    t.add_argument("--steps", type=int, default=585, help="585 x 256 = three passes over 50,000 images")
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--seed", type=int, default=1)
    t.add_argument("--random", action="store_true", help="the control: random batches")
    args = p.parse_args(argv)
    if args.command == "mine":
        print(json.dumps(mine(args.data, args.model, args.out, args.census_labels), indent=1))
    else:
        print(json.dumps(tune(args.data, args.model, args.neighbours, args.out, tau=args.tau,
                              per_seed=args.per_seed, steps=args.steps, learning_rate=args.lr, seed=args.seed,
                              random_batches=args.random), indent=1))


if __name__ == "__main__":
    main()
