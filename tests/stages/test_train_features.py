"""Last-layer DP training on a feature-cache entry (its sweeps: tests/stages/test_sweep.py)."""

import json

import numpy as np
import pytest

from dpscale.privacy.plan import PrivacyTarget
from dpscale.stages import evaluate, train
from dpscale.training.config import TrainingConfig


@pytest.fixture(scope="module")
def features(tmp_path_factory, synthetic_feature_cache):
    """A separable 3-class problem in 16 dimensions, stored as a real cache entry."""
    return synthetic_feature_cache(
        str(tmp_path_factory.mktemp("cache")),
        seed=0,
        sizes={"train": 600, "test": 150},
        chunk_rows=256,
        data_hash_char="d",
    )


def test_last_layer_dp_training_learns_and_spends_at_most_the_target(features, tmp_path):
    result = train.run(
        train.TrainConfig(
            data=features,
            run_dir=str(tmp_path / "run"),
            training=TrainingConfig(
                mode="features",
                target=PrivacyTarget(epsilon=2.0),
                batch_size=128,
                steps=30,
                learning_rate=4.0,
                microbatch_size=64,
                seed=3,
                show_progress=False,
            ),
        )
    )
    assert 0 < result.epsilon <= 2.0
    scores = evaluate.run(evaluate.EvaluateConfig(run_dir=str(tmp_path / "run")))
    assert scores.num_examples == 150 and scores.ema_top1 > 0.8  # chance is 1/3
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert "d" * 64 not in json.dumps(ledger) and ledger["not_covered"] == []


def test_feature_feed_carries_exact_squared_norms_and_zero_padding():
    import jax.numpy as jnp

    from dpscale.privacy.sampling import SampledBatch
    from dpscale.training.feeds import FeatureFeed

    rng = np.random.default_rng(0)
    feats = rng.normal(size=(6, 5)).astype(np.float32)
    feats[4, 2] = np.inf
    feed = FeatureFeed(feats, np.arange(6) % 3)
    indices = np.array([[5, 0, 4, -1]])
    batch = SampledBatch(indices=indices, mask=(indices >= 0).astype(np.float32))
    ((micro, mask),) = feed.microbatches(batch, step=0)
    np.testing.assert_allclose(micro["features_sq_norm"][:2], np.sum(feats[[5, 0]] ** 2, axis=1), rtol=1e-6)
    assert not np.isfinite(micro["features_sq_norm"][2])  # reaches the clipped sum as non-finite
    assert float(micro["features_sq_norm"][3]) == 0.0 and not np.any(micro["features"][3])
    assert micro["label"].tolist() == [2, 0, 1, 0] and jnp.asarray(mask).tolist() == [1, 1, 1, 0]
