"""A fixed wavelet front end (2-D scattering transform) and the models built on it.

Tramer & Boneh (2021, "Differentially private learning needs better features") showed
that a scattering transform (Mallat 2012; Bruna & Mallat 2013) is a strong hand-made
feature extractor for DP-SGD on small images: it has no parameters, so it neither learns
from the private data nor adds dimensions to the per-example gradient, and linear or small
CNN models on top of it beat end-to-end DP CNNs on (Fashion-)MNIST and CIFAR-10.

Written here rather than taken from kymatio: kymatio 0.3.0 (the last release) fails to
import with SciPy >= 1.15 (``scipy.special.sph_harm`` was removed), and its filter bank is
all we would need from it.

The transform (``J`` scales, ``L`` angles, order 2) maps ``(B, H, W, C)`` images to
``(B, H / 2^J, W / 2^J, C * K)`` maps with ``K = 1 + J L + L^2 J (J - 1) / 2`` (81 for
J=2, L=8): the low-pass average, first-order ``|x * psi| * phi`` and second-order
``||x * psi_1| * psi_2| * phi`` coefficients. Convolutions are products in the Fourier
domain of the image reflect-padded by ``2^(J+1)`` pixels per side (so periodic wrap-around
does not mix opposite borders), with Morlet filters built on that padded grid.

Each coefficient map is then normalised per example (``ScatterNorm``: a GroupNorm without
learnable scale or shift), which costs no privacy because it reads one example only;
Tramer & Boneh used GroupNorm in the same place.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from dpscale.errors import InvalidConfigError
from dpscale.models.classifier import Classifier, ImageClassifier
from dpscale.models.cnn import checked_channels
from dpscale.models.layers import GroupNorm, WSConv

Array = jax.Array

#: Morlet / Gaussian widths as in the scattering literature: sigma = 0.8 * 2^j,
#: centre frequency 3 pi / 4 / 2^j, and an elongation (slant) of 4 / L across the wave.
SIGMA0 = 0.8
XI0 = 3.0 * math.pi / 4.0


def num_channels(J: int, L: int) -> int:
    """Scattering maps per input channel for order 2: 1 + J L + L^2 J (J - 1) / 2."""
    return 1 + J * L + L * L * J * (J - 1) // 2


def _grid(size: int) -> np.ndarray:
    """Signed pixel offsets 0, 1, ..., -1 laid out as an FFT expects (origin at index 0)."""
    return np.fft.fftfreq(size, d=1.0 / size)


def _gabor(size: int, sigma: float, theta: float, xi: float, slant: float) -> np.ndarray:
    """A Gabor filter on a ``size x size`` periodic grid, L1-normalised envelope."""
    y, x = np.meshgrid(_grid(size), _grid(size), indexing="ij")
    # coordinates along the wave direction (u) and across it (v)
    u = x * math.cos(theta) + y * math.sin(theta)
    v = -x * math.sin(theta) + y * math.cos(theta)
    envelope = np.exp(-(u * u + (slant * v) ** 2) / (2.0 * sigma * sigma))
    envelope /= envelope.sum()
    return envelope * np.exp(1j * xi * u)


def _morlet(size: int, sigma: float, theta: float, xi: float, slant: float) -> np.ndarray:
    """A Gabor filter minus a multiple of its envelope so that its mean is exactly 0."""
    gabor = _gabor(size, sigma, theta, xi, slant)
    envelope = np.abs(_gabor(size, sigma, theta, 0.0, slant))
    return gabor - gabor.sum() / envelope.sum() * envelope


@functools.lru_cache(maxsize=16)
def filter_bank(size: int, J: int, L: int) -> tuple[np.ndarray, np.ndarray]:
    """Fourier transforms of the wavelets ``(J * L, size, size)`` (index ``j * L + l``) and of
    the low-pass ``(size, size)``; cached because they depend on the shape only."""
    slant = 4.0 / L
    psi = [
        np.fft.fft2(_morlet(size, SIGMA0 * 2**j, math.pi * (L - 1 - angle) / L, XI0 / 2**j, slant))
        for j in range(J)
        for angle in range(L)
    ]
    phi = np.fft.fft2(_gabor(size, SIGMA0 * 2**J, 0.0, 0.0, 1.0)).real
    return np.stack(psi).astype(np.complex64), phi.astype(np.float32)


class Scattering2D(nn.Module):
    """Order-2 scattering of NHWC images (no parameters); see the module docstring."""

    J: int = 2
    L: int = 8

    def __call__(self, x: Array) -> Array:
        if self.J < 1 or self.L < 1:
            raise InvalidConfigError(f"scattering needs J >= 1 and L >= 1, got J={self.J}, L={self.L}")
        batch, height, width, channels = x.shape
        step = 2**self.J
        if height % step or width % step:
            raise InvalidConfigError(
                f"scattering with J={self.J} needs image sides divisible by {step}, got {height}x{width}"
            )
        pad = 2 * step
        size = max(height, width) + 2 * pad
        psi, phi = (jnp.asarray(a) for a in filter_bank(size, self.J, self.L))
        # (B, C, size, size): reflect-pad, then square (the bank is square)
        img = jnp.transpose(x, (0, 3, 1, 2))
        img = jnp.pad(img, ((0, 0), (0, 0), (pad, size - height - pad), (pad, size - width - pad)), mode="reflect")
        spectrum = jnp.fft.fft2(img)

        def low_pass(spec: Array) -> Array:  # (..., size, size) spectrum -> (..., H/2^J, W/2^J)
            out = jnp.fft.ifft2(spec * phi).real
            return out[..., pad : pad + height : step, pad : pad + width : step]

        def modulus(spec: Array, filters: Array) -> Array:  # |x * psi| for every filter
            return jnp.abs(jnp.fft.ifft2(spec[..., None, :, :] * filters))

        order0 = low_pass(spectrum)[:, :, None]
        first = modulus(spectrum, psi)  # (B, C, J*L, size, size)
        first_spec = jnp.fft.fft2(first)
        maps = [order0, low_pass(first_spec)]
        for j1 in range(self.J - 1):
            for j2 in range(j1 + 1, self.J):
                coarse = psi[j2 * self.L : (j2 + 1) * self.L]
                second = modulus(first_spec[:, :, j1 * self.L : (j1 + 1) * self.L], coarse)
                second = second.reshape(batch, channels, self.L * self.L, size, size)
                maps.append(low_pass(jnp.fft.fft2(second)))
        coeffs = jnp.concatenate(maps, axis=2)  # (B, C, K, H', W')
        coeffs = coeffs.reshape(batch, channels * coeffs.shape[2], *coeffs.shape[3:])
        return jnp.transpose(coeffs, (0, 2, 3, 1)).astype(x.dtype)


class ScatterNorm(nn.Module):
    """Per-example GroupNorm of the scattering maps, without learnable scale or shift."""

    num_groups: int = 27

    @nn.compact
    def __call__(self, x: Array) -> Array:
        return nn.GroupNorm(num_groups=self.num_groups, use_scale=False, use_bias=False, epsilon=1e-5)(x)


def scatter_maps(x: Array, *, J: int, L: int, num_groups: int) -> Array:
    """Scattering -> per-example normalisation: ``(B, H, W, C) -> (B, H/2^J, W/2^J, C K)``.

    Called inside a compact module; also the ``scattering`` cut's activations (``models.cuts``).
    """
    return ScatterNorm(num_groups)(Scattering2D(J, L)(x))


#: The activations a scattering CNN may use. Papernot et al. (2021) and Tramer & Boneh (2021) train
#: under DP with tanh: a bounded activation keeps activations, and so per-example gradient norms, from
#: growing, so clipping discards less. (Above the scattering cut, with GroupNorm, it did not help here:
#: benchmarks/results/above_a_cut.md.)
ACTIVATIONS = {"relu": nn.relu, "tanh": jnp.tanh}


def activation_fn(name: str):
    """The activation called ``name``; ``InvalidConfigError`` naming the known ones otherwise."""
    if name not in ACTIVATIONS:
        raise InvalidConfigError(f"unknown activation {name!r} (known: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def _cnn_stages(out: Array, channels: tuple[int, ...], num_groups: int, activation: str = "relu") -> Array:
    """WS-conv + GroupNorm + activation stages, then global average pooling (inside a compact module)."""
    act = activation_fn(activation)
    for index, features in enumerate(channels):
        out = WSConv(features, 3, name=f"conv_{index}")(out)
        out = act(GroupNorm(num_groups=num_groups, name=f"norm_{index}")(out))
    return jnp.mean(out, axis=(1, 2))


class ScatterMaps(nn.Module):
    """The normalised scattering maps, unflattened (no parameters): the ``scattering`` cut."""

    J: int = 2
    L: int = 8
    num_groups: int = 27

    @nn.compact
    def __call__(self, x: Array) -> Array:
        return scatter_maps(x, J=self.J, L=self.L, num_groups=self.num_groups)


class ScatterLinearBackbone(nn.Module):
    """Scattering -> per-example normalisation -> flattened features (no parameters)."""

    J: int = 2
    L: int = 8
    num_groups: int = 27

    @nn.compact
    def __call__(self, x: Array) -> Array:
        out = scatter_maps(x, J=self.J, L=self.L, num_groups=self.num_groups)
        return out.reshape(out.shape[0], -1)


class ScatterCNNBackbone(nn.Module):
    """Scattering -> per-example normalisation -> WS-conv + GroupNorm stages -> pooled features, or,
    with ``flatten``, ``ScatterCNNTop``'s stages (maps max-pooled between stages, then flattened).

    Flattened, it is what a top trained above the ``scattering`` cut computes from images: its
    parameters have the top's names (the scattering has none), so ``export-backbone`` writes such a
    run as this.
    """

    channels: tuple[int, ...] = (64, 64)
    J: int = 2
    L: int = 8
    scatter_groups: int = 27
    num_groups: int = 16
    flatten: bool = False
    activation: str = "relu"

    @nn.compact
    def __call__(self, x: Array) -> Array:
        out = scatter_maps(x, J=self.J, L=self.L, num_groups=self.scatter_groups)
        stages = _flat_cnn_stages if self.flatten else _cnn_stages
        return stages(out, self.channels, self.num_groups, self.activation)


class ScatterCNNTop(nn.Module):
    """A CNN on cached scattering maps (trained above the ``scattering`` cut), after Tramer & Boneh.

    WS-conv + GroupNorm + activation stages with 2x2 max-pooling between them, then the maps
    flattened: the classifier sees where each response is (a global average would discard the
    positions that the linear model on the same maps uses).
    """

    channels: tuple[int, ...] = (64, 64)
    num_groups: int = 16
    activation: str = "relu"

    @nn.compact
    def __call__(self, maps: Array) -> Array:
        return _flat_cnn_stages(maps, self.channels, self.num_groups, self.activation)


def _flat_cnn_stages(out: Array, channels: tuple[int, ...], num_groups: int, activation: str = "relu") -> Array:
    """WS-conv + GroupNorm + activation stages, 2x2 max-pooling between them, then flattened (in a compact module)."""
    act = activation_fn(activation)
    for index, features in enumerate(channels):
        if index > 0:
            out = nn.max_pool(out, (2, 2), strides=(2, 2), padding="SAME")
        out = WSConv(features, 3, name=f"conv_{index}")(out)
        out = act(GroupNorm(num_groups=num_groups, name=f"norm_{index}")(out))
    return out.reshape(out.shape[0], -1)


def _check_groups(channels_in: int, J: int, L: int, scatter_groups: int) -> None:
    total = channels_in * num_channels(J, L)
    if scatter_groups < 1 or total % scatter_groups:
        raise InvalidConfigError(f"scatter_groups={scatter_groups} must divide the {total} scattering maps")


def scatter_linear(
    *, num_classes: int = 10, J: int = 2, L: int = 8, num_groups: int = 27, input_channels: int = 1
) -> ImageClassifier:
    """Softmax regression on normalised scattering features (Tramer & Boneh's ScatterNet+linear)."""
    _check_groups(input_channels, J, L, num_groups)
    return ImageClassifier(
        backbone=ScatterLinearBackbone(J=J, L=L, num_groups=num_groups), head=Classifier(num_classes)
    )


def scatter_cnn(
    *,
    num_classes: int = 10,
    channels: tuple[int, ...] = (64, 64),
    J: int = 2,
    L: int = 8,
    scatter_groups: int = 27,
    num_groups: int = 16,
    input_channels: int = 1,
    activation: str = "relu",
) -> ImageClassifier:
    """A GroupNorm + WS CNN on normalised scattering maps (Tramer & Boneh's ScatterNet+CNN)."""
    _check_groups(input_channels, J, L, scatter_groups)
    channels = checked_channels(channels, num_groups)
    activation_fn(activation)
    return ImageClassifier(
        backbone=ScatterCNNBackbone(
            channels=channels,
            J=J,
            L=L,
            scatter_groups=scatter_groups,
            num_groups=num_groups,
            activation=activation,
        ),
        head=Classifier(num_classes),
    )


def scatter_top_cnn(**options: Any) -> ImageClassifier:
    """A CNN top of the ``scattering`` cut with the maps below it: one model from images.

    ``scatter_cnn``'s options and checks; only the stages differ (they flatten the maps, as the top does).
    """
    cnn = scatter_cnn(**options)
    return cnn.clone(backbone=cnn.backbone.clone(flatten=True))
