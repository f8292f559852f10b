"""The white-box audit on the multi-device step scores every model as the one-device step does."""

import jax
import numpy as np
import pytest

from dpscale.audit.whitebox import WhiteBoxSetup, white_box_scores
from dpscale.privacy.dpsgd import data_mesh
from dpscale.privacy.plan import PrivacyPlan, PrivacyTarget

N, CLASSES = 8, 3


@pytest.mark.parametrize("model", ["linear", "cnn"])
def test_four_device_scores_equal_one_device_scores(model):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, CLASSES, N).astype(np.int32)
    if model == "linear":
        features, image_shape = rng.normal(size=(N, 16)).astype(np.float32), None
        features[:, 3] = 0.0
    else:
        features, image_shape = rng.normal(size=(N, 8, 8, 1)).astype(np.float32), (8, 8, 1)
    plan = PrivacyPlan.calibrate(PrivacyTarget(4.0, 1e-5), num_examples=N, batch_size=N, steps=3)
    setup = WhiteBoxSetup(
        plan=plan, model=model, clip_norm=2.0, learning_rate=0.5, microbatches=2, channels=(4,), num_groups=2
    )
    member = np.arange(6) % 2 == 0
    one = white_box_scores(features, labels, CLASSES, member, setup=setup, seed=3, image_shape=image_shape)
    four = white_box_scores(
        features,
        labels,
        CLASSES,
        member,
        setup=setup,
        seed=3,
        image_shape=image_shape,
        mesh=data_mesh(jax.devices()[:4]),
    )
    assert len(jax.devices()) >= 4
    np.testing.assert_allclose(four, one, rtol=1e-5, atol=1e-4)
    assert np.ptp(one) > 1.0  # the models differ: each has its own keys
