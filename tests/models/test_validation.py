"""The DP validator refuses example-mixing layers (BatchNorm with batch statistics) and
accepts frozen-statistics BatchNorm, GroupNorm and the built-in models."""

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn

from dpscale.errors import InvalidConfigError
from dpscale.models.registry import get_model, get_spec
from dpscale.models.validation import validate_dp_model


class _BNNet(nn.Module):
    frozen: bool

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(16, (3, 3), name="conv")(x)
        x = nn.BatchNorm(use_running_average=self.frozen or not train, name="bn_train")(x)
        return nn.Dense(3)(x.mean(axis=(1, 2)))


class _Nested(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _BNNet(frozen=False, name="backbone")(x)


class _CallTimeBN(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.BatchNorm(name="late_bn")(x, use_running_average=False).mean(axis=(1, 2))


class _RunningMean(nn.Module):
    """Not a BatchNorm, but writes batch statistics into a collection."""

    @nn.compact
    def __call__(self, x):
        mean = self.variable("stats", "mean", jnp.zeros, x.shape[-1:])
        if not self.is_initializing():
            mean.value = x.mean(axis=(0, 1, 2))
        return x - mean.value


def test_batchnorm_with_batch_statistics_is_refused_naming_the_layer():
    with pytest.raises(InvalidConfigError, match="BatchNorm.*'backbone/bn_train'.*GroupNorm"):
        validate_dp_model(_Nested(), (8, 8, 3))


def test_batchnorm_switched_to_batch_statistics_at_call_time_is_refused():
    with pytest.raises(InvalidConfigError, match="late_bn"):
        validate_dp_model(_CallTimeBN(), (8, 8, 3))


def test_any_layer_updating_state_in_training_is_refused():
    with pytest.raises(InvalidConfigError, match="stats"):
        validate_dp_model(_RunningMean(), (8, 8, 3))


def test_frozen_batchnorm_is_allowed_where_the_same_layer_with_batch_statistics_is_not():
    assert validate_dp_model(_BNNet(frozen=True), (8, 8, 3)) is None
    with pytest.raises(InvalidConfigError, match="bn_train"):
        validate_dp_model(_BNNet(frozen=False), (8, 8, 3))


def test_training_kwargs_decide_the_mode():
    validate_dp_model(_BNNet(frozen=False), (8, 8, 3), apply_kwargs={"train": False})
    with pytest.raises(InvalidConfigError):
        validate_dp_model(_BNNet(frozen=False), (8, 8, 3), apply_kwargs={"train": True})


@pytest.mark.parametrize("name", ["wrn-16-4", "cnn-small", "nf-resnet-50", "nfnet-f0"])
def test_builtin_models_keep_no_state_and_pass(name):
    model, shape = get_model(name), get_spec(name).input_shape
    variables = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((2, *shape), jnp.float32))
    assert set(variables) == {"params"}  # GroupNorm / WS / no normalisation: nothing computed across a batch
    assert validate_dp_model(model, shape, variables=variables) is None
