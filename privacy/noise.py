"""Gaussian noise: every Gaussian draw of dpscale's mechanisms comes from this module.

DP-SGD's noise keys are derived statelessly: ``step_key(noise_key, step)``, where the noise
key is the run's ``Stream.NOISE`` (``privacy.streams``). Each optimiser step therefore gets
its own key (no two steps share noise), and a resumed run at step t draws exactly the noise
it would have drawn without the interruption, never replaying an earlier step's. One-off
releases (``gaussian_release``) draw from a stream of their own. The seed comes from
``seeds.resolve_seed``: fresh OS entropy unless a fixed seed is explicitly chosen.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap

from dpscale.errors import InvalidConfigError

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
    """N(0, 1) as the sum of ``SUMMANDS`` independent draws, halved (added in a fixed order).

    Each draw is what ``jax.random.normal`` computes for float32 (23 uniform bits through
    ``erf_inv``), but its bits come from XLA's native threefry generator (``_native_bits``),
    packed (``summand_bits``): JAX's threefry, written as array operations, made the four
    draws cost several times one draw; ``benchmarks/results/noise_cost.md`` has what they cost now.
    """
    total = None
    for bits in summand_bits(key, shape):
        z = _normal_from_bits(bits)
        total = z if total is None else total + z
    return (total * np.float32(1 / np.sqrt(SUMMANDS))).astype(dtype)


def summand_bits(key: jax.Array, shape: tuple[int, ...]) -> list[jax.Array]:
    """The uint32 words of the ``SUMMANDS`` draws; only the top 23 bits of each are used.

    Four draws need 4 x 23 = 92 random bits per value, so three 32-bit words suffice: the
    first three draws take the top 23 bits of one word each, the fourth is made of the three
    words' otherwise unused low bits (9 + 9 + 5). The generator is what the noise costs, and
    this draws 25% fewer words than one word per draw.
    """
    assert SUMMANDS == 4, "the packing below is written for four draws"
    words = _native_bits(jax.random.bits(key, (4,), jnp.uint32), (3, *shape))
    low = (words[0] & np.uint32(0x1FF)) | ((words[1] & np.uint32(0x1FF)) << 9) | ((words[2] & np.uint32(0x1F)) << 18)
    return [words[0], words[1], words[2], low << 9]


def _normal_from_bits(bits: jax.Array) -> jax.Array:
    """float32 N(0, 1) from uint32 words, exactly as ``jax.random.normal`` maps its bits."""
    one = lax.bitcast_convert_type((bits >> 9) | np.uint32(0x3F800000), jnp.float32)
    lo = np.nextafter(np.float32(-1), np.float32(0))
    uniform = jnp.maximum(lo, (one - np.float32(1)) * (np.float32(1) - lo) + lo)
    return np.float32(np.sqrt(2)) * lax.erf_inv(uniform)


def _native_bits(state: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 words of ``shape`` from XLA's threefry seeded with the 128-bit ``state``.

    A deterministic function of ``state`` alone, also under ``vmap``: JAX batches
    ``rng_bit_generator`` by keeping only the *first* state and drawing one larger block,
    so vmapped models (the privacy audit trains thousands) would silently ignore their
    own keys. The rule below draws each model's words from its own state instead.
    XLA promises the same words for the same state on one backend and version, not across
    them: a run resumed under another jax/XLA draws other (still fresh, never reused) noise.
    """
    return _bits_for(shape)(state)


@functools.cache
def _bits_for(shape: tuple[int, ...]):
    """One ``custom_vmap`` function per output shape (the shape must stay static)."""

    @custom_vmap
    def draw(state: jax.Array) -> jax.Array:
        return lax.rng_bit_generator(state, shape, jnp.uint32, algorithm=lax.RandomAlgorithm.RNG_THREE_FRY)[1]

    @draw.def_vmap
    def _each_state_its_own(axis_size: int, in_batched: list[bool], state: jax.Array):
        if not in_batched[0]:
            return draw(state), False
        return lax.map(draw, state), True

    return draw


def add_gaussian_noise(tree: PyTree, key: jax.Array, *, std: float | jax.Array) -> PyTree:
    """``tree + N(0, std^2 I)`` leaf by leaf, rounded to multiples of ``std * 2^-GRID_BITS``.

    The sum and the rounding are done in float32 whatever the leaf's dtype, then cast back:
    in bfloat16 the grid is finer than the format (the rounding would do nothing and the
    reachable outputs would depend on the data again) and in float16 the division overflows.
    The final cast is post-processing of the rounded float32 value.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(key, len(leaves))
    unit = std * 2.0**-GRID_BITS
    noisy = [
        (jnp.round((x.astype(jnp.float32) + std * standard_normal(k, x.shape)) / unit) * unit).astype(x.dtype)
        for k, x in zip(keys, leaves)
    ]
    return jax.tree_util.tree_unflatten(treedef, noisy)


def gaussian_release(
    value: np.ndarray, key: jax.Array, *, noise_multiplier: float, sensitivity: float = 1.0
) -> np.ndarray:
    """A one-off Gaussian mechanism: ``value + N(0, (noise_multiplier * sensitivity)^2 I)``.

    ``value`` must have L2 sensitivity ``sensitivity`` under adding or removing one
    example; the release's cost is the caller's to put in the run's ``releases``.
    """
    if not (noise_multiplier > 0 and sensitivity > 0 and np.isfinite(noise_multiplier * sensitivity)):
        raise InvalidConfigError(
            f"a Gaussian release needs a positive, finite noise scale, got "
            f"noise_multiplier={noise_multiplier}, sensitivity={sensitivity}"
        )
    value = np.asarray(value, np.float32)
    noisy = add_gaussian_noise(jnp.asarray(value), key, std=noise_multiplier * sensitivity)
    return np.asarray(noisy, np.float32)
