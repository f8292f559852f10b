"""Last-layer DP training on a feature-cache entry, and a sweep over epsilon reusing it."""

import json
import math

import numpy as np
import pytest

from dpscale.privacy.plan import PrivacyTarget
from dpscale.stages import evaluate, sweep, train
from dpscale.training.config import TrainingConfig


@pytest.fixture(scope="module")
def features(tmp_path_factory, synthetic_feature_cache):
    """A separable 3-class problem in 16 dimensions, stored as a real cache entry."""
    return synthetic_feature_cache(str(tmp_path_factory.mktemp("cache")), seed=0, sizes={"train": 600, "test": 150},
                                   chunk_rows=256, data_hash_char="d")


def test_last_layer_dp_training_learns_and_spends_at_most_the_target(features, tmp_path):
    result = train.run(train.TrainConfig(data=features, run_dir=str(tmp_path / "run"), training=TrainingConfig(
        mode="features", target=PrivacyTarget(epsilon=2.0), batch_size=128, steps=30, learning_rate=4.0,
        microbatch_size=64, seed=3, show_progress=False)))
    assert 0 < result.epsilon <= 2.0
    scores = evaluate.run(evaluate.EvaluateConfig(run_dir=str(tmp_path / "run")))
    assert scores.num_examples == 150 and scores.ema_top1 > 0.8  # chance is 1/3
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert "d" * 64 not in json.dumps(ledger) and ledger["not_covered"] == []


def test_sweep_writes_tables_and_plot_and_reuses_finished_runs(features, tmp_path):
    training = TrainingConfig(mode="features", batch_size=128, steps=4, microbatch_size=64, show_progress=False)
    config = sweep.SweepConfig(data=features, out_dir=str(tmp_path / "sweep"), training=training, epsilons=(1.0, 4.0),
                               learning_rates=(4.0,), repeats=2)
    summary = sweep.run(config).summary
    by_eps = {s["epsilon"]: s for s in summary}
    assert set(by_eps) == {1.0, 4.0, math.inf}
    assert all(s["repeats"] == 2 and s["min_top1"] <= s["median_top1"] <= s["max_top1"] for s in summary)
    out = tmp_path / "sweep"
    assert (out / sweep.PLOT).stat().st_size > 1000
    assert "non-private" in (out / sweep.SUMMARY_MD).read_text()
    runs = (out / sweep.RUNS_CSV).read_text().splitlines()
    assert len(runs) == 1 + 2 * 2 + 2  # header, 2 epsilons x 2 repeats, 2 baselines
    stamp = (out / "runs" / "eps1-lr4-r0" / "metrics.json").stat().st_mtime_ns
    assert sweep.run(config).summary == summary  # everything reused: same numbers
    assert (out / "runs" / "eps1-lr4-r0" / "metrics.json").stat().st_mtime_ns == stamp


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
    (micro, mask), = feed.microbatches(batch, step=0)
    np.testing.assert_allclose(micro["features_sq_norm"][:2], np.sum(feats[[5, 0]] ** 2, axis=1), rtol=1e-6)
    assert not np.isfinite(micro["features_sq_norm"][2])  # reaches the clipped sum as non-finite
    assert float(micro["features_sq_norm"][3]) == 0.0 and not np.any(micro["features"][3])
    assert micro["label"].tolist() == [2, 0, 1, 0] and jnp.asarray(mask).tolist() == [1, 1, 1, 0]
