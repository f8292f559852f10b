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


def gaussian_like(tree: PyTree, key: jax.Array, *, std: float | jax.Array) -> PyTree:
    """Independent N(0, std^2) noise with the structure, shapes and dtypes of ``tree``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(key, len(leaves))
    noise = [std * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(treedef, noise)


def add_gaussian_noise(tree: PyTree, key: jax.Array, *, std: float | jax.Array) -> PyTree:
    """``tree + N(0, std^2 I)``, leaf by leaf."""
    noise = gaussian_like(tree, key, std=std)
    return jax.tree_util.tree_map(jnp.add, tree, noise)


def gaussian_release(value: np.ndarray, key: jax.Array, *, noise_multiplier: float,
                     sensitivity: float = 1.0) -> np.ndarray:
    """A one-off Gaussian mechanism: ``value + N(0, (noise_multiplier * sensitivity)^2 I)``.

    ``value`` must have L2 sensitivity ``sensitivity`` under adding or removing one
    example; the release's cost is the caller's to put in the run's ``releases``.
    """
    value = np.asarray(value, np.float32)
    noisy = add_gaussian_noise(jnp.asarray(value), key, std=noise_multiplier * sensitivity)
    return np.asarray(noisy, np.float32)
