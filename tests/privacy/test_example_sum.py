"""The sum over examples: its order, its depth, the clip's room for it, and the exact two-float sum
that adds a step's micro-batches."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpscale.privacy.example_sum import (
    SUM_BLOCK,
    StepSums,
    pairwise_sum,
    room,
    step_sums,
    sum_depth,
    sum_scale,
    two_sum,
    weighted_outer_sum,
    weighted_sum,
)
from dpscale.privacy.rounding import U, gamma


def test_two_sum_keeps_every_rounding_error_exactly_also_compiled():
    rng = np.random.default_rng(0)
    a = (rng.normal(size=100_000) * 10.0 ** rng.integers(-8, 9, size=100_000)).astype(np.float32)
    b = (rng.normal(size=100_000) * 10.0 ** rng.integers(-8, 9, size=100_000)).astype(np.float32)
    for fn in (two_sum, jax.jit(two_sum)):
        s, e = fn(jnp.asarray(a), jnp.asarray(b))
        exact = a.astype(np.float64) + b.astype(np.float64)
        np.testing.assert_array_equal(np.asarray(s, np.float64) + np.asarray(e, np.float64), exact)
        assert np.count_nonzero(np.asarray(e)) > 1000  # the float32 sums did round


def test_pairwise_sum_adds_every_row_and_the_depth_grows_a_level_a_doubling():
    for rows in (1, 2, 3, 7, 8, 9, 100):
        x = jnp.asarray(np.arange(rows * 3, dtype=np.float32).reshape(rows, 3))
        np.testing.assert_array_equal(pairwise_sum(x), np.asarray(x).sum(axis=0))
    assert sum_depth(1) >= SUM_BLOCK and all(sum_depth(2 * n) == sum_depth(n) + 1 for n in (8, 64, 1024))


def test_weighted_sums_equal_the_exact_ones_and_zero_non_finite_rows():
    rng = np.random.default_rng(1)
    n, f, o = 37, 5, 3
    x, g = rng.normal(size=(n, f)).astype(np.float32), rng.normal(size=(n, o)).astype(np.float32)
    w = rng.uniform(size=n).astype(np.float32)
    finite = np.ones(n, bool)
    finite[4], x[4, 0] = False, np.nan
    exact = np.einsum(
        "nf,no->fo", np.where(finite[:, None], x, 0).astype(np.float64), (g * w[:, None]).astype(np.float64)
    )
    got = weighted_outer_sum(jnp.asarray(x), jnp.asarray(g), jnp.asarray(w), jnp.asarray(finite))
    np.testing.assert_allclose(np.asarray(got), exact, rtol=1e-5, atol=1e-6)
    v = rng.normal(size=(n, 4, 2)).astype(np.float32)
    v[4] = np.inf
    exact = np.einsum("n,nab->ab", w.astype(np.float64), np.where(finite[:, None, None], v, 0).astype(np.float64))
    np.testing.assert_allclose(
        np.asarray(weighted_sum(jnp.asarray(v), jnp.asarray(w), jnp.asarray(finite))), exact, rtol=1e-5, atol=1e-6
    )
    # Long enough for weighted_outer_sum's chunks: the same sum.
    big = 5000
    x, g, w = (rng.normal(size=s).astype(np.float32) for s in ((big, f), (big, o), big))
    got = weighted_outer_sum(jnp.asarray(x), jnp.asarray(g), jnp.asarray(w), jnp.ones(big, bool))
    np.testing.assert_allclose(
        np.asarray(got),
        np.einsum("nf,no->fo", x.astype(np.float64), (g * w[:, None]).astype(np.float64)),
        rtol=1e-4,
        atol=1e-4,
    )


def test_the_room_is_for_the_whole_micro_batch_and_the_step():
    for n in (1, 8, 128, 4096):
        c = float(sum_scale(n))
        assert c <= 1 / (1 + 2 * gamma(sum_depth(n)) * n) and c > 1 - 3 * gamma(sum_depth(n)) * n
    assert float(room(16)) == float(sum_scale(16))  # outside a step: the micro-batch's own
    with step_sums(StepSums(slots=64, devices=4, step_slots=1024)):
        inside = float(room(16))  # one device's 16 of a micro-batch of 64, on 4 devices, 16 micro-batches
    exact = 1 / (1 + 2 * gamma(sum_depth(64) + 3) * 64 + 2 * U * 1024 + 4 * U * U * 16 * 16 * 1024)
    assert inside <= exact and inside == pytest.approx(exact, rel=1e-7)
    assert inside < float(sum_scale(64)) < float(sum_scale(16))
    assert math.isclose(1 - inside, 2 * gamma(sum_depth(64) + 3) * 64 + 2 * U * 1024, rel_tol=1e-3)
