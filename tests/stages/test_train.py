"""The train and evaluate stages end to end on the bundled digits data."""

import dataclasses
import json
import math
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from click.testing import CliRunner

from dpscale.cli import cli
from dpscale.data.dataset import IngestedDataset
from dpscale.errors import DataError, InfeasiblePrivacyTargetError, InvalidConfigError
from dpscale.privacy.plan import PrivacyTarget
from dpscale.privacy.tuning import device as device_tuning
from dpscale.stages import evaluate, ingest, train
from dpscale.training.config import FeatureSettings, ImageSettings, TrainingConfig, training_config
from dpscale.training.run_directory import RunDirectory


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("data") / "digits")
    ingest.run(ingest.IngestConfig(source="digits", output_dir=out))
    return out


def _training(epsilon=4.0, backbone=None, **overrides):
    base = dict(
        target=PrivacyTarget(epsilon=epsilon, delta=1e-5, sampling=overrides.pop("sampling", "poisson")),
        batch_size=64,
        steps=3,
        microbatch_size=32,
        seed=0,
        show_progress=False,
        images=ImageSettings(augmult=2, augment_pad=1, backbone=backbone),
    )
    return TrainingConfig(**(base | overrides))


def _config(digits, run_dir, **overrides):
    return train.TrainConfig(data=digits, run_dir=str(run_dir), training=_training(**overrides))


def test_train_writes_ledger_metrics_and_params(digits, tmp_path):
    result = train.run(_config(digits, tmp_path / "run"))
    run = tmp_path / "run"
    ledger = json.loads((run / "ledger.json").read_text())
    assert 0 < result.epsilon <= 4.0 and ledger["epsilon_spent"] == result.epsilon
    assert ledger["sampling"] == "poisson" and ledger["exact_accounting"] is True
    assert ledger["steps_done"] == ledger["planned_steps"] == 3
    assert ledger["sampling_rate"] == pytest.approx(64 / IngestedDataset(digits).num_examples("train"))
    assert IngestedDataset(digits).content_hash not in json.dumps(ledger)  # no plain hash of the data
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert lines[-1]["epsilon_spent"] == result.epsilon
    spec = RunDirectory.existing(str(run)).read_spec()
    assert spec.plan.noise_multiplier == pytest.approx(result.noise_multiplier)
    assert spec.training == dataclasses.replace(_training(), seed=None) and spec.data == digits  # no seed

    scores = evaluate.run(evaluate.EvaluateConfig(run_dir=str(run)))
    assert scores.num_examples == IngestedDataset(digits).num_examples("test")
    assert 0.0 <= scores.top1 <= scores.top5 <= 1.0
    saved = json.loads((run / "metrics.json").read_text())
    assert saved["ema_top1"] == scores.ema_top1
    assert saved["test_accuracy"] == scores.ema_top1 == scores.as_dict()["test_accuracy"]  # the headline name


def test_refuses_an_infeasible_target_before_writing_anything(digits, tmp_path):
    with pytest.raises(InfeasiblePrivacyTargetError):
        train.run(_config(digits, tmp_path / "run", epsilon=0.05, steps=None, noise_multiplier=0.3))
    assert not (tmp_path / "run").exists()


def test_never_overwrites_an_existing_run(digits, tmp_path):
    train.run(_config(digits, tmp_path / "run", steps=1))
    with pytest.raises(DataError, match="already holds a run"):
        train.run(_config(digits, tmp_path / "run", steps=1))


def test_shuffled_sampling_warns_and_is_flagged_in_the_ledger(digits, tmp_path):
    with pytest.warns(UserWarning, match="not Poisson"):
        train.run(_config(digits, tmp_path / "run", steps=1, sampling="shuffle"))
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert ledger["sampling"] == "shuffle" and ledger["exact_accounting"] is False


