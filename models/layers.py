"""Layers that keep every example's computation separate, so per-example gradients stay per-example.

Weight standardisation (WS) normalises the *kernel*, not the activations, which is why it is
compatible with DP-SGD: nothing is averaged across the batch. Both convolutions standardise
as a differentiable op inside the forward pass, so the gradient flows through the statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

Array = jax.Array
Padding = str | Sequence[tuple[int, int]]

#: Gaussian fan-in initialisation ("He/LeCun normal" without truncation).
fan_in_normal = nn.initializers.variance_scaling(1.0, "fan_in", "normal")


def as_pair(value: int | Sequence[int]) -> tuple[int, int]:
    """(height, width) of a kernel size or stride given as one int or two (as flax takes them)."""
    if isinstance(value, int):
        return (value, value)
    first, second = value
    return (int(first), int(second))


def _conv(x: Array, kernel: Array, *, strides: tuple[int, int], padding: Padding, groups: int) -> Array:
    return jax.lax.conv_general_dilated(
        x,
        kernel.astype(x.dtype),
        window_strides=strides,
        padding=padding,
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=groups,
    )


def standardize_kernel(kernel: Array, *, eps: float) -> Array:
    """Zero mean, unit variance over the fan-in (all axes but the output channel)."""
    axes = tuple(range(kernel.ndim - 1))
    mean = jnp.mean(kernel, axis=axes, keepdims=True)
    var = jnp.var(kernel, axis=axes, keepdims=True)
    return (kernel - mean) * jax.lax.rsqrt(var + eps)


class WSConv(nn.Module):
    """Weight-Standardised 2-D convolution (Qiao et al. 2019), NHWC.

    Used with GroupNorm in the WRNs of De et al. 2022. No bias by default: the GroupNorm
    that follows has its own shift.
    """

    features: int
    kernel_size: int | Sequence[int] = 3
    strides: int | Sequence[int] = 1
    padding: Padding = "SAME"
    use_bias: bool = False
    feature_group_count: int = 1
    eps: float = 1e-5
    kernel_init: Any = fan_in_normal

    @nn.compact
    def __call__(self, x: Array) -> Array:
        kh, kw = as_pair(self.kernel_size)
        in_ch = x.shape[-1]
        shape = (kh, kw, in_ch // self.feature_group_count, self.features)
        kernel = self.param("kernel", self.kernel_init, shape, jnp.float32)
        weight = standardize_kernel(kernel, eps=self.eps)
        y = _conv(x, weight, strides=as_pair(self.strides), padding=self.padding, groups=self.feature_group_count)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
        return y


class ScaledWSConv(nn.Module):
    """Scaled Weight Standardisation of the NF-nets (Brock et al. 2021a, eq. 4).

    ``W_hat = gain * (W - mean) / (std * sqrt(fan_in))``: the 1/sqrt(fan_in) makes the
    layer variance-preserving for unit-variance inputs, the learnable per-channel ``gain``
    replaces the affine scale a normalisation layer would have had, and a bias is always
    present. ``eps`` bounds ``var * fan_in`` from below, as in the reference code.
    """

    features: int
    kernel_size: int | Sequence[int] = 3
    strides: int | Sequence[int] = 1
    padding: Padding = "SAME"
    feature_group_count: int = 1
    eps: float = 1e-4
    kernel_init: Any = fan_in_normal

    @nn.compact
    def __call__(self, x: Array) -> Array:
        kh, kw = as_pair(self.kernel_size)
        in_ch = x.shape[-1]
        shape = (kh, kw, in_ch // self.feature_group_count, self.features)
        kernel = self.param("kernel", self.kernel_init, shape, jnp.float32)
        gain = self.param("gain", nn.initializers.ones, (self.features,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
        fan_in = float(np.prod(shape[:-1]))
        axes = (0, 1, 2)
        mean = jnp.mean(kernel, axis=axes, keepdims=True)
        var = jnp.var(kernel, axis=axes, keepdims=True)
        scale = jax.lax.rsqrt(jnp.maximum(var * fan_in, self.eps)) * gain
        weight = (kernel - mean) * scale
        y = _conv(x, weight, strides=as_pair(self.strides), padding=self.padding, groups=self.feature_group_count)
        return y + bias.astype(y.dtype)


class GroupNorm(nn.GroupNorm):
    """GroupNorm with 16 groups by default, the choice of De et al. 2022.

    Statistics are per example (over space and a group of channels), so it is DP-safe.
    """

    num_groups: int | None = 16


# Nonlinearities rescaled so that a unit Gaussian input keeps unit variance at the output
# (Brock et al. 2021a, "gamma" = 1 / std(f(z)) for z ~ N(0, 1)); the constants are the
# published numerical estimates, kept so that imported NF weights behave identically.
def scaled_relu(x: Array) -> Array:
    """ReLU times ~sqrt(2 / (1 - 1/pi)), variance-preserving for N(0, 1) inputs."""
    return jax.nn.relu(x) * 1.7139588594436646


def scaled_gelu(x: Array) -> Array:
    """GELU times its variance-preserving gain for N(0, 1) inputs."""
    return jax.nn.gelu(x, approximate=False) * 1.7015043497085571


class SqueezeExcite(nn.Module):
    """Channel gating from spatially pooled activations; pools over one example only."""

    features: int
    hidden: int

    @nn.compact
    def __call__(self, x: Array) -> Array:
        h = jnp.mean(x, axis=(1, 2))
        h = nn.relu(nn.Dense(self.hidden, name="fc0")(h))
        h = nn.Dense(self.features, name="fc1")(h)
        return jax.nn.sigmoid(h)[:, None, None, :]


class SkipInitGain(nn.Module):
    """A learnable scalar on the residual branch, zero at init (SkipInit, De & Smith 2020)."""

    @nn.compact
    def __call__(self, x: Array) -> Array:
        return x * self.param("skip_gain", nn.initializers.zeros, (), jnp.float32)
