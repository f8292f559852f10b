"""The model zoo as ``dpscale models`` lists it, as plain data: listing it needs no JAX or Flax.

Building the registry (``models.registry``) imports every model family, Flax and JAX, which made a
table slow to print (benchmarks/results/first_hour.md). Each row here is exactly what ``registry.describe`` says of
a listed model (its parameter count at the default classes and input: ``registry`` reads it from
here rather than tracing every model). ``tests/models/test_cli_models.py`` checks every row against
``registry.describe`` and ``tests/models/test_registry.py`` every count against the traced model, so a
change to a model that is not made here too fails.
"""

from __future__ import annotations

from typing import Any


def _row(
    name: str,
    params: int,
    input_shape: tuple[int, int, int],
    *,
    classes: int,
    features: int,
    description: str,
    pretrained: bool = False,
    cuts: tuple[str, ...] = (),
    tops: tuple[str, ...] = (),
) -> dict[str, Any]:
    return {
        "name": name,
        "params": params,
        "input_shape": list(input_shape),
        "num_classes": classes,
        "feature_dim": features,
        "pretrained": pretrained,
        "description": description,
        "cuts": list(cuts),  # where `featurize --cut` may cut it (models.cuts)
        "tops": list(tops),  # what `train --model` may train above a cut, the default first
    }


def _blocks(count: int) -> tuple[str, ...]:
    return tuple(f"blocks_{i}" for i in range(count))


_SCATTER = {"cuts": ("scattering",), "tops": ("cnn", "cnn-wide", "cnn-tanh")}


#: ``registry.describe(name)`` of every listed model, in the registry's order.
MODELS: tuple[dict[str, Any], ...] = (
    _row(
        "wrn-16-4",
        2_748_890,
        (32, 32, 3),
        classes=10,
        features=256,
        description="Wide-ResNet-16-4, GroupNorm(16) + WS conv, 32x32 (De et al. 2022)",
    ),
    _row(
        "wrn-40-4",
        8_949_210,
        (32, 32, 3),
        classes=10,
        features=256,
        description="Wide-ResNet-40-4, GroupNorm(16) + WS conv, 32x32 (De et al. 2022)",
    ),
    _row(
        "wrn-28-10",
        36_479_194,
        (32, 32, 3),
        classes=10,
        features=640,
        description="Wide-ResNet-28-10, GroupNorm(16) + WS conv, 32x32 (De et al. 2022)",
    ),
    _row(
        "nf-resnet-50",
        25_557_048,
        (224, 224, 3),
        classes=1000,
        features=2048,
        description="Normalizer-Free ResNet-50 (Brock et al. 2021a)",
    ),
    _row(
        "nf-resnet-101",
        44_549_193,
        (224, 224, 3),
        classes=1000,
        features=2048,
        description="Normalizer-Free ResNet-101 (Brock et al. 2021a)",
    ),
    _row(
        "nf-resnet-152",
        60_192_858,
        (224, 224, 3),
        classes=1000,
        features=2048,
        description="Normalizer-Free ResNet-152 (Brock et al. 2021a)",
    ),
    _row(
        "nf-resnet-200",
        64_673_898,
        (224, 224, 3),
        classes=1000,
        features=2048,
        description="Normalizer-Free ResNet-200 (Brock et al. 2021a)",
    ),
    _row(
        "nfnet-f0",
        71_489_284,
        (192, 192, 3),
        classes=1000,
        features=3072,
        description="NFNet-F0 (Brock et al. 2021b), train resolution 192",
    ),
    _row(
        "nfnet-f1",
        132_634_256,
        (224, 224, 3),
        classes=1000,
        features=3072,
        description="NFNet-F1 (Brock et al. 2021b), train resolution 224",
    ),
    _row(
        "nfnet-f2",
        193_779_228,
        (256, 256, 3),
        classes=1000,
        features=3072,
        description="NFNet-F2 (Brock et al. 2021b), train resolution 256",
    ),
    _row(
        "nfnet-f3",
        254_924_200,
        (320, 320, 3),
        classes=1000,
        features=3072,
        description="NFNet-F3 (Brock et al. 2021b), train resolution 320",
    ),
    _row(
        "cnn-small",
        98_682,
        (28, 28, 1),
        classes=10,
        features=128,
        description="Small GroupNorm + WS CNN for 28x28 grayscale (Fashion-MNIST)",
    ),
    _row(
        "cnn-tanh",
        26_010,
        (28, 28, 1),
        classes=10,
        features=32,
        description="Tramer & Boneh (2021)'s end-to-end DP CNN (tanh, no normalisation), 28x28 grayscale",
    ),
    _row(
        "scatternet-linear",
        39_700,
        (28, 28, 1),
        classes=10,
        features=3969,
        description="Softmax regression on a fixed scattering transform, 28x28 grayscale (Tramer & Boneh 2021)",
        **_SCATTER,
    ),
    _row(
        "scatternet-linear-rgb",
        155_530,
        (32, 32, 3),
        classes=10,
        features=15552,
        description="Softmax regression on a fixed scattering transform, 32x32 RGB (Tramer & Boneh 2021)",
        **_SCATTER,
    ),
    _row(
        "scatternet-cnn",
        84_426,
        (28, 28, 1),
        classes=10,
        features=64,
        description="GroupNorm + WS CNN on a fixed scattering transform, 28x28 grayscale (Tramer & Boneh 2021)",
        **_SCATTER,
    ),
    _row(
        "scatternet-top-cnn",
        94_026,
        (28, 28, 1),
        classes=10,
        features=1024,
        description="The 'cnn' top above the scattering cut with the maps below it, 28x28 grayscale",
        **_SCATTER,
    ),
    _row(
        "scatternet-top-cnn-wide",
        261_770,
        (28, 28, 1),
        classes=10,
        features=2048,
        description="The 'cnn-wide' top above the scattering cut with the maps below it, 28x28 grayscale",
        **_SCATTER,
    ),
    _row(
        "scatternet-top-cnn-tanh",
        94_026,
        (28, 28, 1),
        classes=10,
        features=1024,
        description="The 'cnn-tanh' top above the scattering cut with the maps below it, 28x28 grayscale",
        **_SCATTER,
    ),
    _row(
        "efficientnet-lite0",
        4_652_008,
        (224, 224, 3),
        classes=1000,
        features=1280,
        pretrained=True,
        description="EfficientNet-Lite (no SE, ReLU6, frozen-statistics BatchNorm), 224px",
        cuts=_blocks(16),
        tops=("pretrained",),
    ),
    _row(
        "efficientnet-lite1",
        5_416_680,
        (240, 240, 3),
        classes=1000,
        features=1280,
        pretrained=True,
        description="EfficientNet-Lite (no SE, ReLU6, frozen-statistics BatchNorm), 240px",
        cuts=_blocks(21),
        tops=("pretrained",),
    ),
    _row(
        "efficientnet-lite2",
        6_092_072,
        (260, 260, 3),
        classes=1000,
        features=1280,
        pretrained=True,
        description="EfficientNet-Lite (no SE, ReLU6, frozen-statistics BatchNorm), 260px",
        cuts=_blocks(21),
        tops=("pretrained",),
    ),
)
