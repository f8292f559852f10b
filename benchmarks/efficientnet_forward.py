"""EfficientNet-Lite0 forward throughput (images/s) in Flax under jit, optionally vs PyTorch (by hand).

Featurizing a data set with the frozen backbone is one forward pass per image, so this
bounds the featurize stage. Weights are random (speed does not depend on them).

    python benchmarks/efficientnet_forward.py --batch 32 --resolutions 128,224 --torch \\
        --output benchmarks/results/efficientnet_forward.md

``--torch`` times the published PyTorch definition (``pip install efficientnet_lite_pytorch``)
with ``torch.set_num_threads(2)``. The machine is shared, so the 1-minute load average
is recorded next to the numbers.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dpscale.models import efficientnet_lite

NAME = "efficientnet-lite0"


def _time(run: Callable[[], object], *, min_seconds: float, batch: int) -> tuple[float, float]:
    """(median, best) images/s over repeated calls after one warm-up call."""
    run()
    rates, start = [], time.perf_counter()
    while time.perf_counter() - start < min_seconds or len(rates) < 3:
        t0 = time.perf_counter()
        run()
        rates.append(batch / (time.perf_counter() - t0))
    return float(np.median(rates)), float(np.max(rates))


def flax_forward(batch: int, size: int, *, min_seconds: float) -> tuple[float, float]:
    model = efficientnet_lite.efficientnet_lite(NAME)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(batch, size, size, 3)), jnp.float32)
    abstract = jax.eval_shape(model.init, jax.random.key(0), x[:1])
    rng = np.random.default_rng(1)
    variables = jax.tree.map(lambda s: jnp.asarray(0.05 * rng.normal(size=s.shape), jnp.float32), abstract)
    apply = jax.jit(model.apply)
    return _time(lambda: apply(variables, x).block_until_ready(), min_seconds=min_seconds, batch=batch)


def torch_forward(batch: int, size: int, *, min_seconds: float) -> tuple[float, float]:
    import torch
    from efficientnet_lite_pytorch import EfficientNet

    torch.set_num_threads(2)
    model = EfficientNet.from_name(NAME, image_size=size).eval()
    x = torch.randn(batch, 3, size, size)

    def run() -> None:
        with torch.inference_mode():
            model(x)

    return _time(run, min_seconds=min_seconds, batch=batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--resolutions", default="128,224")
    parser.add_argument("--min-seconds", type=float, default=10.0)
    parser.add_argument("--torch", action="store_true", help="also time the PyTorch reference")
    parser.add_argument("--output", default=None, help="write a markdown report here")
    args = parser.parse_args()

    rows = []
    for size in (int(r) for r in args.resolutions.split(",")):
        frameworks = [("flax (jax.jit)", flax_forward)] + ([("pytorch", torch_forward)] if args.torch else [])
        for label, fn in frameworks:
            load_before = os.getloadavg()[0]
            median, best = fn(args.batch, size, min_seconds=args.min_seconds)
            row = (size, label, median, best, max(load_before, os.getloadavg()[0]))
            rows.append(row)
            print(f"{size}x{size} {label:<15} median {median:7.1f} img/s  best {best:7.1f} img/s  load {row[4]:.1f}")

    if args.output:
        lines = [
            "# EfficientNet-Lite0 forward throughput",
            "",
            "Command:",
            "",
            "```",
            "python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]),
            "```",
            "",
            f"CPU: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), shared with other "
            "jobs; the load average (1 min) is recorded per row. jax "
            f"{jax.__version__}; batch {args.batch}; random weights; float32.",
            "",
            "| resolution | framework | images/s (median) | images/s (best) | load avg |",
            "|---|---|---|---|---|",
        ]
        lines += [f"| {s}x{s} | {lab} | {med:.1f} | {best:.1f} | {load:.1f} |" for s, lab, med, best, load in rows]
        with open(args.output, "w") as handle:
            handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
