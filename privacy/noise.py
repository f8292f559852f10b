"""Gaussian noise: every Gaussian draw of dpscale's mechanisms comes from this module.

DP-SGD's noise keys are derived statelessly: ``step_key(noise_key, step)``, where the noise
key is the run's ``Stream.NOISE`` (``privacy.streams``). Each optimiser step therefore gets
its own key (no two steps share noise), and a resumed run at step t draws exactly the noise
it would have drawn without the interruption, never replaying an earlier step's. One-off
releases (``gaussian_release``) draw from a stream of their own. The seed comes from
``seeds.resolve_seed``: fresh OS entropy unless a fixed seed is explicitly chosen.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def key_from_seed(seed: int) -> jax.Array:
    """A threefry key holding all 64 bits of ``seed``.

    ``jax.random.key(seed)`` keeps only the low 32 bits when x64 is disabled (the
    default), which would silently cut the entropy of a 63-bit seed; packing both
    32-bit words into the key data keeps all of it.
    """
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    words = np.array([seed >> 32, seed & 0xFFFFFFFF], dtype=np.uint32)
    return jax.random.wrap_key_data(words, impl="threefry2x32")


def step_key(base_key: jax.Array, step: int | jax.Array) -> jax.Array:
    """The noise key of optimiser step ``step`` (0-based): one fresh key per step."""
    return jax.random.fold_in(base_key, step)


# Why not one ``jax.random.normal`` draw: it maps 23 random bits to a float32, so its values
# form a fixed set of 2^23 points ("a lattice", cut at about +-5.4). An output that is the
# data's contribution plus such noise can fall where no noise value alone could put it: for a
# parameter only one example moves, that happens for ~89% of the steps that example is in,
# and reveals it (Mironov 2012; Jin et al. 2022). Two changes close it, tested in
# tests/privacy/test_noise_lattice.py:
# * the noise is the sum of SUMMANDS independent draws, scaled to unit variance (Opacus's
#   secure mode makes the same choice): its values are dense at float32 resolution out to
#   about 9 standard deviations, instead of 2^23 points cut at 5.4;
# * the noisy value is rounded to a grid of std * 2^-GRID_BITS. The grid is far coarser than
#   the gaps between noise values, so every grid point within the noise's range is reachable
#   from any data value: what an observer sees never rules a data set out. The rounding is
#   post-processing of the noisy value and adds an error of std * 2^-GRID_BITS / sqrt(12).
SUMMANDS = 4
GRID_BITS = 16


def standard_normal(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """N(0, 1) as the sum of ``SUMMANDS`` independent draws, halved (added in a fixed order)."""
    keys = jax.random.split(key, SUMMANDS)
    total = jax.random.normal(keys[0], shape, dtype)
    for k in keys[1:]:
        total = total + jax.random.normal(k, shape, dtype)
    return total * jnp.asarray(1 / np.sqrt(SUMMANDS), dtype)


def add_gaussian_noise(tree: PyTree, key: jax.Array, *, std: float | jax.Array) -> PyTree:
    """``tree + N(0, std^2 I)`` leaf by leaf, rounded to multiples of ``std * 2^-GRID_BITS``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(key, len(leaves))
    unit = std * 2.0**-GRID_BITS
    noisy = [jnp.round((x + std * standard_normal(k, x.shape, x.dtype)) / unit) * unit
             for k, x in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(treedef, noisy)


def gaussian_release(value: np.ndarray, key: jax.Array, *, noise_multiplier: float,
                     sensitivity: float = 1.0) -> np.ndarray:
    """A one-off Gaussian mechanism: ``value + N(0, (noise_multiplier * sensitivity)^2 I)``.

    ``value`` must have L2 sensitivity ``sensitivity`` under adding or removing one
    example; the release's cost is the caller's to put in the run's ``releases``.
    """
    value = np.asarray(value, np.float32)
    noisy = add_gaussian_noise(jnp.asarray(value), key, std=noise_multiplier * sensitivity)
    return np.asarray(noisy, np.float32)
