"""Wide-ResNet WRN-d-k for 32x32 images, as used for DP training by De et al. 2022.

Pre-activation blocks (Zagoruyko & Komodakis 2016) with two changes that make them
DP-compatible: GroupNorm (16 groups) instead of BatchNorm, and Weight-Standardised convs.
No dropout. ``(d - 4) / 6`` blocks per stage, stage widths ``16k, 32k, 64k``:

=========  ===========  ==================  =======
stage      output size  block               blocks
=========  ===========  ==================  =======
stem       32 x 32      conv3x3, 16         1
group 1    32 x 32      [3x3, 16k] x 2      n
group 2    16 x 16      [3x3, 32k] x 2      n
group 3    8 x 8        [3x3, 64k] x 2      n
head       1 x 1        GN, ReLU, avg-pool  --
=========  ===========  ==================  =======
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from dpscale.errors import InvalidConfigError
from dpscale.models.classifier import Classifier, ImageClassifier
from dpscale.models.layers import GroupNorm, WSConv

Array = jax.Array


class WRNBlock(nn.Module):
    """Pre-activation residual block; a 1x1 WS projection when shape changes."""

    features: int
    strides: int = 1
    num_groups: int = 16

    @nn.compact
    def __call__(self, x: Array) -> Array:
        out = nn.relu(GroupNorm(num_groups=self.num_groups, name="norm_0")(x))
        if self.strides != 1 or x.shape[-1] != self.features:
            shortcut = WSConv(self.features, 1, strides=self.strides, name="shortcut")(out)
        else:
            shortcut = x
        out = WSConv(self.features, 3, strides=self.strides, name="conv_0")(out)
        out = nn.relu(GroupNorm(num_groups=self.num_groups, name="norm_1")(out))
        out = WSConv(self.features, 3, name="conv_1")(out)
        return out + shortcut


class WRNBackbone(nn.Module):
    """Everything up to the pooled ``64k``-dimensional features."""

    depth: int = 16
    width: int = 4
    num_groups: int = 16

    @nn.compact
    def __call__(self, x: Array) -> Array:
        blocks_per_stage = (self.depth - 4) // 6
        out = WSConv(16, 3, name="stem")(x)
        for stage, base in enumerate((16, 32, 64)):
            for block in range(blocks_per_stage):
                strides = 2 if stage > 0 and block == 0 else 1
                out = WRNBlock(
                    base * self.width,
                    strides=strides,
                    num_groups=self.num_groups,
                    name=f"stage{stage + 1}_block{block + 1}",
                )(out)
        out = nn.relu(GroupNorm(num_groups=self.num_groups, name="final_norm")(out))
        return jnp.mean(out, axis=(1, 2))


def wide_resnet(depth: int, width: int, *, num_classes: int = 10, num_groups: int = 16) -> ImageClassifier:
    """Build WRN-``depth``-``width``; ``depth`` must be ``6n + 4``."""
    if depth < 10 or (depth - 4) % 6 != 0:
        raise InvalidConfigError(f"WRN depth must be 6n+4 with n >= 1, got {depth}")
    if width < 1:
        raise InvalidConfigError(f"WRN width must be >= 1, got {width}")
    if (16 * width) % num_groups != 0 or 16 % num_groups != 0:
        raise InvalidConfigError(f"GroupNorm groups ({num_groups}) must divide the channel counts 16 and {16 * width}")
    return ImageClassifier(
        backbone=WRNBackbone(depth=depth, width=width, num_groups=num_groups),
        head=Classifier(num_classes),
    )


def wrn_feature_dim(width: int) -> int:
    """Size of the pooled features of WRN-d-``width``."""
    return 64 * width
