"""The floating-point bounds hold on adversarial inputs, and each precision format rounds as stated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpscale.errors import InvalidConfigError
from dpscale.privacy.checks import check_clip_norm
from dpscale.privacy.clipping import hold
from dpscale.privacy.rounding import (
    BLOCK,
    FORMATS,
    ClipPrecision,
    blocked_depth,
    blocked_sum,
    contract,
    inflate,
    norm_bound,
    upper_sum,
    upper_sum_of_squares,
)


def _vectors():
    """Rows of 2^18 floats whose squares a float32 sum gets wrong in every way it can."""
    rng = np.random.default_rng(0)
    n = 2**18
    return np.stack(
        [
            np.full(n, 1 + 2.0**-12),  # every square rounds, in the same direction
            rng.normal(size=n),
            np.where(np.arange(n) == 0, 1e3, 1e-3),  # one large term, then many small ones
            rng.normal(size=n) * 10.0 ** rng.uniform(-19, 19, n),  # scales from 1e-19 to 1e19
            np.full(n, 1e-20),  # squares underflow
            rng.normal(size=n) * 1e-40,  # subnormal inputs
        ]
    ).astype(np.float32)


def test_sums_of_squares_are_bounded_above_and_closely():
    x = _vectors()
    exact = np.sum(np.asarray(x, np.float64) ** 2, axis=1)
    bound = np.asarray(jax.jit(upper_sum_of_squares)(jnp.asarray(x)), np.float64)
    assert np.all(bound >= exact)
    normal = (exact > 1e-30) & (exact < 3e38)  # the bound of an overflowing sum is inf
    assert np.all(bound[normal] <= exact[normal] * (1 + 2e-5))  # blocked: gamma of a few hundred, not of 2^18


def test_a_norm_too_large_for_float32_is_infinite_not_wrong():
    x = jnp.asarray([[1e20, 1.0], [3.0, 4.0]], jnp.float32)
    bound = np.asarray(norm_bound([upper_sum_of_squares(x)]))
    assert np.isinf(bound[0]) and 5.0 <= bound[1] <= 5.0 * (1 + 1e-6)


def test_blocked_sums_and_their_depth():
    for n in (1, 2, BLOCK, BLOCK + 1, BLOCK**2, BLOCK**2 + 3, 10**6):
        x = jnp.ones((2, n), jnp.float32)
        total, depth = blocked_sum(x)
        assert np.all(np.asarray(total) == n) and depth == blocked_depth(n)
        assert depth <= 3 * BLOCK  # a million terms: three levels
    assert blocked_depth(1) == 0 and blocked_depth(BLOCK) == BLOCK - 1


def test_upper_sum_and_inflate_round_up():
    rng = np.random.default_rng(1)
    x = rng.uniform(0, 1, size=(4, 10**5)).astype(np.float32) * np.float32(10.0 ** rng.integers(-30, 30, (4, 1)))
    assert np.all(np.asarray(upper_sum(jnp.asarray(x)), np.float64) >= np.sum(np.asarray(x, np.float64), axis=1))
    values = np.float32(10.0 ** rng.uniform(-37, 37, 1000))
    for rel in (0.0, 1e-7, 1e-3):
        assert np.all(
            np.asarray(inflate(jnp.asarray(values), rel), np.float64) >= values.astype(np.float64) * (1 + rel)
        )


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_keeps_its_bits_and_its_contraction_its_error_bound(name):
    fmt = FORMATS[name]
    rng = np.random.default_rng(2)
    x = rng.normal(size=1000).astype(np.float32)
    rounded = np.asarray(fmt.round(jnp.asarray(x)), np.float64)
    assert np.all(np.abs(rounded - x) <= fmt.input_roundoff * np.abs(x))
    if fmt.input_roundoff:
        assert np.max(np.abs(rounded - x) / np.abs(x)) > fmt.input_roundoff / 4  # it does round
    # Products that cancel: A^T G with G orthogonal to A's columns, up to a small part.
    a = rng.normal(size=(64, 5)).astype(np.float32)
    null = np.linalg.svd(a.astype(np.float64))[0][:, 5:]
    g = (null @ rng.normal(size=(59, 3)) + 1e-5 * rng.normal(size=(64, 3))).astype(np.float32)
    computed = np.asarray(contract(fmt, "td,tp->dp", jnp.asarray(a), jnp.asarray(g)), np.float64)
    exact = a.astype(np.float64).T @ g.astype(np.float64)
    assert np.all(np.abs(computed - exact) <= fmt.error(64) * (np.abs(a).T @ np.abs(g)))


def test_a_precision_names_a_known_format():
    assert ClipPrecision(norms="bf16").norm_format is FORMATS["bf16"]
    with pytest.raises(InvalidConfigError, match="norm precision"):
        ClipPrecision(norms="fp8")


def test_hold_keeps_the_values_and_the_structure():
    for size in (1, 2, 3, 6, 7):
        tree = {
            "a": jnp.arange(size * 4, dtype=jnp.float32).reshape(size, 2, 2) - 3.5,
            "b": jnp.ones((size,), jnp.float32) * 1e-30,
        }
        held = jax.jit(hold)(tree)
        for key in tree:
            np.testing.assert_array_equal(np.asarray(held[key]), np.asarray(tree[key]))


def test_a_clip_norm_below_the_floor_is_refused():
    check_clip_norm(2.0**-64)
    with pytest.raises(InvalidConfigError, match="at least 2\\^-64"):
        check_clip_norm(1e-30)


def test_the_compiled_program_keeps_the_levels_and_the_loop():
    # The bounds assume each level of a blocked sum is its own reduction (BLOCK terms, any order)
    # and that a held value is a loop's output: if XLA ever merges the levels or removes the
    # loop, this fails before a bound silently stops holding.
    levels = jax.jit(lambda x: blocked_sum(x)[0]).lower(jnp.ones((2, BLOCK**3))).compile().as_text()
    assert levels.count(" reduce(") == 3
    loop = jax.jit(hold).lower(jnp.ones((8, 5))).compile().as_text()
    assert " while(" in loop
