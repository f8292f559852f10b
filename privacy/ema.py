"""Exponential moving average of parameters with the warm-up of De et al. (2022).

``mu_t = min(decay, (1 + t) / (10 + t))``: early steps, where the parameters move
fast, are averaged with a short memory. ``t`` counts real optimiser updates only;
gradient-accumulation micro-steps never touch the EMA (that would shorten its
memory by the accumulation factor). The EMA is post-processing of the privatised
parameters, so it costs no privacy.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


def ema_decay(step: int | jax.Array, decay: float) -> jax.Array:
    """The warmed-up decay ``min(decay, (1+t)/(10+t))`` for update number ``step`` (0-based)."""
    t = jnp.asarray(step, jnp.float32)
    return jnp.minimum(decay, (1.0 + t) / (10.0 + t))


def ema_update(ema_params: PyTree, params: PyTree, *, step: int | jax.Array, decay: float) -> PyTree:
    """One EMA update after optimiser update ``step``: ``mu * ema + (1 - mu) * params``."""
    mu = ema_decay(step, decay)
    return jax.tree_util.tree_map(lambda e, p: mu * e + (1.0 - mu) * p, ema_params, params)
