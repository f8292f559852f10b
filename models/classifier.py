"""One shape for every model: a backbone that ends in pooled features, then a classifier.

Keeping the two as separate submodules (parameters under ``params["backbone"]`` and
``params["head"]``) is what lets the training stage either fit the last layer alone on
cached features or fine-tune everything with one and the same model object.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import linen as nn

from dpscale.models.layers import fan_in_normal

Array = jax.Array


class Classifier(nn.Module):
    """The last layer: a dense map from pooled features to logits."""

    num_classes: int
    kernel_init: Any = fan_in_normal

    @nn.compact
    def __call__(self, feats: Array) -> Array:
        return nn.Dense(self.num_classes, kernel_init=self.kernel_init, name="fc")(feats)


class ImageClassifier(nn.Module):
    """``head(backbone(x))``, with both halves callable on their own.

    ``backbone`` maps NHWC images ``(B, H, W, C)`` to features ``(B, D)``; ``head`` maps
    ``(B, D)`` to logits ``(B, num_classes)``. Use ``method="features"`` or
    ``method="classify"`` with ``apply`` to run one half; ``classify`` needs only
    ``{"params": {"head": ...}}``. ``return_features=True`` gives ``(logits, features)``
    from one forward pass.
    """

    backbone: nn.Module
    head: nn.Module

    def features(self, x: Array) -> Array:
        """Penultimate (pooled) features, the input of the classifier."""
        return self.backbone(x)

    def classify(self, feats: Array) -> Array:
        """Logits from penultimate features."""
        return self.head(feats)

    def __call__(self, x: Array, *, return_features: bool = False) -> Array | tuple[Array, Array]:
        feats = self.backbone(x)
        logits = self.head(feats)
        return (logits, feats) if return_features else logits
