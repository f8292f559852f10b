"""The private-selection sweep (``sweep --private-selection``): what it trains, chooses, publishes and refuses."""

import dataclasses
import json
import math
import os

import numpy as np
import pytest

from dpscale.errors import DataError, InvalidConfigError
from dpscale.privacy.plan import PrivacyTarget
from dpscale.privacy.repetitions import Repetitions
from dpscale.privacy.selection import Selection, SelectionPlan
from dpscale.stages import evaluate, sweep
from dpscale.training import selection_sweep
from dpscale.training.config import FeatureSettings, TrainingConfig
from dpscale.training.run_directory import RunDirectory

from ..conftest import readable_by_others, write_feature_cache

HOLDOUT = 150


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """Three separable classes; rows scaled to 1e-4 carry no signal past the noise, scale 1 learns them."""
    rng = np.random.default_rng(5)
    centers = rng.normal(size=(3, 16)) * 3
    splits = {}
    for split, n in (("train", 600), ("test", 150)):
        labels = rng.integers(0, 3, size=n)
        splits[split] = (centers[labels] + rng.normal(size=(n, 16)), labels)
    return write_feature_cache(str(tmp_path_factory.mktemp("select")), splits, chunk_rows=256, data_hash_char="e")


def _config(features, out_dir, *, seed=None, selection=None, **overrides):
    training = TrainingConfig(
        mode="features",
        target=PrivacyTarget(epsilon=math.inf, accountant="rdp", delta=1e-4),
        batch_size=128,
        steps=10,
        microbatch_size=64,
        show_progress=False,
        holdout=HOLDOUT,
        features=FeatureSettings(normalization="center-l2"),  # a DP mean release in every run
    )
    base = dict(
        data=features,
        out_dir=str(out_dir),
        training=training,
        epsilons=(4.0,),
        learning_rates=(4.0,),
        grid=(("feature_scale", (1e-4, 1.0)),),
        repeats=1,
        private_selection=selection or Selection(Repetitions("negative-binomial", 3.0, 1.0), score_noise=2.0),
    )
    config = sweep.SweepConfig(**(base | overrides))
    if seed is not None:  # the selections' seed, fixed for a test (a run's own seeds stay fresh)
        return dataclasses.replace(config.as_selection(), seed=seed)
    return config


def _keys(value):
    """Every key of a JSON value, however deep."""
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, (list, tuple)):
        return {k for v in value for k in _keys(v)}
    return set()


def _run(config):
    return (
        selection_sweep.run(config) if isinstance(config, selection_sweep.SelectionSweepConfig) else sweep.run(config)
    )


