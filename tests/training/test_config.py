"""Training settings: flat options in and out, and config.json files of older runs."""

import dataclasses

import pytest

from dpscale.errors import InvalidConfigError
from dpscale.privacy.plan import PrivacyTarget
from dpscale.training.config import (
    FeatureSettings,
    ImageSettings,
    TrainingConfig,
    options_of,
    training_config,
    with_options,
)


def test_options_of_is_the_inverse_of_training_config():
    config = TrainingConfig(
        mode="features",
        target=PrivacyTarget(epsilon=3.0, delta=1e-6),
        batch_size=64,
        steps=9,
        holdout=5,
        ema_decay=0.5,
        features=FeatureSettings(normalization="l2", scale=4.0),
        train_split="train",
        show_progress=False,
    )
    assert with_options(config) == config
    assert training_config("features", **options_of(config)) == dataclasses.replace(config, show_progress=True)


def test_with_options_replaces_nested_settings_by_their_flag_names():
    config = TrainingConfig(batch_size=64, steps=9, show_progress=False)
    changed = with_options(config, augmult=4, epsilon=2.0, learning_rate=0.5, holdout=10)
    assert changed.images == ImageSettings(augmult=4) and changed.target.epsilon == 2.0
    assert changed.learning_rate == 0.5 and changed.holdout == 10 and changed.show_progress is False
    with pytest.raises(InvalidConfigError, match="not training options"):
        with_options(config, augmentation=4)
    with pytest.raises(InvalidConfigError, match="augmult must be >= 1"):
        with_options(config, augmult=0)


def test_a_config_json_written_before_holdout_applied_to_both_modes_is_read():
    payload = TrainingConfig(mode="features", batch_size=8, steps=2).to_json()
    payload.pop("holdout")
    payload["features"] = dict(payload["features"], holdout=7)  # where older runs kept it
    assert TrainingConfig.from_json(payload).holdout == 7
    assert TrainingConfig.from_json(TrainingConfig(holdout=3, batch_size=8, steps=2).to_json()).holdout == 3


@pytest.mark.parametrize("holdout", [-1, 1.5, True])
def test_a_bad_holdout_is_refused(holdout):
    with pytest.raises(InvalidConfigError, match="holdout must be in"):
        TrainingConfig(holdout=holdout)


def test_every_default_of_a_training_setting_is_the_training_configs():
    """One home for the recipe's defaults: the command line's flags and the library's setups read the
    same values as ``TrainingConfig``; the DP step itself takes its optimiser and EMA decay from its caller."""
    import inspect

    import click

    from dpscale.audit.sampler import SamplerAuditSetup
    from dpscale.audit.whitebox import WhiteBoxSetup
    from dpscale.cli import cli
    from dpscale.privacy.dpsgd import DpsgdStep
    from dpscale.privacy.plan import PrivacyPlan
    from dpscale.training.vmapped import TrainingSetup

    defaults = options_of(TrainingConfig())
    compared = 0
    for command in ("train", "sweep"):
        context = click.Context(cli.commands[command])
        for param in cli.commands[command].params:
            default = param.get_default(context, call=False)
            if param.name in defaults and default is not None:
                assert default == defaults[param.name], f"{command} --{param.name}"
                compared += 1
    assert compared >= 20
    for setup in (TrainingSetup, WhiteBoxSetup, SamplerAuditSetup):
        fields = {f.name: f.default for f in dataclasses.fields(setup)}
        for name in ("learning_rate", "clip_norm", "ema_decay"):
            if name in fields:
                assert fields[name] == defaults[name], f"{setup.__name__}.{name}"
    for function in (DpsgdStep.__init__, PrivacyPlan.dp_step):
        parameters = inspect.signature(function).parameters
        for name in ("optimizer", "ema_decay", "learning_rate", "clip_norm"):
            if name in parameters:
                assert parameters[name].default is inspect.Parameter.empty, f"{function.__qualname__}({name}=...)"
