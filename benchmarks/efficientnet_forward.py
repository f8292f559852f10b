"""EfficientNet-Lite0 forward throughput (images/s) in Flax under jit, optionally vs PyTorch (by hand).

Featurizing a data set with the frozen backbone is one forward pass per image, so this
bounds the featurize stage. Weights are random (speed does not depend on them).

    python -m benchmarks.efficientnet_forward --batch 32 --resolutions 128,224 --torch --depthwise --grad \\
        --output efficientnet_forward.md

``--torch`` times the published PyTorch definition (``pip install efficientnet_lite_pytorch``)
with ``torch.set_num_threads(1)`` and ``(2)``, and checks the imported weights' logits against it.
The machine is shared, so the 1-minute load average is recorded next to the numbers. The figures that
stand go, with the command and the commit, into the table at the top of
``benchmarks/results/efficientnet_forward.md``.
"""

from __future__ import annotations

import argparse
import functools
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


def grad_throughput(batch: int, size: int, *, min_seconds: float) -> tuple[float, float]:
    """(per-example vmap(grad), batched grad) examples/s of cross-entropy on all parameters.

    The per-example form is what DP-SGD fine-tuning of the whole network needs; frozen
    BatchNorm statistics are inputs, not parameters, so nothing mixes examples.
    """
    import optax

    model = efficientnet_lite.efficientnet_lite(NAME, num_classes=10)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(batch, size, size, 3)), jnp.float32)
    y = jnp.arange(batch) % 10
    abstract = jax.eval_shape(model.init, jax.random.key(0), x[:1])
    variables = jax.tree.map(lambda s: jnp.asarray(0.05 * rng.normal(size=s.shape), jnp.float32), abstract)
    stats = variables["batch_stats"]

    def loss(params, image, label):
        logits = model.apply({"params": params, "batch_stats": stats}, image[None])
        return optax.softmax_cross_entropy_with_integer_labels(logits, label[None]).mean()

    per_example = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))
    batched = jax.jit(jax.grad(lambda p, xs, ys: jnp.mean(jax.vmap(loss, in_axes=(None, 0, 0))(p, xs, ys))))
    params = variables["params"]
    rates = [
        _time(lambda f=f: jax.block_until_ready(f(params, x, y)), min_seconds=min_seconds, batch=batch)[0]
        for f in (per_example, batched)
    ]
    print(f"grad {size}x{size} batch {batch}: per-example {rates[0]:.1f} ex/s, batched {rates[1]:.1f} ex/s")
    return rates[0], rates[1]


# (spatial size, channels, kernel, stride) of some Lite0 depthwise layers at 128x128 input.
_DEPTHWISE_SHAPES = ((64, 32, 3, 1), (64, 96, 3, 2), (32, 144, 5, 1), (16, 240, 3, 1), (8, 672, 5, 1))


def depthwise_comparison(batch: int, *, repeats: int = 5) -> list[tuple[tuple[int, ...], float, float]]:
    """ms per call: XLA grouped convolution vs the shifted multiply-add ``DepthwiseConv``."""
    rows = []
    rng = np.random.default_rng(2)
    for size, channels, kernel, stride in _DEPTHWISE_SHAPES:
        x = jnp.asarray(rng.normal(size=(batch, size, size, channels)), jnp.float32)
        layer = efficientnet_lite.DepthwiseConv(kernel, stride)
        variables = {"params": {"kernel": jnp.asarray(rng.normal(size=(kernel, kernel, 1, channels)), jnp.float32)}}
        grouped = jax.jit(
            lambda v, x, s=stride, c=channels: jax.lax.conv_general_dilated(
                x,
                v["params"]["kernel"],
                (s, s),
                "SAME",
                dimension_numbers=("NHWC", "HWIO", "NHWC"),
                feature_group_count=c,
            )
        )
        shifted = jax.jit(layer.apply)
        times = []
        for fn in (grouped, shifted):
            fn(variables, x).block_until_ready()
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn(variables, x).block_until_ready()
            times.append(1000 * (time.perf_counter() - t0) / repeats)
        rows.append(((size, channels, kernel, stride), times[0], times[1]))
        print(
            f"depthwise {size}x{size}x{channels} k{kernel} s{stride}: grouped {times[0]:.1f} ms, "
            f"shifted {times[1]:.1f} ms"
        )
    return rows


