"""Batch selection: Poisson sizes, uniform inclusion, fixed shapes, shuffling warns."""

import numpy as np
import pytest
from scipy import stats

from dpscale.errors import InvalidConfigError
from dpscale.privacy.sampling import (PADDING_INDEX, PoissonSampler, ShuffledSampler, batch_capacity,
                                      pad_into_microbatches)


def test_poisson_batch_sizes_follow_binomial():
    n, b, steps = 1000, 50, 3000
    sampler = PoissonSampler(num_examples=n, expected_batch_size=b, microbatch_size=16, seed=7)
    sizes = np.array([sampler.sample(t).size for t in range(steps)])
    q = b / n
    # Chi-square goodness of fit of the sizes against Binomial(n, q) on well-populated bins.
    edges = np.arange(sizes.min(), sizes.max() + 2)
    observed, _ = np.histogram(sizes, bins=edges)
    expected = stats.binom.pmf(edges[:-1], n, q) * steps
    keep = expected >= 5
    observed, expected = observed[keep], expected[keep] * observed[keep].sum() / expected[keep].sum()
    _, p_value = stats.chisquare(observed, expected)
    assert p_value > 1e-4
    assert abs(sizes.mean() - n * q) < 5 * np.sqrt(n * q * (1 - q) / steps)


def test_every_example_is_included_with_probability_q():
    n, b, steps = 200, 20, 4000
    sampler = PoissonSampler(num_examples=n, expected_batch_size=b, microbatch_size=8, seed=1)
    counts = np.zeros(n)
    for t in range(steps):
        batch = sampler.sample(t)
        real = batch.indices[batch.mask > 0]
        assert len(np.unique(real)) == len(real)  # no example twice in one batch
        counts[real] += 1
    q = b / n
    _, p_value = stats.chisquare(counts, np.full(n, counts.sum() / n))
    assert p_value > 1e-4
    assert abs(counts.mean() / steps - q) < 0.01


def test_batches_have_fixed_microbatch_shape_and_masked_padding():
    sampler = PoissonSampler(num_examples=500, expected_batch_size=37, microbatch_size=8, seed=3)
    for t in range(50):
        batch = sampler.sample(t)
        assert batch.indices.shape[1] == 8 and batch.mask.shape == batch.indices.shape
        assert np.all((batch.indices == PADDING_INDEX) == (batch.mask == 0))
        assert batch.num_microbatches == max(1, -(-batch.size // 8))


def test_empty_batch_is_one_padded_microbatch():
    batch = pad_into_microbatches(np.array([], dtype=np.int64), 4)
    assert batch.indices.shape == (1, 4) and batch.size == 0


def test_samples_are_a_function_of_seed_and_step():
    make = lambda seed: PoissonSampler(num_examples=100, expected_batch_size=10, microbatch_size=4, seed=seed)
    np.testing.assert_array_equal(make(5).sample(17).indices, make(5).sample(17).indices)
    differs = [not np.array_equal(make(5).sample(t).indices, make(6).sample(t).indices) for t in range(10)]
    assert sum(differs) >= 8


def test_shuffled_sampler_warns_and_covers_each_epoch():
    with pytest.warns(UserWarning, match="not Poisson"):
        sampler = ShuffledSampler(num_examples=40, batch_size=10, microbatch_size=5, seed=0)
    assert not sampler.exact_accounting
    seen = np.concatenate([sampler.sample(t).indices.ravel() for t in range(4)])
    np.testing.assert_array_equal(np.sort(seen), np.arange(40))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_examples=0, expected_batch_size=1, microbatch_size=1),
        dict(num_examples=10, expected_batch_size=11, microbatch_size=1),
        dict(num_examples=10, expected_batch_size=0, microbatch_size=1),
        dict(num_examples=10, expected_batch_size=5, microbatch_size=0),
    ],
)
def test_rejects_impossible_sizes(kwargs):
    with pytest.raises(InvalidConfigError):
        PoissonSampler(seed=0, **kwargs)


def test_capacity_covers_poisson_batches():
    assert batch_capacity(100, 1.0) == 100
    cap = batch_capacity(10_000, 0.01)
    assert 100 + 8 * np.sqrt(99) < cap < 200
    assert np.random.default_rng(0).binomial(10_000, 0.01, size=100_000).max() <= cap
