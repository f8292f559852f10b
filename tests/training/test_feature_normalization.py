"""Feature normalisation: unit rows, a DP mean whose cost is in the ledger, the same transform at evaluation,
and a held-out part of the training split."""

import json
import os

import numpy as np
import pytest

from dpscale.errors import InvalidConfigError
from dpscale.privacy import accounting
from dpscale.privacy.plan import PrivacyTarget
from dpscale.stages import evaluate, sweep, train
from dpscale.training import feature_normalization
from dpscale.training.config import FeatureSettings, TrainingConfig
from dpscale.training.model import build_train_model
from dpscale.training.run_directory import RunDirectory


def _features_training(epsilon=2.0, **overrides):
    settings = {k: overrides.pop(k) for k in ("normalization", "mean_noise_multiplier", "scale") if k in overrides}
    base = dict(
        mode="features",
        target=PrivacyTarget(epsilon=epsilon),
        batch_size=128,
        steps=30,
        learning_rate=4.0,
        microbatch_size=64,
        seed=3,
        show_progress=False,
        features=FeatureSettings(**settings),
    )
    return TrainingConfig(**(base | overrides))


@pytest.fixture(scope="module")
def features(tmp_path_factory, synthetic_feature_cache):
    return synthetic_feature_cache(
        str(tmp_path_factory.mktemp("cache")),
        seed=1,
        sizes={"train": 600, "test": 150},
        chunk_rows=256,
        data_hash_char="e",
    )


def test_l2_and_center_l2_give_unit_rows_and_center_l2_removes_the_mean():
    rng = np.random.default_rng(0)
    x = np.abs(rng.normal(size=(400, 8))) + 3.0  # non-negative, far from centred, like post-ReLU features
    x[5] = 0.0
    l2 = feature_normalization.apply(x, "l2")
    norms = np.linalg.norm(l2, axis=1)
    np.testing.assert_allclose(np.delete(norms, 5), 1.0, rtol=1e-5)
    assert not np.any(l2[5])  # a zero row stays zero instead of NaN
    mean = feature_normalization.feature_mean(x, noise_multiplier=None, seed=0)
    np.testing.assert_allclose(mean, l2.mean(axis=0), rtol=1e-5)
    centred = feature_normalization.apply(x, "center-l2", mean)
    np.testing.assert_allclose(np.linalg.norm(centred, axis=1), 1.0, rtol=1e-5)
    # Centring removes the shared direction: the rows' mean shrinks from ~1 to near 0.
    assert np.linalg.norm(centred.mean(axis=0)) < 0.2 < 0.9 < np.linalg.norm(l2.mean(axis=0))
    with pytest.raises(InvalidConfigError, match="needs the feature mean"):
        feature_normalization.apply(x, "center-l2")
    np.testing.assert_allclose(
        np.linalg.norm(feature_normalization.apply(x[:5], "center-l2", mean, 32.0), axis=1), 32.0, rtol=1e-5
    )


def test_unit_rows_stay_within_norm_one_for_denormal_tiny_and_huge_rows():
    """The review's crafted rows: ~1e-19 entries (squares flushed to zero on CPU) came out with norm 29.8."""
    d = 1280
    rows = np.stack(
        [
            np.full(d, 1e-19),
            np.full(d, 3e-20),
            np.r_[1e-19, np.full(d - 1, 1e-30)],
            np.full(d, 1e-40),
            np.r_[1e-38, np.zeros(d - 1)],
            np.full(d, 3e37),
            np.ones(d),
            np.zeros(d),
        ]
    ).astype(np.float32)
    for kind in ("l2", "center-l2"):
        mean = feature_normalization.feature_mean(rows, noise_multiplier=None, seed=0)
        out = feature_normalization.apply(rows, kind, mean=mean if kind == "center-l2" else None)
        norms = np.linalg.norm(out.astype(np.float64), axis=1)
        assert np.all(np.isfinite(out)) and np.all(norms <= 1 + 1e-6), (kind, norms)
        if kind == "l2":  # every non-zero row of normal numbers is a unit row
            np.testing.assert_allclose(norms[[0, 1, 2, 5, 6]], 1.0, rtol=1e-5)
            assert norms[-1] == 0.0
    unit = np.asarray(feature_normalization._unit_rows(rows))
    assert np.linalg.norm(unit.astype(np.float64), axis=1).max() <= 1 + 1e-6  # the mean's sensitivity is 1
    bad = feature_normalization.apply(np.array([[np.nan, 1.0], [np.inf, 1.0]], np.float32), "l2")
    assert not np.isfinite(bad).all(axis=1).any()  # non-finite rows stay non-finite (weight 0 in training)


def test_dp_mean_is_seeded_gaussian_noise_of_the_right_scale_and_ignores_nonfinite_rows():
    x = np.ones((1000, 500), np.float32)
    x[0, 0] = np.nan
    exact = feature_normalization.feature_mean(x, noise_multiplier=None, seed=0)
    assert np.all(np.isfinite(exact))
    np.testing.assert_allclose(exact, 999 / 1000 / np.sqrt(500), rtol=1e-5)  # the NaN row counted as zero
    a = feature_normalization.feature_mean(x, noise_multiplier=50.0, seed=7)
    assert np.array_equal(a, feature_normalization.feature_mean(x, noise_multiplier=50.0, seed=7))
    assert not np.array_equal(a, feature_normalization.feature_mean(x, noise_multiplier=50.0, seed=8))
    # every bit of the 63-bit secret seed matters (no truncation to 31 or 32 bits)
    assert not np.array_equal(a, feature_normalization.feature_mean(x, noise_multiplier=50.0, seed=7 + 2**40))
    assert np.std(a - exact) == pytest.approx(50.0 / 1000, rel=0.15)  # sigma * sensitivity 1 / N


