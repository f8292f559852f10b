"""The review's case of issue 62, measured: how far one example moves a WS layer's clipped sum among others.

    python -m benchmarks.review_case [--batch 128] [--views 1]

One WS convolution (3x3x64 -> 2), ``--batch`` examples: all but one with their gradients along the
standardised kernel at 1e7, example j a random image, for every j; prints the largest float64
||S(D) - S(D \\ {j})|| on each path (j's slot masked: the sampler's neighbour). One-off: the test that
holds the bound is tests/privacy/test_neighbouring_batches.py.
"""

from __future__ import annotations

import argparse


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import linen as nn

    from dpscale.models.layers import WSConv, standardize_kernel
    from dpscale.privacy.clipping import make_clipped_sum_fn
    from dpscale.privacy.ghost import make_ghost_clipped_sum_fn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--views", type=int, default=1)
    args = parser.parse_args()

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return WSConv(2, 3, padding="VALID", name="conv")(x)

    rng = np.random.default_rng(0)
    kernel = jnp.asarray(rng.normal(size=(3, 3, 64, 2)), jnp.float32)
    params = {"conv": {"kernel": kernel}}
    w = np.asarray(standardize_kernel(kernel, eps=1e-5))[..., 0]

    def loss_fn(p, state, views):
        y = Layer().apply({"params": p}, views["input"])
        return jnp.mean(jnp.sum((y * views["target"]).reshape(y.shape[0], -1), axis=1))

    b, k = args.batch, args.views
    inputs = np.repeat((w * 1e7 * (1 + 1e-3 * rng.normal(size=(b,) + w.shape)))[:, None], k, axis=1)
    targets = np.zeros((b, k, 1, 1, 2))
    targets[..., 0] = 1.0
    fns = {"vmap": make_clipped_sum_fn(loss_fn, clip_norm=1.0)}
    for path in ("explicit", "grouped", "streamed", "ghost"):
        fns[path] = make_ghost_clipped_sum_fn(loss_fn, clip_norm=1.0, strategies={("conv",): path})
    for path, fn in fns.items():
        summed = jax.jit(lambda batch, mask, fn=fn: fn(params, {}, batch, mask).value)
        worst = 0.0
        for j in range(b):
            x, t = inputs.copy(), targets.copy()
            x[j], t[j] = rng.normal(size=x[j].shape), rng.normal(size=t[j].shape)
            batch = {"input": jnp.asarray(x, jnp.float32), "target": jnp.asarray(t, jnp.float32)}
            with_j, without_j = summed(batch, jnp.ones(b)), summed(batch, jnp.ones(b).at[j].set(0.0))
            diff = [
                np.asarray(p, np.float64) - np.asarray(q, np.float64)
                for p, q in zip(jax.tree.leaves(with_j), jax.tree.leaves(without_j))
            ]
            worst = max(worst, float(np.sqrt(sum(np.sum(d * d) for d in diff))))
        print(f"{path}: largest ||S(D) - S(D')|| over {b} choices of j: {worst:.6f}", flush=True)


if __name__ == "__main__":
    main()