def published_max_diff() -> list[tuple[str, int, float]]:
    """Max |logit difference| of the imported weights vs the published PyTorch definition, native size.

    The CI test compares against a minimal reference written in the test; this checks the
    actual ``efficientnet_lite_pytorch`` code (static TF-SAME padding for its native size).
    """
    import torch
    from efficientnet_lite_pytorch import EfficientNet

    from dpscale.models import efficientnet_import

    rows = []
    for name, variant in efficientnet_lite.VARIANTS.items():
        path = efficientnet_import.find_state_dict_file(name)
        reference = EfficientNet.from_pretrained(name, weights_path=str(path)).eval()
        state = efficientnet_import.load_torch_state_dict(path, name=name)
        variables = efficientnet_import.convert_state_dict(state, name=name)
        size = variant.resolution
        x = efficientnet_import.preprocessing_for(name).normalize(
            np.random.default_rng(3).uniform(0, 255, size=(2, size, size, 3))
        )
        with torch.inference_mode():
            expected = reference(torch.from_numpy(np.asarray(x).transpose(0, 3, 1, 2).copy())).numpy()
        logits = jax.jit(efficientnet_lite.efficientnet_lite(name).apply)(variables, x)
        rows.append((name, size, float(np.max(np.abs(np.asarray(logits) - expected)))))
        print(f"{name} at {size}: max |logit diff| vs efficientnet_lite_pytorch = {rows[-1][2]:.2e}")
    return rows


def torch_forward(batch: int, size: int, *, min_seconds: float, threads: int) -> tuple[float, float]:
    import torch
    from efficientnet_lite_pytorch import EfficientNet

    torch.set_num_threads(threads)
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
    parser.add_argument("--torch-threads", default="1,2", help="torch.set_num_threads values to time")
    parser.add_argument("--output", default=None, help="write a markdown report here")
    parser.add_argument("--depthwise", action="store_true", help="also compare depthwise conv implementations")
    parser.add_argument("--grad", action="store_true", help="also time per-example vs batched gradients at 128")
    parser.add_argument("--grad-batch", type=int, default=8)
    args = parser.parse_args()

    depthwise = depthwise_comparison(args.batch) if args.depthwise else []
    published = published_max_diff() if args.torch else []
    grads = grad_throughput(args.grad_batch, 128, min_seconds=args.min_seconds) if args.grad else None

    rows = []
    for size in (int(r) for r in args.resolutions.split(",")):
        frameworks = [("flax (jax.jit)", flax_forward)]
        if args.torch:
            frameworks += [
                (f"pytorch, {n} thread(s)", functools.partial(torch_forward, threads=int(n)))
                for n in args.torch_threads.split(",")
            ]
        for label, fn in frameworks:
            load_before = os.getloadavg()[0]
            median, best = fn(args.batch, size, min_seconds=args.min_seconds)
            row = (size, label, median, best, max(load_before, os.getloadavg()[0]))
            rows.append(row)
            print(f"{size}x{size} {label:<20} median {median:7.1f} img/s  best {best:7.1f} img/s  load {row[4]:.1f}")

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
        if depthwise:
            lines += [
                "",
                f"Depthwise convolution alone (batch {args.batch}, ms per call): XLA grouped convolution vs",
                "`DepthwiseConv` (k*k shifted multiply-adds), which the model uses.",
                "",
                "| input (HxWxC) | kernel | stride | grouped conv ms | shifted ms |",
                "|---|---|---|---|---|",
            ]
            lines += [f"| {h}x{h}x{c} | {k} | {st} | {g:.1f} | {sh:.1f} |" for (h, c, k, st), g, sh in depthwise]
        if grads:
            lines += [
                "",
                f"Gradients of all parameters at 128x128, batch {args.grad_batch} (examples/s, median):",
                f"per-example `vmap(grad)` {grads[0]:.1f}, batched `grad` {grads[1]:.1f}, "
                f"ratio {grads[1] / grads[0]:.2f}.",
            ]
        if published:
            lines += [
                "",
                "Correctness alongside (needs the weight packages): imported ImageNet weights, Flax logits vs the",
                "published PyTorch definition (`efficientnet_lite_pytorch`), batch 2 of uniform-noise pixels,",
                "at each model's native resolution.",
                "",
                "| model | resolution | max abs logit difference |",
                "|---|---|---|",
            ]
            lines += [f"| {name} | {size} | {diff:.1e} |" for name, size, diff in published]
        with open(args.output, "w") as handle:
            handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
