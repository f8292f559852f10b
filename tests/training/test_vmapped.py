"""Many vmapped DP-SGD models: per-model noise, shared start, exact Poisson membership."""

import jax.numpy as jnp
import numpy as np
import pytest

from dpscale.privacy.plan import PrivacyPlan
from dpscale.training.vmapped import TrainingSetup, margin, train_and_score


def _data(rows=40, dim=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, dim)).astype(np.float32), rng.integers(0, classes, rows)


def test_margin_is_the_log_odds_of_the_label():
    logits = jnp.array([[2.0, 0.0, -1.0]])
    p = np.exp([2.0, 0.0, -1.0]) / np.exp([2.0, 0.0, -1.0]).sum()
    assert float(margin(logits, jnp.array([0]))[0]) == pytest.approx(np.log(p[0] / (1 - p[0])), rel=1e-5)


def test_models_differ_only_through_noise_and_membership():
    x, y = _data()
    setup = TrainingSetup(
        plan=PrivacyPlan(num_examples=40, batch_size=40, steps=3, noise_multiplier=1.0, delta=1e-5)
    )  # q = 1
    present = np.ones((6, 40), bool)
    present[3:, -1] = False  # the last row is absent from models 3-5
    scores = train_and_score(x, y, present, np.array([0, 39]), setup=setup, seed=5, chunk_size=4)
    again = train_and_score(x, y, present, np.array([0, 39]), setup=setup, seed=5, chunk_size=6)
    np.testing.assert_array_equal(scores, again)  # chunking does not change any model
    assert len(np.unique(scores[:, 0])) == 6  # every model draws its own noise
    quiet = TrainingSetup(plan=PrivacyPlan(num_examples=40, batch_size=40, steps=3, noise_multiplier=0.0, delta=1e-5))
    scores = train_and_score(x, y, present, np.array([39]), setup=quiet, seed=5)[:, 0]
    # Without noise and with q = 1, training is deterministic given membership.
    np.testing.assert_allclose(scores[:3], scores[0], rtol=1e-5)
    np.testing.assert_allclose(scores[3:], scores[3], rtol=1e-5)
    assert scores[0] > scores[3] + 1e-3  # training on the row fits it better