def test_train_cli_reports_missing_data_in_one_line(tmp_path):
    result = CliRunner().invoke(
        cli, ["train", str(tmp_path / "nope"), str(tmp_path / "run"), "--steps", "1", "--batch-size", "8"]
    )
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


def _train_args(digits, run_dir, *, steps, every, seed):
    return [
        sys.executable,
        "-m",
        "dpscale",
        "train",
        digits,
        str(run_dir),
        "--epsilon",
        "4",
        "--batch-size",
        "64",
        "--steps",
        str(steps),
        "--microbatch-size",
        "32",
        "--augmult",
        "2",
        "--augment-pad",
        "1",
        "--checkpoint-every",
        str(every),
        "--seed",
        str(seed),
    ]


def test_kill_9_then_resume_gives_the_uninterrupted_result(digits, tmp_path):
    steps, every, seed = 24, 4, 5
    reference = train.run(_config(digits, tmp_path / "reference", steps=steps, checkpoint_every=every, seed=seed))

    run_dir = tmp_path / "killed"
    process = subprocess.Popen(
        _train_args(digits, run_dir, steps=steps, every=every, seed=seed),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 600
    checkpoints = run_dir / "checkpoints"
    while time.time() < deadline and process.poll() is None:
        done = [int(p.name) for p in checkpoints.glob("*") if p.name.isdigit()] if checkpoints.exists() else []
        if done and max(done) >= 2 * every:
            break
        time.sleep(0.2)
    assert process.poll() is None, "the run finished before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (run_dir / "params").exists()

    resumed = train.run(train.ResumeConfig(str(run_dir), show_progress=False))
    assert resumed.epsilon == reference.epsilon and resumed.steps == steps
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["steps_done"] == steps and ledger["epsilon_spent"] == reference.epsilon
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, steps + 1))  # every step exactly once
    got = RunDirectory(str(run_dir)).load_params()
    want = RunDirectory(str(tmp_path / "reference")).load_params()
    for key in ("params", "ema_params"):
        for a, b in zip(jax.tree_util.tree_leaves(got[key]), jax.tree_util.tree_leaves(want[key])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_non_private_baseline_needs_no_calibration(digits, tmp_path):
    result = train.run(
        _config(digits, tmp_path / "run", epsilon=math.inf, momentum=0.9, learning_rate=0.1, weight_decay=1e-4, steps=2)
    )
    assert math.isinf(result.epsilon) and result.noise_multiplier == 0.0
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert ledger["private"] is False and ledger["epsilon_spent"] == "inf"


def test_fine_tunes_a_pretrained_backbone_with_its_preprocessing(digits, tmp_path):
    from dpscale.models import pretrained, registry
    from dpscale.training.model import build_train_model

    model = registry.get_model("cnn-small", num_classes=5)
    variables = jax.jit(model.init)(jax.random.key(0), np.zeros((1, 12, 12, 1), np.float32))
    prep = pretrained.Preprocessing(resolution=12, mean=(127.5,), std=(127.5,))
    pretrained.save_pretrained(tmp_path / "backbone", variables, model="cnn-small", num_classes=5, preprocessing=prep)
    config = _config(digits, tmp_path / "run", backbone=str(tmp_path / "backbone"), steps=2)
    start = build_train_model(config.data, config.training).init_params(0)
    np.testing.assert_array_equal(
        np.asarray(start["backbone"]["conv_0"]["kernel"]),
        np.asarray(variables["params"]["backbone"]["conv_0"]["kernel"]),
    )
    assert all(not np.any(np.asarray(leaf)) for leaf in jax.tree_util.tree_leaves(start["head"]))
    assert jax.tree_util.tree_leaves(start["head"])[0].shape[-1] == 10  # digits has 10 classes
    train.run(config)
    scores = evaluate.run(evaluate.EvaluateConfig(run_dir=str(tmp_path / "run")))
    assert scores.num_examples == IngestedDataset(digits).num_examples("test")


def test_a_gpus_choices_by_its_cost_model_are_logged_per_layer_and_kept_in_the_run(
    digits, tmp_path, monkeypatch, caplog
):
    from dpscale.privacy.tuning import choose

    monkeypatch.setattr(choose, "tuning_for", lambda: device_tuning.tuning_for("gpu"))  # as on an NVIDIA GPU
    with caplog.at_level("INFO", logger="dpscale.training.model"):
        train.run(_config(digits, tmp_path / "gpu", steps=1))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("clip path of ")]
    assert lines and all(", estimated: " in line for line in lines)  # each layer, what it chose from
    paths = json.loads((tmp_path / "gpu" / "clip_paths.json").read_text())
    chosen = [layer for layer in paths["layers"] if layer["strategy"] != "book-keeping"]
    assert len(chosen) == len(lines) and all(layer["reason"].startswith("estimated: ") for layer in chosen)


