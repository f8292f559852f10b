"""Small convnets for 28x28 grayscale images (Fashion-MNIST), fast on CPU.

``cnn-small`` is dpscale's own; ``cnn-tanh`` is Tramer & Boneh (2021)'s end-to-end DP CNN, the
published from-scratch reference on Fashion-MNIST (86.0% at epsilon 3), for comparisons at equal model.

Four 3x3 WS-conv stages (16, 32, 64, 128 channels at 28, 14, 7 and 4 pixels), each followed
by GroupNorm(16) and ReLU, with 2x2 average pooling between them and a global average pool at
the end: about 98k parameters for 10 classes. Channels double as resolution halves, so the
parameters sit in the cheap low-resolution layers (~3M multiply-adds per image). It exists
so the full DP path (per-example gradients through every layer) runs on a CPU in minutes.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from dpscale.errors import InvalidConfigError
from dpscale.models.classifier import Classifier, ImageClassifier
from dpscale.models.layers import GroupNorm, WSConv

Array = jax.Array

DEFAULT_CHANNELS = (16, 32, 64, 128)


class CNNBackbone(nn.Module):
    """Conv stages with per-example normalisation only; returns pooled features."""

    channels: tuple[int, ...] = DEFAULT_CHANNELS
    num_groups: int = 16

    @nn.compact
    def __call__(self, x: Array) -> Array:
        out = x
        for index, features in enumerate(self.channels):
            if index > 0:
                out = nn.avg_pool(out, (2, 2), strides=(2, 2), padding="SAME")
            out = WSConv(features, 3, name=f"conv_{index}")(out)
            out = nn.relu(GroupNorm(num_groups=self.num_groups, name=f"norm_{index}")(out))
        return jnp.mean(out, axis=(1, 2))


def checked_channels(channels: Sequence[int], num_groups: int) -> tuple[int, ...]:
    """``channels`` as ints; each stage's GroupNorm needs its channel count divisible by ``num_groups``."""
    channels = tuple(int(c) for c in channels)
    if not channels or any(c < 1 or c % num_groups for c in channels):
        raise InvalidConfigError(f"CNN channels {channels} must be non-empty and divisible by num_groups={num_groups}")
    return channels


def small_cnn(
    *, num_classes: int = 10, channels: Sequence[int] = DEFAULT_CHANNELS, num_groups: int = 16
) -> ImageClassifier:
    """Build the small CNN; every channel count must be divisible by ``num_groups``."""
    channels = checked_channels(channels, num_groups)
    return ImageClassifier(
        backbone=CNNBackbone(channels=channels, num_groups=num_groups),
        head=Classifier(num_classes),
    )


#: The smallest side cnn-tanh's strided convolutions and poolings leave a pixel of.
TANH_CNN_MIN_SIDE = 16


class TanhCNNBackbone(nn.Module):
    """Tramer & Boneh (2021)'s CNN for 28x28 images: tanh activations, no normalisation.

    conv 16 8x8 stride 2 (pad 2) -> tanh -> max-pool 2 stride 1 -> conv 32 4x4 stride 2 -> tanh
    -> max-pool 2 stride 1 -> flatten -> dense 32 -> tanh: 26,010 parameters with the 10-class head.
    Every operation reads one example, so it trains under DP as it is (bounded tanh activations are
    what that paper found to suit clipped gradients).
    """

    @nn.compact
    def __call__(self, x: Array) -> Array:
        height, width = x.shape[1:3]
        if min(height, width) < TANH_CNN_MIN_SIDE:
            # Smaller images leave no pixel after the second convolution and pooling: say so here
            # rather than let the dense layer's initialiser divide by its zero inputs.
            raise InvalidConfigError(
                f"cnn-tanh needs images of at least {TANH_CNN_MIN_SIDE}x{TANH_CNN_MIN_SIDE} pixels "
                f"(it was built for 28x28), got {height}x{width}; cnn-small and the wrn models take smaller images"
            )
        out = jnp.tanh(nn.Conv(16, (8, 8), strides=(2, 2), padding=((2, 2), (2, 2)), name="conv_0")(x))
        out = nn.max_pool(out, (2, 2), strides=(1, 1))
        out = jnp.tanh(nn.Conv(32, (4, 4), strides=(2, 2), padding="VALID", name="conv_1")(out))
        out = nn.max_pool(out, (2, 2), strides=(1, 1))
        return jnp.tanh(nn.Dense(32, name="fc_0")(out.reshape(out.shape[0], -1)))


def tanh_cnn(*, num_classes: int = 10) -> ImageClassifier:
    """Tramer & Boneh (2021)'s end-to-end DP CNN for 28x28 grayscale images."""
    return ImageClassifier(backbone=TanhCNNBackbone(), head=Classifier(num_classes))
