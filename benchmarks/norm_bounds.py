"""What clipping with proven norm bounds costs: their margin, and the clipped sum's time (run by hand).

    python -m benchmarks.norm_bounds margins DATA --model wrn-16-4 --batch 16 --views 1
    python -m benchmarks.norm_bounds time DATA --model cnn-small --batch 64 --baseline REF --rounds 7

DATA is an ingested image dataset (CIFAR-10); the first ``--batch`` training images, the model at
its initialisation, K views (the image and its mirror, alternately). ``margins``: each example's
norm bound (what the per-layer clipped sum clips with, ``privacy.rounding``) over its exact norm
(the float64 norm of its ``vmap(grad)`` gradient), with the layers' paths as chosen and with every
WS convolution and dense layer forced to one path, at each precision. ``time``: the per-layer
clipped sum of one micro-batch (jitted, compilation excluded) of this tree against the same
function at git ref REF (its ``privacy/`` modules imported side by side, the rest of this tree
shared), called alternately A B A' in one process so that the machine's load hits all alike; the
ratio of wall times, and of the process's CPU time (all threads), which other load disturbs less;
A' is the baseline compiled again, whose ratio to A is the measurement's own noise.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _problem(data: str, model_name: str, size: int, views: int):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from dpscale.data.dataset import IngestedDataset
    from dpscale.data.image_data import normalize
    from dpscale.models import registry

    images, labels = IngestedDataset(data).get("train", np.arange(size))
    x = normalize(images)
    stacked = np.stack([x[:, :, ::-1] if k % 2 else x for k in range(views)], axis=1)
    batch = {"image": jnp.asarray(stacked), "label": jnp.asarray(np.repeat(labels[:, None], views, axis=1))}
    model = registry.get_model(model_name, num_classes=10)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, *x.shape[1:])))["params"]

    def loss_fn(params, model_state, views):
        logits = model.apply({"params": params}, views["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, views["label"]).mean()

    return loss_fn, params, batch


def margins(args) -> None:
    import jax
    import numpy as np

    from dpscale.privacy import bookkeeping, ghost
    from dpscale.privacy.clipping import per_example_gradients
    from dpscale.privacy.rounding import FORMATS, ClipPrecision
    from dpscale.privacy.tuning.choose import chooser, describe

    loss_fn, params, batch = _problem(args.data, args.model, args.batch, args.views)
    _, grads = jax.jit(lambda p, b: per_example_gradients(loss_fn, p, {}, b))(params, batch)
    exact = np.sqrt(
        sum(
            np.sum(np.asarray(g, np.float64).reshape(args.batch, -1) ** 2, axis=1)
            for g in jax.tree_util.tree_leaves(grads)
        )
    )
    paths = [
        c.path
        for c in bookkeeping.plan_batch_layers(loss_fn, params, {}, batch)
        if type(c.module).__name__ in ("WSConv", "Dense")
    ]
    for mode in args.modes.split(","):
        for name in FORMATS:
            forced = None if mode == "auto" else {path: mode for path in paths}
            precision = ClipPrecision(norms=name, sums=name)
            choose = chooser(loss_fn, example=(params, {}, batch), strategies=forced, precision=precision)
            fn = ghost.make_ghost_clipped_sum_fn(loss_fn, clip_norm=1.0, example=(params, {}, batch), choose=choose)
            bounds = jax.jit(ghost.make_ghost_norm_bounds_fn(loss_fn, choose=choose))
            ratio = np.asarray(bounds(params, {}, batch), np.float64) / exact
            row = {
                "model": args.model,
                "batch": args.batch,
                "views": args.views,
                "paths": mode,
                "precision": name,
                "mean": ratio.mean() - 1,
                "min": ratio.min() - 1,
                "max": ratio.max() - 1,
            }
            if mode == "auto":
                row["layers"] = describe(fn.layers)
            print(json.dumps(row), flush=True)


def _baseline_ghost(ref: str):
    """``privacy.ghost`` as it was at ``ref``, imported as a package of its own beside this tree's."""
    names = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "--name-only", ref, "privacy/"], check=True, capture_output=True, text=True
    ).stdout.split()
    modules = [Path(n).stem for n in names if n.endswith(".py")]
    package = Path(tempfile.mkdtemp()) / "baseline_privacy"
    package.mkdir()
    for module in modules:
        source = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{ref}:privacy/{module}.py"], check=True, capture_output=True, text=True
        ).stdout
        for other in modules:
            source = source.replace(f"dpscale.privacy.{other} ", f"baseline_privacy.{other} ")
            source = source.replace(f"dpscale.privacy.{other}\n", f"baseline_privacy.{other}\n")
        source = source.replace("from dpscale.privacy import", "from baseline_privacy import")
        (package / f"{module}.py").write_text(source)
    sys.path.insert(0, str(package.parent))
    return importlib.import_module("baseline_privacy.ghost")


def timing(args) -> None:
    import jax
    import jax.numpy as jnp

    from dpscale.privacy import ghost
    from dpscale.privacy.tuning.choose import chooser

    baseline = _baseline_ghost(args.baseline)
    loss_fn, params, batch = _problem(args.data, args.model, args.batch, args.views)
    mask = jnp.ones(args.batch)
    fns = {}  # the baseline twice: the ratio of its two copies is the measurement's own noise
    example = (params, {}, batch)
    for name, module in (("baseline", baseline), ("this", ghost), ("baseline again", baseline)):
        # This tree's paths by the device's chooser; a baseline's by its own default (the shape rule
        # before the tuning left privacy/ghost.py, explicit after).
        extra = {"choose": chooser(loss_fn, example=example)} if module is ghost else {}
        fn = jax.jit(module.make_ghost_clipped_sum_fn(loss_fn, clip_norm=1.0, example=example, **extra))
        started = time.perf_counter()
        jax.block_until_ready(fn(params, {}, batch, mask))
        print(f"{name}: compiled and ran once in {time.perf_counter() - started:.1f} s", flush=True)
        fns[name] = fn
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            started, started_cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(params, {}, batch, mask))
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - started_cpu)  # all threads: less sensitive to other load
    ratios = [t / b for t, b in zip(wall["this"], wall["baseline"])]
    cpu_ratios = [t / b for t, b in zip(cpu["this"], cpu["baseline"])]
    control = [t / b for t, b in zip(cpu["baseline again"], cpu["baseline"])]
    print(
        json.dumps(
            {
                "model": args.model,
                "batch": args.batch,
                "views": args.views,
                "baseline": args.baseline,
                "baseline_s": statistics.median(wall["baseline"]),
                "this_s": statistics.median(wall["this"]),
                "ratio_median": statistics.median(ratios),
                "ratio_q1_q3": statistics.quantiles(ratios, n=4)[::2],
                "cpu_ratio_median": statistics.median(cpu_ratios),
                "cpu_ratio_q1_q3": statistics.quantiles(cpu_ratios, n=4)[::2],
                "control_cpu_ratio_median": statistics.median(control),
                "rounds": args.rounds,
                "load_average": os.getloadavg(),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("margins", "time"))
    parser.add_argument("data")
    parser.add_argument("--model", default="cnn-small")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--views", type=int, default=1)
    parser.add_argument("--modes", default="auto,explicit,streamed,ghost", help="margins: the paths to force")
    parser.add_argument("--baseline", default="HEAD", help="time: the git ref to compare with")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    margins(args) if args.what == "margins" else timing(args)


if __name__ == "__main__":
    main()
