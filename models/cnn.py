"""A small GroupNorm + WS convnet for 28x28 grayscale images (Fashion-MNIST), fast on CPU.

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
