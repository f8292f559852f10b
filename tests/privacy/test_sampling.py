"""Batch selection: truncated Poisson sizes, uniform inclusion, one fixed shape, shuffling warns."""

import jax
import numpy as np
import pytest
from scipy import stats

from dpscale.errors import InvalidConfigError
from dpscale.privacy.sampling import (
    PADDING_INDEX,
    Layout,
    PoissonSampler,
    ShuffledSampler,
    batch_capacity,
    pad_into,
    truncated_poisson_slots,
)


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


def test_every_batch_has_the_same_shape_whatever_its_size():
    """The number of micro-batches (hence a step's work and time) never follows the realised size."""
    sampler = PoissonSampler(num_examples=500, expected_batch_size=37, microbatch_size=8, seed=3)
    shapes, sizes = set(), set()
    for t in range(300):
        batch = sampler.sample(t)
        shapes.add(batch.indices.shape)
        sizes.add(batch.size)
        assert batch.mask.shape == batch.indices.shape
        assert np.all((batch.indices == PADDING_INDEX) == (batch.mask == 0))
    assert len(sizes) > 10 and shapes == {(sampler.layout.num_microbatches, sampler.layout.microbatch_size)}
    assert sampler.layout.slots >= sampler.capacity == batch_capacity(500, 37)
    assert sampler.layout.microbatch_size <= 8


def test_batches_beyond_the_capacity_keep_a_uniform_subset_of_it():
    n, b, cap, steps = 100, 20, 21, 6000
    sampler = PoissonSampler(num_examples=n, expected_batch_size=b, microbatch_size=8, seed=2, capacity=cap)
    sizes, counts = np.zeros(steps, int), np.zeros(n)
    for t in range(steps):
        batch = sampler.sample(t)
        sizes[t] = batch.size
        counts[batch.indices[batch.mask > 0]] += 1
    assert sizes.max() == cap
    # min(Binomial(n, q), cap): the mass at the cap is the Binomial's tail.
    assert np.mean(sizes == cap) == pytest.approx(stats.binom.sf(cap - 1, n, b / n), abs=0.02)
    _, p_value = stats.chisquare(counts, np.full(n, counts.sum() / n))
    assert p_value > 1e-4


def test_layout_spreads_the_capacity_over_the_fewest_equal_microbatches():
    assert Layout.of(10_358, microbatch_size=5_000) == Layout(num_microbatches=3, microbatch_size=3_453)
    assert Layout.of(10, microbatch_size=16) == Layout(num_microbatches=1, microbatch_size=10)
    four = Layout.of(10, microbatch_size=8, multiple=4)
    assert four.microbatch_size % 4 == 0 and four.slots >= 10 and four.microbatch_size <= 8
    with pytest.raises(InvalidConfigError):
        Layout.of(0, microbatch_size=4)


def test_on_device_sampling_is_the_same_truncated_distribution():
    n, q, cap, draws = 60, 0.3, 20, 4000
    eligible = np.ones(n, bool)
    eligible[-5:] = False  # rows outside this model's data set never join
    draw = jax.jit(jax.vmap(lambda key: truncated_poisson_slots(key, q, eligible, cap)))
    index, mask = map(np.asarray, draw(jax.random.split(jax.random.key(0), draws)))
    assert index.shape == mask.shape == (draws, cap)
    sizes = mask.sum(axis=1)
    expected = np.minimum(np.random.default_rng(0).binomial(n - 5, q, size=200_000), cap)
    assert sizes.mean() == pytest.approx(expected.mean(), abs=0.2)
    assert np.mean(sizes == cap) == pytest.approx(np.mean(expected == cap), abs=0.03)
    counts = np.bincount(index[mask > 0], minlength=n)
    assert counts[-5:].sum() == 0 and np.all(index[mask == 0] == 0)
    for row in range(0, draws, 97):  # no row twice in one batch
        real = index[row][mask[row] > 0]
        assert len(np.unique(real)) == len(real)
    _, p_value = stats.chisquare(counts[:-5], np.full(n - 5, counts[:-5].sum() / (n - 5)))
    assert p_value > 1e-4


def test_empty_batch_is_one_padded_microbatch():
    batch = pad_into(np.array([], dtype=np.int64), Layout.of(4, microbatch_size=4))
    assert batch.indices.shape == (1, 4) and batch.size == 0 and np.all(batch.indices == PADDING_INDEX)


def test_samples_are_a_function_of_seed_and_step():
    def make(seed):
        return PoissonSampler(num_examples=100, expected_batch_size=10, microbatch_size=4, seed=seed)

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


def test_capacity_is_k_standard_deviations_above_the_batch_size():
    assert batch_capacity(100, 100) == 101  # N + 1: a full batch of the larger neighbour is never truncated
    assert batch_capacity(50_000, 10_000) == 10_000 + int(np.ceil(4 * np.sqrt(10_000 * 0.8)))
    assert batch_capacity(10_000, 100, stds=8) == 100 + int(np.ceil(8 * np.sqrt(99)))
    assert batch_capacity(10, 9, stds=10) == 11  # never above N + 1


def test_the_drawn_examples_take_uniformly_random_slots():
    """Random slots make the step without one example the same step with that slot empty (the
    whole sum's bound, privacy/example_sum.py): every slot is as likely to hold an example, and an
    example's slot says nothing of which others were drawn."""
    sampler = PoissonSampler(num_examples=400, expected_batch_size=12, microbatch_size=8, seed=5)
    slots, prefixes = np.zeros(sampler.layout.slots), 0
    for t in range(3000):
        mask = sampler.sample(t).mask.ravel()
        slots += mask
        prefixes += bool(np.all(mask[: int(mask.sum())] > 0))
    _, p_value = stats.chisquare(slots, np.full(slots.size, slots.sum() / slots.size))
    assert p_value > 1e-4 and prefixes < 300
    same = PoissonSampler(num_examples=400, expected_batch_size=12, microbatch_size=8, seed=5)
    for t in (0, 17):  # drawn again: the same examples in the same slots
        first, again = sampler.sample(t), same.sample(t)
        np.testing.assert_array_equal(first.indices, again.indices)
    key = jax.random.key(3)
    slots = np.zeros(16)
    for i in range(400):
        index, mask = truncated_poisson_slots(jax.random.fold_in(key, i), 0.05, np.ones(100, bool), 16)
        slots += np.asarray(mask)
        assert np.all(np.asarray(index)[np.asarray(mask) == 0] == 0)
    _, p_value = stats.chisquare(slots, np.full(16, slots.sum() / 16))
    assert p_value > 1e-4
