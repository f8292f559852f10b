"""EfficientNet-Lite0/1/2 (Tan & Le 2019, "Lite" edge variants) in Flax linen.

Lite differs from EfficientNet-B*: no squeeze-excite, ReLU6 instead of swish, and
the stem (32 channels), the head (1280 channels) and the repeats of the first and
last stage are not scaled. Convolutions use TensorFlow "SAME" padding (the ImageNet
weights were trained in TF and the PyTorch port pads the same way), and have no
biases; every convolution is followed by BatchNorm (epsilon 1e-3).

BatchNorm here always runs with its *frozen* running statistics
(``use_running_average=True``): batch statistics would mix examples and break the
per-example sensitivity DP-SGD relies on. Its scale/bias stay trainable, so
fine-tuning under DP is sound. There is no dropout / drop-connect: only inference
equivalence with the published models matters, and DP noise already regularises.

Stage table (EfficientNet-B0 / Lite0 baseline, before width/depth scaling)::

    stage  repeats  kernel  stride  expand  out
      0       1       3       1       1     16
      1       2       3       2       6     24
      2       2       5       2       6     40
      3       3       3       2       6     80
      4       3       5       1       6    112
      5       4       5       2       6    192
      6       1       3       1       6    320
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dpscale.errors import InvalidConfigError
from dpscale.models.classifier import Classifier, ImageClassifier

STEM_CHANNELS = 32
HEAD_CHANNELS = 1280
BN_EPSILON = 1e-3
BN_MOMENTUM = 0.99
_DIVISOR = 8

# (repeats, kernel, stride, expand_ratio, out_channels) for the Lite0 baseline.
_STAGES: tuple[tuple[int, int, int, int, int], ...] = (
    (1, 3, 1, 1, 16),
    (2, 3, 2, 6, 24),
    (2, 5, 2, 6, 40),
    (3, 3, 2, 6, 80),
    (3, 5, 1, 6, 112),
    (4, 5, 2, 6, 192),
    (1, 3, 1, 6, 320),
)


@dataclasses.dataclass(frozen=True)
class LiteVariant:
    """Compound-scaling coefficients of one published Lite model."""

    width: float
    depth: float
    resolution: int


VARIANTS: dict[str, LiteVariant] = {
    "efficientnet-lite0": LiteVariant(width=1.0, depth=1.0, resolution=224),
    "efficientnet-lite1": LiteVariant(width=1.0, depth=1.1, resolution=240),
    "efficientnet-lite2": LiteVariant(width=1.1, depth=1.2, resolution=260),
}


def round_filters(channels: int, width: float) -> int:
    """Scale a channel count by ``width``, rounded to a multiple of 8 (never down by >10%)."""
    scaled = channels * width
    rounded = max(_DIVISOR, int(scaled + _DIVISOR / 2) // _DIVISOR * _DIVISOR)
    if rounded < 0.9 * scaled:
        rounded += _DIVISOR
    return int(rounded)


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """One MBConv block after scaling."""

    in_channels: int
    out_channels: int
    kernel: int
    stride: int
    expand_ratio: int


def block_specs(width: float, depth: float) -> tuple[BlockSpec, ...]:
    """The scaled block sequence; Lite keeps the first and last stage's repeats fixed."""
    specs: list[BlockSpec] = []
    in_ch = STEM_CHANNELS
    last = len(_STAGES) - 1
    for index, (repeats, kernel, stride, expand, out) in enumerate(_STAGES):
        out_ch = round_filters(out, width)
        if 0 < index < last:
            repeats = int(math.ceil(depth * repeats))
        for r in range(repeats):
            specs.append(
                BlockSpec(
                    in_channels=in_ch,
                    out_channels=out_ch,
                    kernel=kernel,
                    stride=stride if r == 0 else 1,
                    expand_ratio=expand,
                )
            )
            in_ch = out_ch
    return tuple(specs)


def _frozen_bn(name: str, dtype: Any) -> nn.BatchNorm:
    return nn.BatchNorm(
        use_running_average=True,
        momentum=BN_MOMENTUM,
        epsilon=BN_EPSILON,
        dtype=dtype,
        name=name,
    )


