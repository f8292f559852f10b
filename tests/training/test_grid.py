"""Sweep grids: points, run names that spell every value, refusals, and TAN simulations."""

import math

import pytest

from dpscale.errors import InvalidConfigError
from dpscale.privacy.plan import PrivacyPlan, PrivacyTarget
from dpscale.training.config import TrainingConfig
from dpscale.training.grid import check_axes, grid_points, run_name, simulate, value_text

BASE = TrainingConfig(batch_size=64, steps=3, show_progress=False)


def test_every_gridded_value_is_in_the_run_name_and_the_settings():
    axes = (
        ("epsilon", (1.0, 8.0)),
        ("learning_rate", (2.0,)),
        ("augmult", (1, 4)),
        ("ema_decay", (0.0, 0.999)),
        ("model", ("cnn-small",)),
    )
    points = grid_points(BASE, axes, repeats=2)
    assert len(points) == 2 * 2 * 2 * 2
    assert points[0].name == "eps1-lr2-augmult1-ema-decay0-model-cnn-small-r0"
    assert len({p.name for p in points}) == len(points)
    for p in points:
        values = dict(p.values)
        assert p.training.target.epsilon == values["epsilon"] and p.training.images.augmult == values["augmult"]
        assert p.training.ema_decay == values["ema_decay"] and p.training.seed is None
        assert f"augmult{values['augmult']}" in p.name and f"ema-decay{value_text(values['ema_decay'])}" in p.name
    assert dict(points[0].setting) == {"learning_rate": 2.0, "augmult": 1, "ema_decay": 0.0, "model": "cnn-small"}


def test_names_are_exact_for_close_numbers_and_path_safe_for_text():
    assert value_text(0.1 + 0.2) != value_text(0.3) and value_text(8.0) == "8" and value_text(1024) == "1024"
    assert value_text("../x y") == ".._x_y" and "/" not in value_text("/abs/backbone")
    assert run_name((("epsilon", math.inf), ("learning_rate", 0.5)), 1, kind="baseline") == "nonprivate-lr0.5-r1"
    assert (
        run_name((("epsilon", 2.0), ("learning_rate", 1.0)), 0, kind="simulated", simulate_batch=32)
        == "sim-b32-eps2-lr1-r0.NOT-PRIVATE"
    )


def test_colliding_names_and_options_that_change_nothing_are_refused():
    with pytest.raises(InvalidConfigError, match="both get the run name"):
        grid_points(BASE, (("epsilon", (1.0,)), ("learning_rate", (2.0,)), ("backbone", ("a/b", "a_b"))), repeats=1)
    features = TrainingConfig(mode="features", batch_size=64, steps=3)
    with pytest.raises(InvalidConfigError, match="does not apply to features mode"):
        grid_points(features, (("epsilon", (1.0,)), ("learning_rate", (2.0,)), ("augmult", (1, 4))), repeats=1)


@pytest.mark.parametrize(
    "axes, match",
    [
        ((("seed", (1,)),), "not a grid option"),
        ((("delta", (1e-5,)),), "not a grid option"),
        ((("holdout", (10,)),), "not a grid option"),
        ((("colour", (1,)),), "not a training option"),
        ((("augmult", ()),), "at least one value"),
        ((("augmult", (2, 2)),), "listed twice"),
        ((("augmult", (1,)), ("augmult", (2,))), "more than once"),
    ],
)
def test_bad_axes_are_refused(axes, match):
    with pytest.raises(InvalidConfigError, match=match):
        check_axes(axes)


def test_a_simulation_keeps_the_steps_and_sigma_over_b_and_spends_its_own_epsilon():
    target = PrivacyPlan.calibrate(
        PrivacyTarget(epsilon=4.0, accountant="rdp"), num_examples=10_000, batch_size=1000, steps=50
    )
    training = TrainingConfig(target=PrivacyTarget(epsilon=4.0, accountant="rdp"), batch_size=1000, steps=50)
    sim = simulate(training, target, batch_size=100)
    assert sim.plan.batch_size == 100 and sim.plan.steps == target.steps == 50
    assert sim.plan.noise_multiplier / 100 == pytest.approx(target.noise_multiplier / 1000)
    assert sim.training.batch_size == 100 and sim.training.steps == 50 and sim.training.noise_multiplier is None
    assert sim.training.target.epsilon == sim.plan.epsilon() > target.epsilon()  # less noise per example
    # The run calibrates to its own spend: sigma lands on the scaled one (never below it).
    run = PrivacyPlan.calibrate(sim.training.target, num_examples=10_000, batch_size=100, steps=50)
    assert sim.plan.noise_multiplier <= run.noise_multiplier <= sim.plan.noise_multiplier * 1.002
    with pytest.raises(InvalidConfigError, match="must be below"):
        simulate(training, target, batch_size=1000)
