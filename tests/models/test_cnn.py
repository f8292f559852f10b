"""The small Fashion-MNIST CNN: size budget, shapes, GroupNorm + WS only."""

import jax
import jax.numpy as jnp
import pytest

from dpscale.errors import InvalidConfigError
from dpscale.models.cnn import small_cnn


def test_param_count_in_budget_and_no_batch_statistics():
    model = small_cnn(num_classes=10)
    variables = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 28, 28, 1), jnp.float32))
    count = sum(leaf.size for leaf in jax.tree.leaves(variables["params"]))
    assert 80_000 <= count <= 300_000
    assert set(variables) == {"params"}
    backbone = variables["params"]["backbone"]
    assert [backbone[f"conv_{i}"]["kernel"].shape[-1] for i in range(4)] == [16, 32, 64, 128]
    assert all("bias" not in backbone[f"conv_{i}"] for i in range(4))  # WS conv, GN shifts


def test_forward_shapes_on_fashion_mnist_images():
    model = small_cnn(num_classes=10)
    x = jax.random.uniform(jax.random.key(1), (5, 28, 28, 1))
    variables = jax.jit(model.init)(jax.random.key(0), x)
    logits, feats = jax.jit(lambda v, x: model.apply(v, x, return_features=True))(variables, x)
    assert logits.shape == (5, 10) and feats.shape == (5, 128)
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_channels_must_fit_the_groups():
    with pytest.raises(InvalidConfigError):
        small_cnn(channels=(24, 48))