def test_the_memory_check_is_made_again_with_the_chosen_clip_paths_working_set(digits, tmp_path, monkeypatch):
    from dpscale.training import memory
    from dpscale.training.model import build_train_model

    checked = []
    monkeypatch.setattr(memory, "check_fits", lambda found, **kwargs: checked.append(found))
    config = _config(digits, tmp_path / "run", steps=1)
    model = build_train_model(config.data, config.training)
    assert len(checked) == 1  # the estimate alone, before anything compiles
    fn = model.clipped_sum_fn(1.0)
    assert len(checked) == 2 and checked[1].per_example_bytes > checked[0].per_example_bytes
    examples = config.training.effective_microbatch_size // jax.device_count()
    assert checked[1] == memory.with_clip_paths(checked[0], fn.layers, examples=examples)


def test_per_layer_norms_are_used_and_train_like_the_vmap_path(digits, tmp_path, monkeypatch, caplog):
    from dpscale.training import model as train_model
    from dpscale.training import trainer

    with caplog.at_level("INFO", logger="dpscale.training.model"):
        train.run(_config(digits, tmp_path / "bk", steps=2))
    assert "per-example gradients: per-layer norms from one batched backward" in caplog.text
    assert "ghost" in caplog.text and "explicit" in caplog.text  # the log names each layer's path
    paths = json.loads((tmp_path / "bk" / "clip_paths.json").read_text())  # and the run directory, why
    assert paths["backend"] == "cpu" and {layer["reason"] for layer in paths["layers"]} >= {"rule"}
    assert {layer["strategy"] for layer in paths["layers"]} >= {"ghost", "explicit", "book-keeping"}

    def without_fast_path(data, config):
        return dataclasses.replace(train_model.build_train_model(data, config), clipped_sum_fn=lambda clip: None)

    monkeypatch.setattr(trainer, "build_train_model", without_fast_path)
    train.run(_config(digits, tmp_path / "vmap", steps=2))
    got = RunDirectory(str(tmp_path / "bk")).load_params()
    want = RunDirectory(str(tmp_path / "vmap")).load_params()
    # The per-layer paths clip with proven bounds of the norms, up to 0.7% above vmap's (ghost's most:
    # docs/privacy.md), so a clipped example's share of the update differs by that much: within 1% of
    # what two steps changed, where another gradient would differ by the change itself.
    config = _config(digits, tmp_path / "unused", steps=2).training
    start = train_model.build_train_model(digits, dataclasses.replace(config, seed=0)).init_params(0)
    for a, b, b0 in zip(*(jax.tree_util.tree_leaves(t) for t in (got, want, start))):
        moved = float(np.max(np.abs(np.asarray(b) - np.asarray(b0))))
        assert moved > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-2 * moved)