class DepthwiseConv(nn.Module):
    """k x k depthwise convolution, TF SAME padding, computed as k*k shifted multiply-adds.

    Same parameter as ``nn.Conv(feature_group_count=C)`` (``kernel`` of shape (k, k, 1, C)),
    but XLA's CPU grouped convolution ran several times slower than this on Lite's shapes
    (benchmarks/results/efficientnet_forward.md); elementwise ops also vmap cheaply
    for per-example gradients.
    """

    kernel_size: int
    stride: int = 1
    dtype: Any = jnp.float32
    kernel_init: Any = nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        k, s = self.kernel_size, self.stride
        kernel = self.param("kernel", self.kernel_init, (k, k, 1, x.shape[-1]), jnp.float32)
        x, kernel = jnp.asarray(x, self.dtype), jnp.asarray(kernel, self.dtype)
        n, h, w, c = x.shape
        out_h, out_w = -(-h // s), -(-w // s)
        pad_h, pad_w = max((out_h - 1) * s + k - h, 0), max((out_w - 1) * s + k - w, 0)
        x = jnp.pad(x, ((0, 0), (pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0)))
        out = None
        for i in range(k):
            for j in range(k):
                window = jax.lax.slice(
                    x, (0, i, j, 0), (n, i + (out_h - 1) * s + 1, j + (out_w - 1) * s + 1, c), (1, s, s, 1)
                )
                term = window * kernel[i, j, 0]
                out = term if out is None else out + term
        return out


class MBConv(nn.Module):
    """Inverted bottleneck: 1x1 expand -> kxk depthwise -> 1x1 linear project (+ identity)."""

    spec: BlockSpec
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        s = self.spec
        mid = s.in_channels * s.expand_ratio
        h = x
        if s.expand_ratio != 1:
            h = nn.Conv(mid, (1, 1), use_bias=False, dtype=self.dtype, name="expand_conv")(h)
            h = jax.nn.relu6(_frozen_bn("expand_bn", self.dtype)(h))
        h = DepthwiseConv(s.kernel, s.stride, dtype=self.dtype, name="depthwise_conv")(h)
        h = jax.nn.relu6(_frozen_bn("depthwise_bn", self.dtype)(h))
        h = nn.Conv(s.out_channels, (1, 1), use_bias=False, dtype=self.dtype, name="project_conv")(h)
        h = _frozen_bn("project_bn", self.dtype)(h)
        if s.stride == 1 and s.in_channels == s.out_channels:
            h = h + x
        return h


class EfficientNetLiteBackbone(nn.Module):
    """NHWC images, already normalised (see ``models.pretrained``) -> (N, 1280) features.

    The features are the head convolution's ReLU6 output, globally average-pooled:
    the penultimate representation the ImageNet classifier reads.
    """

    width: float = 1.0
    depth: float = 1.0
    dtype: Any = jnp.float32
    stop_after: int | None = None  # return the activations after ``blocks_<stop_after>`` (a cut)

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        h = nn.Conv(
            STEM_CHANNELS,
            (3, 3),
            strides=(2, 2),
            padding="SAME",
            use_bias=False,
            dtype=self.dtype,
            name="stem_conv",
        )(images)
        h = jax.nn.relu6(_frozen_bn("stem_bn", self.dtype)(h))
        for index, spec in enumerate(block_specs(self.width, self.depth)):
            h = MBConv(spec, dtype=self.dtype, name=f"blocks_{index}")(h)
            if index == self.stop_after:
                return h
        return _head(h, self.dtype)


def _head(h: jax.Array, dtype: Any) -> jax.Array:
    """The 1x1 head convolution, its BatchNorm and ReLU6, then global average pooling."""
    h = nn.Conv(HEAD_CHANNELS, (1, 1), use_bias=False, dtype=dtype, name="head_conv")(h)
    h = jax.nn.relu6(_frozen_bn("head_bn", dtype)(h))
    return jnp.mean(h, axis=(1, 2))


class EfficientNetLiteTop(nn.Module):
    """The blocks after ``blocks_<cut>`` and the head: what is trained above a cut.

    Its layers carry the backbone's names, so the backbone's parameters and BatchNorm
    statistics initialise it by name (``models.cuts``).
    """

    width: float = 1.0
    depth: float = 1.0
    cut: int = 0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, activations: jax.Array) -> jax.Array:
        h = activations
        for index, spec in enumerate(block_specs(self.width, self.depth)):
            if index > self.cut:
                h = MBConv(spec, dtype=self.dtype, name=f"blocks_{index}")(h)
        return _head(h, self.dtype)


def efficientnet_lite(name: str, *, num_classes: int = 1000, dtype: Any = jnp.float32) -> ImageClassifier:
    """A published Lite variant by name (``efficientnet-lite0``/``1``/``2``).

    Parameters live under ``params["backbone"]`` and ``params["head"]["fc"]``,
    BatchNorm statistics under ``batch_stats["backbone"]`` (see ``models.classifier``).
    """
    try:
        variant = VARIANTS[name]
    except KeyError:
        raise InvalidConfigError(f"unknown EfficientNet-Lite variant {name!r}; known: {sorted(VARIANTS)}") from None
    backbone = EfficientNetLiteBackbone(width=variant.width, depth=variant.depth, dtype=dtype)
    return ImageClassifier(backbone=backbone, head=Classifier(num_classes))
