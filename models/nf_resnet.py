"""Normalizer-Free ResNets (Brock, De & Smith 2021, "Characterizing signal propagation ...").

A pre-activation bottleneck ResNet without any normalisation layer. Signal propagation is
controlled analytically instead: every residual branch sees its input divided by the
expected standard deviation ``beta_i`` of the skip path, its output is scaled by
``alpha = 0.2`` and a zero-initialised SkipInit gain, convolutions use Scaled WS, and the
ReLU is rescaled to be variance-preserving. The expected variance grows by ``alpha^2`` per
block and is reset after each transition block (whose shortcut is a projection).

Stochastic depth and dropout (regularisers for non-private ImageNet training) are left out:
they add no parameters and DP fine-tuning does not use them.

Stages (ResNet-50 layout, bottleneck ratio 0.25): widths 256, 512, 1024, 2048; stem
7x7/2 conv with 64 channels then 3x3/2 max-pool. Depths per stage are in ``NF_RESNET_DEPTHS``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from dpscale.errors import InvalidConfigError
from dpscale.models.classifier import Classifier, ImageClassifier
from dpscale.models.layers import ScaledWSConv, SkipInitGain, scaled_relu

Array = jax.Array

NF_RESNET_DEPTHS: dict[int, tuple[int, int, int, int]] = {
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
    200: (3, 24, 36, 3),
}
STAGE_WIDTHS = (256, 512, 1024, 2048)


def block_betas(depths: Sequence[int], alpha: float) -> list[float]:
    """``beta_i = 1 / E[std]`` of each block's input, in block order (shared with NFNet).

    The skip path's variance is 1 after the stem and after each transition block
    (projection shortcut); each plain block adds ``alpha^2``.
    """
    betas, expected_var = [], 1.0
    for depth in depths:
        for index in range(depth):
            betas.append(expected_var**-0.5)
            if index == 0:
                expected_var = 1.0
            expected_var += alpha**2
    return betas


class NFResBlock(nn.Module):
    """Bottleneck block: ``x + alpha * gain * f(act(x) * beta)``."""

    features: int
    strides: int = 1
    beta: float = 1.0
    alpha: float = 0.2
    bottleneck_ratio: float = 0.25
    activation: Callable[[Array], Array] = scaled_relu

    @nn.compact
    def __call__(self, x: Array) -> Array:
        width = int(self.features * self.bottleneck_ratio)
        out = self.activation(x) * self.beta
        if self.strides != 1 or x.shape[-1] != self.features:
            shortcut = ScaledWSConv(self.features, 1, strides=self.strides, name="shortcut")(out)
        else:
            shortcut = x
        out = ScaledWSConv(width, 1, name="conv_0")(out)
        out = ScaledWSConv(width, 3, strides=self.strides, name="conv_1")(self.activation(out))
        out = ScaledWSConv(self.features, 1, name="conv_2")(self.activation(out))
        out = SkipInitGain(name="skip")(out)
        return out * self.alpha + shortcut


class NFResNetBackbone(nn.Module):
    """Stem, four stages of NF bottleneck blocks, final activation and average pool."""

    depths: tuple[int, int, int, int] = NF_RESNET_DEPTHS[50]
    alpha: float = 0.2

    @nn.compact
    def __call__(self, x: Array) -> Array:
        out = ScaledWSConv(64, 7, strides=2, name="stem")(x)
        out = nn.max_pool(out, (3, 3), strides=(2, 2), padding="SAME")
        betas = iter(block_betas(self.depths, self.alpha))
        for stage, (width, depth) in enumerate(zip(STAGE_WIDTHS, self.depths)):
            for block in range(depth):
                strides = 2 if stage > 0 and block == 0 else 1
                out = NFResBlock(
                    width,
                    strides=strides,
                    beta=next(betas),
                    alpha=self.alpha,
                    name=f"stage{stage + 1}_block{block + 1}",
                )(out)
        return jnp.mean(scaled_relu(out), axis=(1, 2))


def nf_resnet(depth: int, *, num_classes: int = 1000, alpha: float = 0.2) -> ImageClassifier:
    """Build NF-ResNet-``depth`` (50, 101, 152 or 200)."""
    if depth not in NF_RESNET_DEPTHS:
        raise InvalidConfigError(f"NF-ResNet depth must be one of {sorted(NF_RESNET_DEPTHS)}, got {depth}")
    return ImageClassifier(
        backbone=NFResNetBackbone(depths=NF_RESNET_DEPTHS[depth], alpha=alpha),
        head=Classifier(num_classes, kernel_init=nn.initializers.zeros),
    )


NF_RESNET_FEATURE_DIM = STAGE_WIDTHS[-1]