def test_flat_options_nest_into_a_training_config_and_an_option_of_another_mode_is_refused():
    assert training_config("images") == TrainingConfig()
    features = training_config("features", holdout=3, feature_normalization="l2", feature_scale=2.0)
    assert features.features == FeatureSettings(normalization="l2", scale=2.0) and features.images == ImageSettings()
    assert features.holdout == 3
    images = training_config("images", epsilon=2.0, accountant="rdp", augment_flip=False, holdout=3)
    assert images.images == ImageSettings(augment_flip=False) and images.features == FeatureSettings()
    assert images.holdout == 3
    assert images.target == PrivacyTarget(epsilon=2.0, accountant="rdp")
    for mode, option, says in (
        ("features", dict(model="wrn-16-4"), "--model does not apply to features mode"),
        ("features", dict(augment_flip=False), "--no-flip does not apply to features mode"),
        ("images", dict(feature_scale=2.0), "--feature-scale does not apply to images mode"),
        ("activations", dict(feature_normalization="l2"), "--feature-normalization does not apply to activations"),
        ("activations", dict(augment_pad=2), "--augment-pad does not apply to activations mode"),
        ("features", dict(feature_scale=2.0), "--feature-scale is used only with --feature-normalization l2"),
        ("images", dict(model="wrn-16-4", backbone="bb"), "--model is used only without --backbone"),
    ):
        with pytest.raises(InvalidConfigError, match=says):
            training_config(mode, **option)
    with pytest.raises(InvalidConfigError, match="--model does not apply"):  # typed, even at its default value
        training_config("features", model="cnn-small", given=("model",))
    with pytest.raises(InvalidConfigError, match="not a top above a cut"):  # it stood for the cut's first top
        training_config("activations", model="cnn-small", given=("model",))


def test_a_run_from_options_takes_the_mode_of_its_data(tmp_path):
    from dpscale.cache.feature_store import METADATA

    (tmp_path / METADATA).write_text("{}")
    assert train.TrainConfig.from_options(str(tmp_path), "run").training.mode == "features"
    assert train.TrainConfig.from_options(str(tmp_path / "images"), "run").training.mode == "images"
    assert train.TrainConfig.from_options(str(tmp_path), "run", mode="features").training.mode == "features"
    with pytest.raises(DataError, match="--mode images trains on ingested images, and .* holds pooled features"):
        train.TrainConfig.from_options(str(tmp_path), "run", mode="images")
    one = dict(epsilon=math.inf, batch_size=8, steps=2)  # a non-private run uses no DP-only option
    with pytest.raises(InvalidConfigError, match="--clip-norm is used only under DP"):
        train.TrainConfig.from_options(str(tmp_path), "run", clip_norm=2.0, **one)
    with pytest.raises(InvalidConfigError, match="--delta is used only under DP"):
        train.TrainConfig.from_options(str(tmp_path), "run", delta=1e-5, given=("delta",), **one)


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_cli_defaults_are_the_training_config_defaults(command):
    config = TrainingConfig()
    target, images, features = config.target, config.images, config.features
    expected = {
        "epsilon": target.epsilon,
        "delta": target.delta,
        "accountant": target.accountant,
        "sampling": target.sampling,
        "batch_size": config.batch_size,
        "steps": config.steps,
        "noise_multiplier": config.noise_multiplier,
        "clip_norm": config.clip_norm,
        "learning_rate": config.learning_rate,
        "momentum": config.momentum,
        "weight_decay": config.weight_decay,
        "microbatch_size": config.microbatch_size,
        "ema_decay": config.ema_decay,
        "checkpoint_every": config.checkpoint_every,
        "devices": config.devices,
        "seed": config.seed,
        "model": images.model,
        "backbone": images.backbone,
        "augmult": images.augmult,
        "augment_pad": images.augment_pad,
        "holdout": config.holdout,
        "feature_normalization": features.normalization,
        "feature_mean_noise_multiplier": features.mean_noise_multiplier,
        "feature_scale": features.scale,
    }
    params = {param.name: param.default for param in cli.commands[command].params}
    shared = set(expected) & set(params)
    assert len(shared) >= 20, sorted(shared)
    for name in shared:
        assert params[name] == expected[name], name
