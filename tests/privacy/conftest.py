"""A tiny two-layer classifier shared by the privacy tests (fixture ``toy``)."""

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


@pytest.fixture
def toy():
    """This module: ``toy.loss_fn``, ``toy.init_params``, ``toy.make_batch``, ..."""
    return sys.modules[__name__]
