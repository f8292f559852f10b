"""What DP-SGD needs from every model: features + classifier compose to the forward pass,
examples never mix, and ``vmap(grad)`` over single examples gives the per-example gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpscale.models.registry import get_model, get_spec

# Tiny batches: these run real forward/backward passes on CPU.
CASES = [("cnn-small", 4), ("wrn-16-4", 2)]


@functools.cache
def _setup(name, batch):
    spec = get_spec(name)
    model = get_model(name)
    key_x, key_y, key_init, key_other = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(key_x, (batch, *spec.input_shape))
    y = jax.random.randint(key_y, (batch,), 0, spec.num_classes)
    variables = jax.jit(model.init)(key_init, x)
    # Non-zero head so gradients reach the backbone in every test.
    variables = jax.tree.map(lambda a: a + 0.01, variables)
    other = jax.random.normal(key_other, x.shape)
    return model, variables, x, y, other


@pytest.mark.parametrize("name,batch", CASES)
def test_features_then_classify_equals_forward(name, batch):
    model, variables, x, _, _ = _setup(name, batch)
    head_only = {"params": {"head": variables["params"]["head"]}}

    @jax.jit  # one compilation for all three paths
    def paths(variables, x):
        logits, feats = model.apply(variables, x, return_features=True)
        direct = model.apply(variables, x, method="features")
        return logits, feats, direct, model.apply(head_only, direct, method="classify")

    logits, feats, direct, relogits = paths(variables, x)
    assert feats.shape == (batch, get_spec(name).feature_dim)
    np.testing.assert_allclose(direct, feats, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(relogits, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,batch", CASES)
def test_examples_do_not_mix(name, batch):
    model, variables, x, _, other = _setup(name, batch)
    forward = jax.jit(model.apply)
    changed = x.at[1:].set(other[1:] * 3.0)
    out, out_changed = forward(variables, x), forward(variables, changed)
    np.testing.assert_allclose(out_changed[0], out[0], rtol=1e-5, atol=1e-5)
    assert not np.allclose(out_changed[1:], out[1:], atol=1e-4)
    # A batch of one gives the same answer as inside a batch.
    np.testing.assert_allclose(forward(variables, x[:1])[0], out[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,batch", CASES)
def test_vmap_grad_gives_per_example_gradients(name, batch):
    model, variables, x, y, _ = _setup(name, batch)
    params = variables["params"]

    def loss(params, xi, yi):
        logits = model.apply({"params": params}, xi[None])
        return optax.softmax_cross_entropy_with_integer_labels(logits, yi[None]).sum()

    per_example = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))(params, x, y)
    single = jax.jit(jax.grad(loss))(params, x[0], y[0])
    first = jax.tree.map(lambda g: g[0], per_example)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(single)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)

    norms = jnp.sqrt(sum(jnp.sum(g.reshape(batch, -1) ** 2, axis=1) for g in jax.tree.leaves(per_example)))
    assert bool(jnp.all(norms > 0))
    backbone = per_example["backbone"]
    stem = backbone["stem"] if "stem" in backbone else backbone["conv_0"]
    assert float(jnp.abs(jax.tree.leaves(stem)[0]).max()) > 0.0  # gradients reach the input layer
    if name != "cnn-small":
        return  # the batched-gradient cross-check costs another compilation; the CNN covers it

    def batch_loss(params):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()

    summed = jax.jit(jax.grad(batch_loss))(params)
    for a, b in zip(jax.tree.leaves(per_example), jax.tree.leaves(summed)):
        np.testing.assert_allclose(a.sum(axis=0), b, rtol=1e-3, atol=1e-5)
