"""The quickstart: public pre-training -> export -> featurize -> DP last layer, on tiny settings."""

import dataclasses
import json
import os

import numpy as np
from click.testing import CliRunner
from PIL import Image

from dpscale.cli import cli
from dpscale.models import pretrained
from dpscale.stages import quickstart


def _quickstart(args, *, stderr=None):
    result = CliRunner().invoke(cli, ["quickstart", *args])
    assert result.exit_code == 0, result.output
    if stderr is not None:
        stderr.append(result.stderr)
    assert result.stdout.count("\n") == 1  # stdout holds only the JSON result
    return json.loads(result.stdout)


def test_digits_end_to_end_then_a_rerun_reuses_the_backbone_and_features(tmp_path):
    args = [
        "--work-dir",
        str(tmp_path),
        "--no-dedup",
        "--pretrain-steps",
        "30",
        "--batch-size",
        "256",
        "--steps",
        "100",
        "--seed",
        "1",
    ]
    first = _quickstart(args)
    assert 0 < first["epsilon"] <= 8.0 and first["delta"] == 1e-5
    assert first["public_classes"] == ["0", "1", "2", "3", "4"]
    assert first["private_classes"] == ["5", "6", "7", "8", "9"]
    assert first["public_test_accuracy"] > 0.6  # chance is 0.2
    assert first["test_accuracy"] > 0.5 and first["test_examples"] == 189  # private test split
    assert first["public_removed_by_dedup"] is None and not first["pretrain_reused"]
    assert pretrained.is_complete(first["backbone"])
    assert os.path.isfile(os.path.join(first["run_dir"], "metrics.json"))
    ledger = json.loads(open(os.path.join(first["run_dir"], "ledger.json")).read())
    assert ledger["private"] and ledger["epsilon_spent"] == first["epsilon"]
    # The default learning rates were chosen on held-out rows of these digits: the result says so.
    assert quickstart.TUNED_WARNING in first["warnings"]

    again = _quickstart(args)
    assert again["pretrain_reused"] and again["backbone"] == first["backbone"]
    assert again["features"] == first["features"] and again["run_dir"] != first["run_dir"]
    assert again["test_accuracy"] == first["test_accuracy"]  # same seed, same features


def _folder_source(root):
    """train/{a,b,c,d}: 12 random 8x8 images each, brightness by class; one 'a' image copies a 'c' one."""
    rng = np.random.default_rng(0)
    images = {}
    for k, cls in enumerate("abcd"):
        (root / "train" / cls).mkdir(parents=True)
        for i in range(12):
            image = np.clip(rng.integers(0, 120, (8, 8)) + 40 * k, 0, 255).astype(np.uint8)
            Image.fromarray(image).save(root / "train" / cls / f"{i}.png")
            images[cls, i] = image
    Image.fromarray(images["c", 0]).save(root / "train" / "a" / "copy-of-c0.png")
    return f"folder:{root}"


def test_folder_source_without_test_split_dedups_public_against_private(tmp_path):
    source = _folder_source(tmp_path / "src")
    args = [
        "--data",
        source,
        "--work-dir",
        str(tmp_path / "work"),
        "--pretrain-steps",
        "5",
        "--pretrain-batch-size",
        "8",
        "--batch-size",
        "8",
        "--steps",
        "5",
        "--seed",
        "0",
    ]
    stderr = []
    out = _quickstart([*args, "--private-diagnostics"], stderr=stderr)
    assert out["public_classes"] == ["a", "b"] and out["private_classes"] == ["c", "d"]
    # Dedup's count describes the private data: shown only when asked for, with a warning.
    assert out["public_removed_by_dedup"] >= 1  # the planted copy of a private image
    assert "public_removed_by_dedup" in stderr[0] and "NOT cover" in stderr[0]
    assert any("public_removed_by_dedup" in w for w in out["warnings"])
    assert quickstart.TUNED_WARNING not in out["warnings"]  # other data: the defaults have not seen it
    assert _quickstart(args)["public_removed_by_dedup"] is None  # a re-run, without the flag
    assert out["test_split"] == "validation" and out["test_examples"] > 0
    assert 0 < out["epsilon"] <= 8.0


def test_only_the_data_the_defaults_were_chosen_on_with_those_defaults_gets_the_tuning_warning():
    config = quickstart.QuickstartConfig()
    assert quickstart._tuned_on_this_data(config)
    other_rate = dataclasses.replace(config.private, learning_rate=0.3)
    assert not quickstart._tuned_on_this_data(dataclasses.replace(config, private=other_rate))
    other_rate = dataclasses.replace(config.pretrain, learning_rate=0.3)
    assert not quickstart._tuned_on_this_data(dataclasses.replace(config, pretrain=other_rate))
    assert not quickstart._tuned_on_this_data(dataclasses.replace(config, data="idx:/data/fashion-mnist"))
    assert not quickstart._tuned_on_this_data(dataclasses.replace(config, public_classes=("5", "6", "7", "8", "9")))


def test_bad_class_splits_and_infinite_epsilon_are_one_line_errors(tmp_path):
    for args in (["--public-classes", "0"], ["--public-classes", "0,1,x"], ["--epsilon", "inf"]):
        result = CliRunner().invoke(cli, ["quickstart", "--work-dir", str(tmp_path), *args])
        assert result.exit_code == 2, (args, result.output)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_cli_defaults_are_the_config_defaults():
    config = quickstart.QuickstartConfig()
    pretrain, private = config.pretrain, config.private
    expected = {
        "data": config.data,
        "work_dir": config.work_dir,
        "model": pretrain.images.model,
        "pretrain_steps": pretrain.steps,
        "pretrain_batch_size": pretrain.batch_size,
        "pretrain_learning_rate": pretrain.learning_rate,
        "epsilon": private.target.epsilon,
        "delta": private.target.delta,
        "batch_size": private.batch_size,
        "steps": private.steps,
        "learning_rate": private.learning_rate,
        "seed": private.seed,
    }
    params = {param.name: param.default for param in cli.commands["quickstart"].params}
    assert set(expected) <= set(params)
    for name, value in expected.items():
        assert params[name] == value, name


def test_folder_names_are_keyed_not_a_plain_hash_of_the_deduplicated_data(tmp_path, monkeypatch):
    """The review's reproducer: from the public data and the pre-training config, a plain hash in the
    backbone's folder name confirmed which images dedup removed. A keyed name tests nothing without the
    owner's key store (a copied work directory included)."""
    import hashlib
    import shutil

    from dpscale.data import key_store

    monkeypatch.setenv(key_store.ENV, str(tmp_path / "owner-keys"))
    config = quickstart.QuickstartConfig(data="digits", work_dir=str(tmp_path / "work"))
    settings = {"data": "content-hash-of-the-deduplicated-public-set", "training": {"steps": 200}}
    name = quickstart._keyed_name(config, settings)
    assert name == quickstart._keyed_name(config, settings) != quickstart._keyed_name(config, settings | {"data": "x"})
    plain = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    assert name not in plain
    shutil.copytree(tmp_path / "work", tmp_path / "copy")
    monkeypatch.setenv(key_store.ENV, str(tmp_path / "someone-else"))
    copied = quickstart.QuickstartConfig(data="digits", work_dir=str(tmp_path / "copy"))
    assert quickstart._keyed_name(copied, settings) != name