def test_center_l2_run_spends_at_most_the_target_including_the_mean_and_evaluates_with_the_saved_mean(
    features, tmp_path
):
    run_dir = tmp_path / "run"
    result = train.run(
        train.TrainConfig(
            data=features,
            run_dir=str(run_dir),
            training=_features_training(holdout=100, normalization="center-l2", mean_noise_multiplier=5.0, scale=3.0),
        )
    )
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["releases"] == [5.0] and ledger["epsilon_spent"] == result.epsilon <= 2.0
    training_alone = accounting.epsilon(
        noise_multiplier=result.noise_multiplier, sampling_rate=128 / 500, steps=30, delta=1e-5
    )
    assert training_alone < result.epsilon - 0.01  # the mean's release is in the ledger's epsilon
    spec = RunDirectory.existing(str(run_dir)).read_spec()
    assert spec.plan.num_examples == 500 and spec.plan.releases == (5.0,)

    scores = evaluate.run(evaluate.EvaluateConfig(run_dir=str(run_dir)))
    trained = RunDirectory.existing(str(run_dir)).load_params()
    mean = np.asarray(trained["model_state"][feature_normalization.MEAN_KEY])
    model = build_train_model(spec.data, spec.training)
    with pytest.raises(InvalidConfigError, match="needs the feature mean"):  # never silently uncentred
        model.eval_inputs("test", None)
    x, y = model.eval_inputs("test", trained["model_state"])
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 3.0, rtol=1e-5)
    ema = trained["ema_params"]
    logits = x @ np.asarray(ema["kernel"]) + np.asarray(ema["bias"])
    assert scores.ema_top1 == pytest.approx(np.mean(logits.argmax(1) == y)) and scores.ema_top1 > 0.8
    # The DP mean is not the exact one (noise of std 5/500 per coordinate).
    from dpscale.cache.feature_store import open_features

    exact = feature_normalization.feature_mean(
        np.asarray(open_features(features).features("train")[:500]), noise_multiplier=None, seed=0
    )
    assert 0.002 < np.std(mean - exact) < 0.03

    with pytest.raises(InvalidConfigError, match="private-diagnostics"):  # held-out rows are private data
        evaluate.run(evaluate.EvaluateConfig(run_dir=str(run_dir), split="holdout"))
    held = evaluate.run(evaluate.EvaluateConfig(run_dir=str(run_dir), split="holdout", private_diagnostics=True))
    assert not held.covered_by_epsilon and held.path.endswith("metrics.holdout.NOT-PRIVATE.json")
    assert "holdout" in ledger["not_covered"][0]
    assert held.num_examples == 100 and held.ema_top1 > 0.8


def test_a_nonprivate_center_l2_run_uses_the_exact_mean_and_releases_nothing(features, tmp_path):
    run_dir = tmp_path / "run"
    train.run(
        train.TrainConfig(
            data=features,
            run_dir=str(run_dir),
            training=_features_training(epsilon=float("inf"), steps=5, learning_rate=0.5, normalization="center-l2"),
        )
    )
    assert json.loads((run_dir / "ledger.json").read_text())["releases"] == []
    from dpscale.cache.feature_store import open_features

    exact = feature_normalization.feature_mean(
        np.asarray(open_features(features).features("train")[:]), noise_multiplier=None, seed=0
    )
    saved = RunDirectory.existing(str(run_dir)).load_params()["model_state"][feature_normalization.MEAN_KEY]
    np.testing.assert_allclose(saved, exact, rtol=1e-6)


def test_sweep_with_holdout_scores_the_held_out_rows(features, tmp_path):
    config = sweep.SweepConfig(
        data=features,
        out_dir=str(tmp_path / "sweep"),
        epsilons=(2.0,),
        learning_rates=(4.0,),
        repeats=1,
        baseline=False,
        training=_features_training(steps=4, holdout=150, normalization="l2", private_diagnostics=True),
    )
    sweep.run(config)
    run_dir = tmp_path / "sweep" / "runs" / "eps2-lr4-r0"
    scores = RunDirectory.existing(str(run_dir)).read_scores("holdout", diagnostic=True)
    assert scores["split"] == "holdout" and scores["num_examples"] == 150
    assert RunDirectory.existing(str(run_dir)).read_spec().plan.num_examples == 450
    # Its tables are private diagnostics: named so, owner-only, and nothing under the plain names.
    out = tmp_path / "sweep"
    assert not (out / sweep.SUMMARY_MD).exists() and not (out / sweep.PLOT).exists()
    for name in ("summary.NOT-PRIVATE.md", "runs.NOT-PRIVATE.csv", "accuracy_vs_epsilon.NOT-PRIVATE.png"):
        assert os.stat(out / name).st_mode & 0o777 == 0o600
    with pytest.raises(InvalidConfigError, match="private-diagnostics"):
        sweep.SweepConfig(data=features, out_dir=str(tmp_path / "s2"), training=_features_training(holdout=150))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(holdout=600), "holdout must be in"),
        (dict(holdout=-1), "holdout must be in"),
        (dict(normalization="pca"), "feature normalization must be one of"),
        (dict(normalization="center-l2", mean_noise_multiplier=0.0), "noise multiplier must be positive"),
        (dict(normalization="l2", scale=-1.0), "feature scale must be positive"),
    ],
)
def test_bad_holdout_or_normalization_is_a_user_error(features, tmp_path, kwargs, match):
    with pytest.raises(InvalidConfigError, match=match):
        train.run(
            train.TrainConfig(
                data=features, run_dir=str(tmp_path / "run"), training=_features_training(steps=2, **kwargs)
            )
        )
