"""Clipped sums for a softmax-regression last layer, without per-example gradients.

For logits ``z_i = W^T x_i + b`` and cross-entropy loss, the per-example gradient is
``(x_i r_i^T, r_i)`` with ``r_i = softmax(z_i) - onehot(y_i)``, so its squared norm
is ``(||x_i||^2 + 1) * ||r_i||^2`` in closed form, and the clipped sum is one
matrix product ``X^T (w * R)`` (in blocks of examples). Nothing of size [batch, d, classes] is ever
materialised: at batch 2^18 and d=1280, ``vmap(grad)`` would hold 2^18 x 12,810 per-example
gradients (12.5 GiB), while this costs about as much as the non-private gradient
(benchmarks/results/peers.md). No library computes this for JAX, hence hand-written; it is tested against the
generic per-example path.

Parameters are a Flax ``Dense`` layer's: ``{"kernel": [d, c], "bias": [c]}``;
batches are ``{"features": [b, d], "label": [b]}`` (features are cached, so there
is no augmentation axis), optionally with ``"features_sq_norm": [b]``, the rows'
squared norms. Cached features never change, so the feed computes ``||x_i||^2``
once per dataset; without it every step makes one more pass over ``X`` (1.3 GB at
2^18 x 1280) than the non-private step. It must be a float32
sum of the d squares, in any order (``training.feeds.FeatureFeed``'s): its rounding, at most
``gamma_d`` relative, is part of the norm's bound.

Floating point: the clip weights come from a proven upper bound of ``||(x_i r_i^T, r_i)||`` for
the float32 ``x_i`` and ``r_i`` that are summed (``privacy.rounding``), and the sum's products
run at full float32 (a TF32 default would round each ``x_i`` beyond the bound).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpscale.privacy.checks import check_clip_norm
from dpscale.privacy.clipping import ClippedSum, ClippedSumFn, clip_weights, hold
from dpscale.privacy.example_sum import weighted_outer_sum, weighted_sum
from dpscale.privacy.rounding import TINY, U, gamma, inflate, monotone, upper_sqrt, upper_sum_of_squares

PyTree = Any


def softmax_regression_clipped_sum(*, clip_norm: float) -> ClippedSumFn:
    """The clipped sum of a linear softmax classifier in closed form, sensitivity 1."""
    check_clip_norm(clip_norm)

    def clipped_sum(params: PyTree, model_state: PyTree, batch: PyTree, mask: jax.Array) -> ClippedSum:
        del model_state
        x = batch["features"].astype(jnp.float32)
        logits = x @ params["kernel"] + params["bias"]
        log_probs = jax.nn.log_softmax(logits)
        onehot = jax.nn.one_hot(batch["label"], logits.shape[-1], dtype=logits.dtype)
        residual = hold(jnp.exp(log_probs) - onehot)  # the norm and the sum read the same residuals
        losses = -jnp.sum(onehot * log_probs, axis=-1)
        given = batch.get("features_sq_norm")
        if given is None:
            sq_x = upper_sum_of_squares(x)
        else:  # a float32 sum of d squares in any order: within gamma_(d+1), plus underflow
            d = x.shape[-1]
            sq_x = inflate(given.astype(jnp.float32) + np.float32(8 * d * TINY), gamma(d + 1) + U)
        norms = upper_sqrt(monotone((sq_x + 1.0) * upper_sum_of_squares(residual), 2))
        weights, finite = clip_weights(norms, mask, clip_norm=clip_norm)
        # A zero weight alone does not stop NaN (0 * NaN = NaN): non-finite rows of X and R are
        # zeroed too, on every step (no branch on the data: a step's time must not say whether it
        # sampled such a row). ``training.feeds.FeatureFeed`` zeroes them once on the host, so
        # there this select finds nothing to do. The sums run in blocks of examples
        # (``privacy.example_sum``): one matrix product over the whole micro-batch would round by
        # an amount that grows with its length and with the other examples' features.
        kernel_grad = weighted_outer_sum(x, residual, weights, finite)
        bias_grad = weighted_sum(residual, weights, finite)
        real = mask > 0
        return ClippedSum(
            value={"kernel": kernel_grad, "bias": bias_grad},
            num_examples=jnp.sum(real).astype(jnp.int32),
            num_clipped=jnp.sum(real & finite & (norms > clip_norm)).astype(jnp.int32),
            num_nonfinite=jnp.sum(real & ~finite).astype(jnp.int32),
            sum_of_norms=jnp.sum(jnp.where(real & finite, norms, 0.0)),
            sum_of_losses=jnp.sum(jnp.where(real & finite, losses, 0.0)),
        )

    return ClippedSumFn(clipped_sum, sensitivity=1.0)
