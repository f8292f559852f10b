"""NFNet-F0..F3 (Brock, De, Smith & Simonyan 2021, "High-Performance Large-Scale Image
Recognition Without Normalization"), as in the paper's variant table and its JAX release.

Compared with NF-ResNet: a 4-conv 3x3 stem, GELU (rescaled), grouped 3x3 convs (group
width 128) with two of them per block, squeeze-excite on every block (ratio 0.5, output
doubled so the gate starts near 1), average-pool downsampling on transition shortcuts,
and a final 1x1 conv that doubles the channels before pooling. Width pattern
256-512-1536-1536, bottleneck ratio 0.5 of the block's output width.

Stochastic depth, dropout and adaptive gradient clipping are training-time choices of the
paper for non-private training; they add no parameters and are not part of the module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from dpscale.errors import InvalidConfigError
from dpscale.models.classifier import Classifier, ImageClassifier
from dpscale.models.layers import ScaledWSConv, SkipInitGain, SqueezeExcite, scaled_gelu
from dpscale.models.nf_resnet import block_betas

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class NFNetVariant:
    """One row of the paper's variant table."""

    depths: tuple[int, int, int, int]
    train_size: int
    test_size: int


NFNET_VARIANTS: dict[str, NFNetVariant] = {
    "F0": NFNetVariant((1, 2, 6, 3), 192, 256),
    "F1": NFNetVariant((2, 4, 12, 6), 224, 320),
    "F2": NFNetVariant((3, 6, 18, 9), 256, 352),
    "F3": NFNetVariant((4, 8, 24, 12), 320, 416),
}
STAGE_WIDTHS = (256, 512, 1536, 1536)
GROUP_WIDTH = 128
BOTTLENECK_RATIO = 0.5
SE_RATIO = 0.5
FINAL_CONV_MULTIPLIER = 2
NFNET_FEATURE_DIM = FINAL_CONV_MULTIPLIER * STAGE_WIDTHS[-1]


class NFBlock(nn.Module):
    """NFNet block: 1x1 -> grouped 3x3 -> grouped 3x3 -> 1x1, SE, SkipInit, ``alpha``."""

    features: int
    strides: int = 1
    beta: float = 1.0
    alpha: float = 0.2
    activation: Callable[[Array], Array] = scaled_gelu

    @nn.compact
    def __call__(self, x: Array) -> Array:
        groups = int(self.features * BOTTLENECK_RATIO) // GROUP_WIDTH
        width = groups * GROUP_WIDTH
        out = self.activation(x) * self.beta
        projection = self.strides != 1 or x.shape[-1] != self.features
        if self.strides != 1:
            pooled = nn.avg_pool(out, (self.strides, self.strides), strides=(self.strides,) * 2, padding="SAME")
            shortcut = ScaledWSConv(self.features, 1, name="shortcut")(pooled)
        elif projection:
            shortcut = ScaledWSConv(self.features, 1, name="shortcut")(out)
        else:
            shortcut = x
        out = ScaledWSConv(width, 1, name="conv_0")(out)
        out = ScaledWSConv(width, 3, strides=self.strides, feature_group_count=groups, name="conv_1")(
            self.activation(out)
        )
        out = ScaledWSConv(width, 3, feature_group_count=groups, name="conv_1b")(self.activation(out))
        out = ScaledWSConv(self.features, 1, name="conv_2")(self.activation(out))
        hidden = max(1, int(self.features * SE_RATIO))
        out = 2.0 * SqueezeExcite(self.features, hidden, name="se")(out) * out
        out = SkipInitGain(name="skip")(out)
        return out * self.alpha + shortcut


class NFNetBackbone(nn.Module):
    """Stem, NF blocks, final 1x1 conv + activation, global average pool."""

    depths: tuple[int, int, int, int] = NFNET_VARIANTS["F0"].depths
    alpha: float = 0.2

    @nn.compact
    def __call__(self, x: Array) -> Array:
        act = scaled_gelu
        out = ScaledWSConv(16, 3, strides=2, name="stem_0")(x)
        out = ScaledWSConv(32, 3, name="stem_1")(act(out))
        out = ScaledWSConv(64, 3, name="stem_2")(act(out))
        out = ScaledWSConv(STAGE_WIDTHS[0] // 2, 3, strides=2, name="stem_3")(act(out))
        betas = iter(block_betas(self.depths, self.alpha))
        for stage, (width, depth) in enumerate(zip(STAGE_WIDTHS, self.depths)):
            for block in range(depth):
                strides = 2 if stage > 0 and block == 0 else 1
                out = NFBlock(
                    width,
                    strides=strides,
                    beta=next(betas),
                    alpha=self.alpha,
                    name=f"stage{stage + 1}_block{block + 1}",
                )(out)
        out = ScaledWSConv(NFNET_FEATURE_DIM, 1, name="final_conv")(out)
        return jnp.mean(act(out), axis=(1, 2))


def nfnet(variant: str, *, num_classes: int = 1000, alpha: float = 0.2) -> ImageClassifier:
    """Build NFNet-``variant`` (``"F0"`` .. ``"F3"``)."""
    key = variant.upper()
    if key not in NFNET_VARIANTS:
        raise InvalidConfigError(f"NFNet variant must be one of {sorted(NFNET_VARIANTS)}, got {variant!r}")
    return ImageClassifier(
        backbone=NFNetBackbone(depths=NFNET_VARIANTS[key].depths, alpha=alpha),
        head=Classifier(num_classes, kernel_init=nn.initializers.normal(0.01)),
    )
