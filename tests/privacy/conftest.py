"""Helpers shared by the privacy tests: a tiny two-layer classifier (fixture ``toy``) and image-model
helpers (fixture ``nets``: a loss for a Flax model, random batches and parameters, tree comparison).
Both fixtures are this module."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest


def loss_fn(params, model_state, views):
    """Mean cross-entropy over the leading (view) axis; views = {"x": [K, d], "y": [K]}."""
    del model_state
    hidden = jnp.tanh(views["x"] @ params["w1"] + params["b1"])
    logits = hidden @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, views["y"]).mean()


def init_params(seed: int, *, dim: int = 6, hidden: int = 5, classes: int = 3):
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.normal(size=(dim, hidden)), jnp.float32),
        "b1": jnp.asarray(rng.normal(size=(hidden,)) * 0.1, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(hidden, classes)), jnp.float32),
        "b2": jnp.zeros((classes,), jnp.float32),
    }


def make_batch(seed: int, n: int, *, views: int = 1, dim: int = 6, classes: int = 3, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, views, dim)) * scale
    y = np.repeat(rng.integers(0, classes, size=(n, 1)), views, axis=1)
    return {"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y, jnp.int32)}


def split(batch, sizes):
    """Split a batch pytree along axis 0 into consecutive pieces of the given sizes."""
    out, start = [], 0
    for size in sizes:
        out.append(jax.tree_util.tree_map(lambda a: a[start : start + size], batch))
        start += size
    return out


def flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(tree)])


def image_loss(model):
    """Mean cross-entropy of a Flax image classifier over one example's views
    (``{"image": [K, H, W, C], "label": [K]}``)."""

    def loss_fn(params, model_state, views):
        logits = model.apply({"params": params, **model_state}, views["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, views["label"]).mean()

    return loss_fn


def image_batch(seed: int, size: int, views: int, shape, classes: int = 10):
    """Gaussian images ``[size, views, *shape]`` with random labels."""
    rng = np.random.default_rng(seed)
    return {
        "image": jnp.asarray(rng.normal(size=(size, views, *shape)), jnp.float32),
        "label": jnp.asarray(rng.integers(0, classes, (size, views)), jnp.int32),
    }


def random_params(model, shape, seed: int = 0):
    """Gaussian parameters of the model's shapes (GroupNorm scales away from 1, so their gradients
    are generic), without compiling its initialiser."""
    rng = np.random.default_rng(seed)
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, *shape)))["params"]
    return jax.tree_util.tree_map(
        lambda a: jnp.asarray(rng.normal(size=a.shape) / np.sqrt(np.prod(a.shape[:-1] or (1,))), a.dtype), abstract
    )


def assert_trees_close(actual, expected, rtol: float = 1e-5):
    """Leaf by leaf within ``rtol`` of each expected leaf's largest entry; no leaf may be all zero."""
    for (path, a), e in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree_util.tree_leaves(expected)):
        scale = float(jnp.max(jnp.abs(e)))
        assert scale > 0, f"{jax.tree_util.keystr(path)} is all zero: the test cannot tell rules apart"
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(e), rtol=0, atol=rtol * scale, err_msg=jax.tree_util.keystr(path)
        )


def scan_lengths(jaxpr) -> list[int]:
    """The trip counts of every loop (``scan``, as ``lax.map`` makes) in a jaxpr and its sub-jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found.append(eqn.params["length"])
        for sub in jax.core.jaxprs_in_params(eqn.params):
            found += scan_lengths(sub)
    return found


@pytest.fixture
def toy():
    """This module: ``toy.loss_fn``, ``toy.init_params``, ``toy.make_batch``, ..."""
    return sys.modules[__name__]


@pytest.fixture
def nets():
    """This module: ``nets.image_loss``, ``nets.image_batch``, ``nets.random_params``, ``nets.assert_trees_close``, ``nets.scan_lengths``."""
    return sys.modules[__name__]
