"""Every random stream drawn from a run's (or a private selection's) secret seed, in one registry.

A run has one secret seed (``privacy.seeds``: 63 bits of OS entropy by default). Each use of
it (noise, batch sampling, augmentation, initialisation, one-off releases, the audit's
models) draws from its own stream, derived from *all* bits of the seed and the stream's
constant below, then from a path of integers (a step, a model index). Two draws share
randomness only if seed, stream and path are all equal (short of a collision of the threefry
hash), so no stream can replay another's noise however many steps or models a run has: the
stream is always folded in first, so a step number can never stand in for a stream constant.

Stream constants only need to be distinct; they are part of no file format.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import jax
import numpy as np

from dpscale.privacy.noise import key_from_seed


class Stream(enum.IntEnum):
    NOISE = 1  # DP-SGD noise, per optimiser step (and per audited model)
    SAMPLING = 2  # Poisson batch selection, per step (and per audited model)
    AUGMENTATION = 3  # crops and flips of the K views, per step and micro-batch
    INIT = 4  # initial parameters of a model trained from scratch
    FEATURE_MEAN = 5  # the Gaussian release of the centring mean of cached features
    AUDIT_DATA = 6  # which rows form an audit's data set D, and its canaries
    SELECTION = 7  # a private selection's draws: its number of runs, each run's setting, each score's noise


def stream_key(seed: int, stream: Stream, *path: int | jax.Array) -> jax.Array:
    """A JAX key for ``stream`` of ``seed``, folded with ``path`` (traceable in ``path``)."""
    key = jax.random.fold_in(key_from_seed(seed), int(stream))
    for part in path:
        key = jax.random.fold_in(key, part)
    return key


class ModelKeys(NamedTuple):
    """The keys of one of many models trained side by side (audits, quick searches).

    Each is ``stream_key(seed, stream, model)``: the stream is folded in before the model
    index, so model m's init key can never equal model m''s noise or sampling key.
    Per step, ``sampling`` and ``noise`` are folded with the step number.
    """

    init: jax.Array
    sampling: jax.Array
    noise: jax.Array


def model_keys(seed: int, model: int | jax.Array) -> ModelKeys:
    """The init, sampling and noise keys of model ``model`` (traceable in ``model``)."""
    return ModelKeys(*(stream_key(seed, s, model) for s in (Stream.INIT, Stream.SAMPLING, Stream.NOISE)))


def stream_rng(seed: int, stream: Stream, *path: int) -> np.random.Generator:
    """A NumPy generator for ``stream`` of ``seed`` at ``path`` (all bits of each go into its seeding)."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return np.random.default_rng([seed, int(stream), *(int(p) for p in path)])