def test_a_selection_publishes_its_chosen_run_covered_and_nothing_of_the_others(
    features, tmp_path, umask_022, monkeypatch
):
    noised = []
    real = selection_sweep.gaussian_release

    def spy(value, key, *, noise_multiplier):
        noised.append(noise_multiplier)
        return real(value, key, noise_multiplier=noise_multiplier)

    monkeypatch.setattr(selection_sweep, "gaussian_release", spy)
    out = tmp_path / "sweep"
    config = _config(features, out, seed=13)
    assert selection_sweep._draws(13, config.selection, 2) == [1, 0]  # both settings run: a choice is made
    result = _run(config)
    (outcome,) = result.selections
    plan = SelectionPlan.from_json(
        json.loads((out / "selection.NOT-PRIVATE" / "eps4-r0" / "selection.json").read_text())["plan"]
    )
    # The selection's epsilon is at most the target, and each run was given the plan's noise.
    assert outcome["epsilon"] == plan.epsilon() <= 4.0 and result.covered_by_epsilon
    assert plan.run.noise_multiplier > 0 and outcome["run_epsilon"] < outcome["epsilon"]
    assert plan.run.releases == (FeatureSettings().mean_noise_multiplier,)  # the mean's release is in each run
    chosen = outcome["chosen"]
    assert chosen["feature_scale"] == 1.0  # the signal wins on held-out rows
    assert chosen["test_top1"] > 0.9 and chosen["run_dir"] == "chosen/eps4-r0"
    run = RunDirectory(str(out / "chosen" / "eps4-r0"))
    assert run.read_spec().plan == plan.run  # the run executed exactly the mechanism accounted
    assert any("private selection" in note for note in run.read_ledger().not_covered)
    # Evaluating the chosen run restates its own epsilon, and says beside it that the choice is the selection's.
    scores = evaluate.run(evaluate.EvaluateConfig(run_dir=run.path, save=False))
    assert scores.epsilon == pytest.approx(outcome["run_epsilon"])
    assert any("private selection" in w and "does not cover the choice" in w for w in scores.warnings)
    assert any("private selection" in note for note in scores.as_dict()["not_covered"])
    # Others may read the chosen run, its outcome, the tables and privacy.json; nothing that counts the runs.
    readable = readable_by_others(str(out))
    assert not any("NOT-PRIVATE" in p for p in readable), readable
    assert os.stat(out / "selection.NOT-PRIVATE").st_mode & 0o777 == 0o700
    runs = os.listdir(out / "selection.NOT-PRIVATE" / "eps4-r0" / "runs")
    assert len(runs) == 1 and runs[0].startswith("run-") and "eps" not in runs[0]  # no index, no setting
    # Every score was a noisy count, one per run; no exact held-out score was written anywhere.
    assert len(noised) == 2 and all(sigma == 2.0 for sigma in noised)
    assert not [f for _, _, names in os.walk(out) for f in names if "holdout" in f]
    assert not {"runs_trained", "runs_reused", "seconds", "private_runs", "rows", "runs"} & _keys(result.line())
    privacy = json.loads((out / sweep.PRIVACY_JSON).read_text())
    assert privacy["composed_epsilon"] == pytest.approx(outcome["epsilon"])
    assert privacy["selections"] == [
        {"selection": "eps4-r0", "epsilon": outcome["epsilon"], "finished": True, "chosen_run": "chosen/eps4-r0"}
    ]
    assert any("selection.NOT-PRIVATE" in n for n in privacy["not_covered"])
    summary = (out / "summary.md").read_text()
    assert "feature-scale 1" in summary and "feature-scale 0.0001" not in summary
    # Again: the ended selection is reused as it is (no run trained, same outcome), its seed gone.
    assert not os.listdir(os.environ["DPSCALE_KEY_STORE"]) or not any(
        f.endswith("selection-seed.json") for f in os.listdir(os.environ["DPSCALE_KEY_STORE"])
    )
    again = _run(config)
    assert again.selections == result.selections and len(noised) == 2  # nothing trained or scored again


def test_every_draw_comes_from_the_selections_secret_seed(tmp_path):
    """K, the settings and the run names are functions of the seed alone; the seed is fresh entropy by default."""
    selection = Selection(Repetitions("negative-binomial", 3.0, 1.0), score_noise=2.0)
    draws = {seed: selection_sweep._draws(seed, selection, 2) for seed in range(40)}
    assert selection_sweep._draws(4, selection, 2) == draws[4]
    assert len({len(d) for d in draws.values()}) > 3 and {s for d in draws.values() for s in d} == {0, 1}
    place = selection_sweep._Selection(str(tmp_path / "a"), "eps1-r0")
    names = [os.path.basename(place.run_path(seed, j)) for seed in (4, 5) for j in range(3)]
    assert len(set(names)) == 6 and all(n.startswith("run-") and len(n) == 20 for n in names)
    seeds = [selection_sweep._Selection(str(tmp_path / d), "eps1-r0").begin({"asked": d}, None) for d in ("b", "c")]
    assert seeds[0] != seeds[1] and all(0 <= s < 2**63 for s in seeds)
    again = selection_sweep._Selection(str(tmp_path / "b"), "eps1-r0")
    assert again.begin({"asked": "b"}, None) == seeds[0]  # continued with its own seed
    with pytest.raises(DataError, match="other data, grid or settings"):
        again.begin({"asked": "other"}, None)


def test_a_selection_is_refused_with_what_it_cannot_honour(features, tmp_path):
    with pytest.raises(InvalidConfigError, match="held-out rows"):
        _config(features, tmp_path, training=TrainingConfig(mode="features", batch_size=128, steps=10))
    with pytest.raises(InvalidConfigError, match="--baseline"):
        _config(features, tmp_path, baseline=True)
    with pytest.raises(InvalidConfigError, match="one mechanism"):
        _config(features, tmp_path, grid=(("batch_size", (64, 128)),))
    assert not (tmp_path / "sweep.json").exists()


def test_a_selection_and_a_plain_sweep_never_share_a_directory(features, tmp_path):
    out = tmp_path / "sweep"
    _run(_config(features, out, seed=1))
    plain = _config(
        features, out, private_selection=None, training=dataclasses.replace(_config(features, out).training, holdout=0)
    )
    with pytest.raises(DataError, match="private selections"):
        sweep.run(plain)
