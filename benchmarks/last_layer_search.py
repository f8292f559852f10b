"""Fast hyper-parameter search for last-layer DP-SGD on cached features, on a held-out split.

Used for the held-out search of ``results/cifar10_last_layer.md``. ``dpscale sweep --holdout`` does the
same thing run by run; this trains, for each (epsilon, learning rate), all repeats at once
with the library's own DP step (``training.vmapped``: the plan's Poisson sampling, clipping,
noise and EMA, ``vmap``-ed over repeats), so a grid costs about as much as a few runs on
2 cores. Noise multipliers come from the library's calibration. Numbers are for *choosing*
settings only; the reported ones come from ``dpscale sweep``.

``--epsilons`` takes numbers, ``inf`` (non-private: no clipping, no noise) and ``clip``
(clipping with a negligible noise multiplier of 1e-9: what clipping alone costs).
``center-l2`` here uses the exact mean of the training rows (the library releases a DP
mean, whose cost is in epsilon; at noise multiplier 20 over 45,000 rows it moved held-out
accuracy by less than the seed-to-seed spread).

    python -m benchmarks.last_layer_search CACHE_ENTRY --kind center-l2 --scale 32 \\
        --epsilons 1 --steps 400 --learning-rates 1,2,4 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from dpscale.cache.feature_store import open_features
from dpscale.privacy.plan import PrivacyPlan, PrivacyTarget
from dpscale.training import feature_normalization
from dpscale.training.config import FEATURE_NORMALIZATIONS
from dpscale.training.vmapped import TrainingSetup, train_models

_CLIP_ONLY_SIGMA = 1e-9


def _plan(epsilon: str, *, num_examples: int, batch_size: int, steps: int) -> PrivacyPlan:
    if epsilon == "inf":
        return PrivacyPlan.calibrate(
            PrivacyTarget(math.inf), num_examples=num_examples, batch_size=batch_size, steps=steps
        )
    if epsilon == "clip":
        return PrivacyPlan(
            num_examples=num_examples, batch_size=batch_size, steps=steps, noise_multiplier=_CLIP_ONLY_SIGMA, delta=1e-5
        )
    return PrivacyPlan.calibrate(
        PrivacyTarget(float(epsilon), 1e-5), num_examples=num_examples, batch_size=batch_size, steps=steps
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cache_entry")
    p.add_argument("--holdout", type=int, default=5000)
    p.add_argument("--kind", choices=FEATURE_NORMALIZATIONS, default="none")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--epsilons", default="1", help="comma-separated; 'inf' = non-private, 'clip' = clipping only")
    p.add_argument("--sampling-rate", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--learning-rates", default="4")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ema-decay", type=float, default=0.999)
    p.add_argument("--out", default="last_layer_search.jsonl")
    a = p.parse_args()

    store = open_features(a.cache_entry)
    x_all = np.asarray(store.features("train")[:], np.float32)
    y_all = np.asarray(store.labels("train"), np.int32)
    n = len(y_all) - a.holdout
    mean = feature_normalization.feature_mean(x_all[:n], noise_multiplier=None, seed=0)
    x_tr = feature_normalization.apply(x_all[:n], a.kind, mean, a.scale)
    x_va = feature_normalization.apply(x_all[n:], a.kind, mean, a.scale)
    y_tr, y_va = y_all[:n], y_all[n:]
    batch_size = round(a.sampling_rate * n)
    present = np.ones((a.repeats, n), bool)

    def read_out(model, states):
        return {"last": states.params, "ema": states.ema_params}

    started = time.time()
    with open(a.out, "a") as f:
        for eps in (e.strip() for e in a.epsilons.split(",")):
            plan = _plan(eps, num_examples=n, batch_size=batch_size, steps=a.steps)
            for lr in (float(v) for v in a.learning_rates.split(",")):
                setup = TrainingSetup(
                    plan=plan, learning_rate=lr, clip_norm=a.clip_norm, model="linear", ema_decay=a.ema_decay
                )
                (out,) = train_models(
                    x_tr, y_tr, present, setup=setup, seed=a.seed, read_out=read_out, chunk_size=a.repeats
                )
                for r in range(a.repeats):
                    scores = {}
                    for name in ("last", "ema"):
                        w, b = out[name]["kernel"][r], out[name]["bias"][r]
                        scores[name] = float(np.mean(np.argmax(x_va @ w + b, 1) == y_va))
                    record = dict(
                        epsilon=eps,
                        lr=lr,
                        repeat=r,
                        seed=a.seed,
                        sigma=plan.noise_multiplier,
                        clip=a.clip_norm if plan.private else "inf",
                        kind=a.kind,
                        scale=a.scale,
                        q=plan.sampling_rate,
                        steps=a.steps,
                        holdout=a.holdout,
                        heldout_top1=scores["last"],
                        heldout_ema_top1=scores["ema"],
                    )
                    print(json.dumps(record), flush=True)
                    f.write(json.dumps(record) + "\n")
    print(f"done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
