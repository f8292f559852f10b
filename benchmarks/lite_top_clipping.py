"""The clipped sum of an EfficientNet-Lite0 top above a cut: per layer vs vmap(grad) vs non-private (run by hand).

    python -m benchmarks.lite_top_clipping --cuts blocks_15 blocks_14 --batch 64 --rounds 7

The top ``pretrained`` above each cut (``models.cuts``; a random-init backbone: the time does not
depend on the weights) on Gaussian activations ``(batch, 1, 7, 7, C)`` (K = 1; 7 x 7 is the cut's
size at 224 px). Three jitted functions of one micro-batch, compilation excluded, called in turn
A B C A B C ... in one process so that the machine's load hits all alike: the per-layer clipped sum
(``privacy.ghost``, book-keeping where a layer has no ghost path), the ``vmap(grad)`` clipped sum
(``privacy.clipping``, what a model without per-layer rules gets) and the non-private batch gradient.
Prints one JSON line per cut: the median seconds of each and its examples/s, and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _top(cut: str, size: int):
    import jax
    import jax.numpy as jnp
    import optax

    from dpscale.models import cuts, registry

    model = registry.get_model("efficientnet-lite0", num_classes=10)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
    channels = jax.eval_shape(cuts.activations_fn(model, cut, variables), jnp.zeros((1, 224, 224, 3))).shape[-1]
    shape = (7, 7, channels)
    top = cuts.build_top(model, cut, "pretrained", variables=variables, num_classes=10, activation_shape=shape)
    params = jax.tree.map(lambda a: a + 0.01, top.init_params(0))  # a zero classifier zeroes the other gradients

    def loss_fn(p, state, views):
        logits = top.model.apply({"params": p, **state}, views["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, views["label"]).mean()

    batch = {
        "image": jax.random.normal(jax.random.key(1), (size, 1, *shape)),
        "label": jnp.arange(size).reshape(size, 1) % 10,
    }
    return loss_fn, params, top.model_state, batch


def measure(cut: str, size: int, rounds: int) -> dict:
    import jax
    import jax.numpy as jnp

    from dpscale.privacy.clipping import make_clipped_sum_fn
    from dpscale.privacy.ghost import make_ghost_clipped_sum_fn
    from dpscale.privacy.tuning.choose import chooser

    loss_fn, params, state, batch = _top(cut, size)
    mask = jnp.ones(size)
    example = (params, state, batch)
    per_layer = make_ghost_clipped_sum_fn(
        loss_fn, clip_norm=1.0, example=example, choose=chooser(loss_fn, example=example)
    )
    fns = {
        "per_layer": jax.jit(per_layer),
        "vmap": jax.jit(make_clipped_sum_fn(loss_fn, clip_norm=1.0)),
        "non_private": jax.jit(jax.grad(lambda p, s, b, m: jnp.sum(m * jax.vmap(lambda v: loss_fn(p, s, v))(b)))),
    }
    for fn in fns.values():  # compile and warm up
        jax.block_until_ready(fn(params, state, batch, mask))
    times: dict[str, list[float]] = {name: [] for name in fns}
    load = [os.getloadavg()[0]]
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(params, state, batch, mask))
            times[name].append(time.perf_counter() - start)
    load.append(os.getloadavg()[0])
    median = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "cut": cut,
        "batch": size,
        "rounds": rounds,
        "seconds": {k: round(v, 4) for k, v in median.items()},
        "examples_per_s": {k: round(size / v, 1) for k, v in median.items()},
        "paths": sorted({f"{c.kind}: {c.strategy}" for c in per_layer.layers}),
        "load_1min_before_after": [round(x, 2) for x in load],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuts", nargs="+", default=["blocks_15", "blocks_14"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    for cut in args.cuts:
        print(json.dumps(measure(cut, args.batch, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
