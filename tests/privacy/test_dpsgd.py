"""The DP-SGD update: sensitivity, noise, accumulation, devices, EMA."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpscale.errors import InvalidConfigError
from dpscale.privacy.clipping import make_clipped_sum_fn, make_unclipped_sum_fn
from dpscale.privacy.dpsgd import DpsgdStep, data_mesh
from dpscale.privacy.ema import ema_decay
from dpscale.privacy.example_sum import sum_scale


def _step(loss_fn, *, clip_norm=1.0, optimizer=None, ema_decay=0.9999, capacity=64, **kwargs):
    """A step over ``vmap`` clipped sums, plain SGD at learning rate 1 unless ``optimizer`` is given;
    ``capacity``: the most examples a step of these tests holds."""
    return DpsgdStep(
        make_clipped_sum_fn(loss_fn, clip_norm=clip_norm),
        optimizer=optimizer or optax.sgd(1.0),
        ema_decay=ema_decay,
        capacity=capacity,
        **kwargs,
    )


def _accumulated_sum(step, state, batch, microbatch_size):
    """Clipped sum of ``batch`` (all real) over fixed-size micro-batches, the last one padded."""
    n = jax.tree_util.tree_leaves(batch)[0].shape[0]
    num_micro = -(-n // microbatch_size)
    pad = num_micro * microbatch_size - n
    padded = jax.tree_util.tree_map(lambda a: jnp.concatenate([a, jnp.zeros_like(a[:pad])]), batch)
    mask = jnp.concatenate([jnp.ones(n), jnp.zeros(pad)])
    total = step.zero_sum(state)
    for start in range(0, n, microbatch_size):
        piece = jax.tree_util.tree_map(lambda a: a[start : start + microbatch_size], padded)
        total = step.accumulate(state, total, piece, mask[start : start + microbatch_size])
    return total


@pytest.mark.parametrize("seed", range(4))
def test_noise_free_update_moves_at_most_one_over_b_per_example(toy, seed):
    """Add-or-remove-one sensitivity of the normalised update is 1/B, with augmult and accumulation."""
    rng = np.random.default_rng(seed)
    n, views, micro, b = int(rng.integers(4, 13)), 3, 4, 16.0
    step = _step(
        toy.loss_fn,
        noise_multiplier=0.0,
        expected_batch_size=b,
        clip_norm=float(rng.uniform(0.05, 2)),
        seed=seed,
    )
    state = step.init(toy.init_params(seed))
    data = toy.make_batch(100 + seed, n + 1, views=views, scale=float(rng.uniform(0.5, 30)))
    without = toy.split(data, [n])[0]
    g_with = toy.flat(step.privatized_gradient(_accumulated_sum(step, state, data, micro), 0))
    g_without = toy.flat(step.privatized_gradient(_accumulated_sum(step, state, without, micro), 0))
    assert np.linalg.norm(g_with - g_without) <= 1.0 / b * (1 + 1e-5)


def test_sensitivity_bound_is_attained_by_a_large_gradient(toy):
    step = _step(toy.loss_fn, noise_multiplier=0.0, expected_batch_size=8, seed=0)
    state = step.init(toy.init_params(1))
    data = toy.make_batch(2, 5, views=3, scale=100.0)
    g_with = toy.flat(step.privatized_gradient(_accumulated_sum(step, state, data, 2), 0))
    g_without = toy.flat(step.privatized_gradient(_accumulated_sum(step, state, toy.split(data, [4])[0], 2), 0))
    np.testing.assert_allclose(np.linalg.norm(g_with - g_without), 1.0 / 8, rtol=1e-3)


def test_accumulation_equals_one_big_batch(toy):
    config = dict(noise_multiplier=0.0, expected_batch_size=24)
    step = _step(toy.loss_fn, **config, seed=0, optimizer=optax.sgd(0.5, momentum=0.9))
    params = toy.init_params(11)
    data = toy.make_batch(12, 24, views=2, scale=4.0)
    results = []
    for micro in (24, 8, 3):
        state = step.init(params)
        for _ in range(3):
            pieces = toy.split(data, [micro] * (24 // micro))
            state, metrics = step.update(state, [(p, jnp.ones(micro)) for p in pieces])
        assert int(metrics["batch_size"]) == 24
        results.append(toy.flat(state.params))
    # Each micro-batch's clip leaves room for its own float32 sum (privacy.example_sum): 24 slots
    # scale every contribution by c(24), 8 by c(8), so the updates agree to within that room.
    room = 1 - float(sum_scale(24))
    assert 0 < room < 1e-4
    moved = np.max(np.abs(results[0] - toy.flat(params)))  # the room scales the updates, not the parameters
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-6 + 2 * room * moved)
    np.testing.assert_allclose(results[2], results[0], rtol=1e-5, atol=1e-6 + 2 * room * moved)


def _noise_samples(toy, *, sigma, b, microbatches, steps, seed=0):
    """The noise part of the privatised gradient for several steps (clipped sum removed)."""
    step = _step(toy.loss_fn, noise_multiplier=sigma, expected_batch_size=b, seed=seed)
    big = {"w1": jnp.zeros((200, 100)), "b1": jnp.zeros(100), "w2": jnp.zeros((100, 3)), "b2": jnp.zeros(3)}
    state = step.init(big)
    total = step.zero_sum(state)
    # Padding-only micro-batches: the clipped sum stays exactly zero, only the noise remains.
    pad = {"x": jnp.zeros((4, 1, 200)), "y": jnp.zeros((4, 1), jnp.int32)}
    for _ in range(microbatches):
        total = step.accumulate(state, total, pad, jnp.zeros(4))
    return np.stack([toy.flat(step.privatized_gradient(total, t)) for t in range(steps)])


@pytest.mark.parametrize("microbatches", [1, 5])
def test_noise_std_is_sigma_over_b_whatever_the_accumulation(toy, microbatches):
    sigma, b = 1.7, 32.0
    samples = _noise_samples(toy, sigma=sigma, b=b, microbatches=microbatches, steps=4)
    n = samples.size  # ~82k draws: relative std error of the std is 1/sqrt(2n) ~ 0.25%
    rel_tol = 5 / np.sqrt(2 * n)
    assert abs(samples.std() / (sigma / b) - 1) < rel_tol
    assert abs(samples.mean()) < 5 * (sigma / b) / np.sqrt(n)


def test_no_two_steps_share_noise_and_a_step_is_reproducible(toy):
    samples = _noise_samples(toy, sigma=1.0, b=1.0, microbatches=1, steps=12)
    corr = np.corrcoef(samples)
    off_diagonal = corr[~np.eye(len(corr), dtype=bool)]
    assert np.max(np.abs(off_diagonal)) < 5 / np.sqrt(samples.shape[1])
    again = _noise_samples(toy, sigma=1.0, b=1.0, microbatches=3, steps=12)
    np.testing.assert_array_equal(samples, again)  # same seed and step: same key, same noise
    other_seed = _noise_samples(toy, sigma=1.0, b=1.0, microbatches=1, steps=1, seed=2**40)
    assert abs(np.corrcoef(samples[0], other_seed[0])[0, 1]) < 5 / np.sqrt(samples.shape[1])


def test_update_is_the_same_on_one_and_four_devices(toy):
    assert jax.device_count() >= 4, "tests/conftest.py forces 4 host devices"
    params = toy.init_params(21)
    data = toy.make_batch(22, 16, views=2, scale=3.0)
    config = dict(noise_multiplier=0.8, expected_batch_size=16)
    results = []
    for devices in (jax.devices()[:1], jax.devices()[:4]):
        step = _step(toy.loss_fn, **config, seed=123, mesh=data_mesh(devices))
        state = step.init(params)
        for _ in range(2):
            pieces = toy.split(data, [8, 8])
            state, _ = step.update(state, [(p, jnp.ones(8)) for p in pieces])
        # Every device must hold the same noisy parameters (np.asarray reads one copy only).
        for leaf in jax.tree_util.tree_leaves(state.params):
            copies = [np.asarray(shard.data) for shard in leaf.addressable_shards]
            assert len(copies) == len(devices)
            for copy in copies[1:]:
                np.testing.assert_array_equal(copy, copies[0])
        results.append((toy.flat(state.params), toy.flat(state.ema_params)))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-5, atol=1e-6)


def test_microbatch_must_divide_over_devices(toy):
    step = _step(
        toy.loss_fn,
        noise_multiplier=1.0,
        expected_batch_size=4,
        seed=0,
        mesh=data_mesh(jax.devices()[:4]),
    )
    state = step.init(toy.init_params(0))
    with pytest.raises(InvalidConfigError, match="divisible"):
        step.accumulate(state, step.zero_sum(state), toy.make_batch(0, 6), jnp.ones(6))


def test_ema_follows_warmup_and_ignores_microsteps(toy):
    decay = 0.9
    step = _step(toy.loss_fn, noise_multiplier=0.5, expected_batch_size=8, ema_decay=decay, seed=3)
    state = step.init(toy.init_params(4))
    data = toy.make_batch(5, 8, views=1)
    expected_ema = toy.flat(state.ema_params)
    for t in range(4):
        state, _ = step.update(state, [(p, jnp.ones(2)) for p in toy.split(data, [2, 2, 2, 2])])
        mu = min(decay, (1 + t) / (10 + t))
        expected_ema = mu * expected_ema + (1 - mu) * toy.flat(state.params)
        assert int(state.step) == t + 1  # four micro-batches, one optimiser update
    np.testing.assert_allclose(toy.flat(state.ema_params), expected_ema, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(ema_decay(0, 0.9999)), 0.1)
    np.testing.assert_allclose(float(ema_decay(10**6, 0.9999)), 0.9999)


def test_step_rejects_bad_values(toy):
    with pytest.raises(InvalidConfigError):
        _step(toy.loss_fn, noise_multiplier=-1.0, expected_batch_size=8, seed=0)
    with pytest.raises(InvalidConfigError):
        _step(toy.loss_fn, noise_multiplier=1.0, expected_batch_size=0, seed=0)
    with pytest.raises(InvalidConfigError):
        _step(toy.loss_fn, noise_multiplier=1.0, expected_batch_size=8, clip_norm=float("inf"), seed=0)
    with pytest.raises(InvalidConfigError, match="EMA decay"):
        _step(toy.loss_fn, noise_multiplier=1.0, expected_batch_size=8, ema_decay=1.0, seed=0)


def test_step_takes_only_a_clipped_sum_with_a_stated_sensitivity(toy):
    plain = make_clipped_sum_fn(toy.loss_fn, clip_norm=1.0).fn  # the function without its bound
    with pytest.raises(TypeError, match="ClippedSumFn"):
        DpsgdStep(
            plain,
            noise_multiplier=1.0,
            expected_batch_size=8,
            seed=0,
            optimizer=optax.sgd(1.0),
            ema_decay=0.9,
            capacity=8,
        )
    with pytest.raises(InvalidConfigError, match="unbounded sensitivity"):
        DpsgdStep(
            make_unclipped_sum_fn(toy.loss_fn),
            noise_multiplier=1.0,
            expected_batch_size=8,
            seed=0,
            optimizer=optax.sgd(1.0),
            ema_decay=0.9,
            capacity=8,
        )


def test_sharded_clipped_sum_of_a_conv_model_moves_no_per_example_tensors():
    """Over a mesh each device clips its own examples: same sum as one device, no all-to-all.

    Left to the SPMD partitioner, a 2-device cnn-small run (micro-batch 128, 28x28)
    resharded per-example conv gradients with all-to-alls and aborted twice in an XLA
    collective rendezvous; this small model does not trigger the partitioner's choice,
    so the HLO check only guards the shard_map structure, the sums check its maths.
    """
    from dpscale.models.cnn import small_cnn

    model = small_cnn(num_classes=3, channels=(16, 16))
    params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]

    def loss_fn(params, model_state, views):
        logits = model.apply({"params": params}, views["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, views["label"]).mean()

    rng = np.random.default_rng(0)
    batch = {
        "image": jnp.asarray(rng.normal(size=(8, 2, 8, 8, 1)), jnp.float32),
        "label": jnp.asarray(rng.integers(0, 3, size=(8, 2)), jnp.int32),
    }
    mask = jnp.ones(8).at[7].set(0.0)
    sums = []
    for devices in (jax.devices()[:1], jax.devices()[:4]):
        step = _step(
            loss_fn, noise_multiplier=1.0, expected_batch_size=8, clip_norm=0.1, seed=0, mesh=data_mesh(devices)
        )
        state = step.init(params)
        total = step.zero_sum(state)
        if len(devices) == 4:
            hlo = step._accumulate.lower(state.params, total, batch, mask, state.model_state).compile().as_text()
            assert "all-to-all" not in hlo
        sums.append(step.accumulate(state, total, batch, mask))
    for one, four in zip(jax.tree_util.tree_leaves(sums[0]), jax.tree_util.tree_leaves(sums[1])):
        np.testing.assert_allclose(np.asarray(four), np.asarray(one), rtol=1e-5, atol=1e-6)
