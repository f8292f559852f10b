"""PyTorch twins of dpscale's benchmark models, and the Opacus / plain-PyTorch steps on them.

Written from the Flax definitions in ``models/cnn.py``, ``models/wrn.py`` and
``models/layers.py`` so that Opacus trains the same architecture: weight-standardised
convolutions without bias, GroupNorm(16) with affine scale and shift, a dense head.
Parameter counts equal the Flax ones (``tests/benchmarks/test_peers_torch.py``).
Padding differs in one place: Flax "SAME" on a stride-2 conv pads (0, 1), PyTorch pads
(1, 1); shapes, parameter counts and work per example are the same.

Imported only by the peers benchmark (in its own virtualenv); never by dpscale itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GROUPS = 16


class WSConv2d(nn.Module):
    """Conv whose kernel is standardised over its fan-in in the forward pass (no bias).

    A leaf module with its own ``weight``: Opacus has no hook-based per-sample gradient for
    it, so it falls back to ``torch.func`` (vmap of grad) for this layer, which is what an
    Opacus user training De et al.'s WS models gets.
    """

    def __init__(self, in_ch: int, out_ch: int, kernel: int, *, stride: int = 1, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_ch, in_ch, kernel, kernel) / (in_ch * kernel * kernel) ** 0.5)
        self.stride, self.padding, self.eps = stride, kernel // 2, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        var = w.var(dim=(1, 2, 3), keepdim=True, unbiased=False)
        return F.conv2d(x, (w - mean) * torch.rsqrt(var + self.eps), stride=self.stride, padding=self.padding)


class SmallCNN(nn.Module):
    """Twin of ``cnn-small``: WS-conv(16, 32, 64, 128) + GN + ReLU, 2x2 avg-pool between."""

    def __init__(self, channels=(16, 32, 64, 128), num_classes: int = 10, in_ch: int = 1):
        super().__init__()
        layers: list[nn.Module] = []
        for index, ch in enumerate(channels):
            if index:
                layers.append(nn.AvgPool2d(2, ceil_mode=True))
            layers += [WSConv2d(in_ch, ch, 3), nn.GroupNorm(GROUPS, ch, eps=1e-6), nn.ReLU()]
            in_ch = ch
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x).mean(dim=(2, 3)))


class WRNBlock(nn.Module):
    """Pre-activation block; 1x1 WS projection on the normalised input when shapes change."""

    def __init__(self, in_ch: int, out_ch: int, stride: int):
        super().__init__()
        self.norm_0 = nn.GroupNorm(GROUPS, in_ch, eps=1e-6)
        self.shortcut = WSConv2d(in_ch, out_ch, 1, stride=stride) if stride != 1 or in_ch != out_ch else None
        self.conv_0 = WSConv2d(in_ch, out_ch, 3, stride=stride)
        self.norm_1 = nn.GroupNorm(GROUPS, out_ch, eps=1e-6)
        self.conv_1 = WSConv2d(out_ch, out_ch, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm_0(x))
        shortcut = x if self.shortcut is None else self.shortcut(out)
        out = self.conv_0(out)
        out = self.conv_1(F.relu(self.norm_1(out)))
        return out + shortcut


class WideResNet(nn.Module):
    """Twin of ``wrn-d-k`` (GroupNorm + WS, no dropout)."""

    def __init__(self, depth: int = 16, width: int = 4, num_classes: int = 10):
        super().__init__()
        per_stage = (depth - 4) // 6
        blocks: list[nn.Module] = [WSConv2d(3, 16, 3)]
        in_ch = 16
        for stage, base in enumerate((16, 32, 64)):
            for block in range(per_stage):
                blocks.append(WRNBlock(in_ch, base * width, 2 if stage and not block else 1))
                in_ch = base * width
        self.body = nn.Sequential(*blocks)
        self.final_norm = nn.GroupNorm(GROUPS, in_ch, eps=1e-6)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.final_norm(self.body(x)))
        return self.fc(out.mean(dim=(2, 3)))


def build(workload: str, *, num_classes: int = 10, feature_dim: int = 1280) -> tuple[nn.Module, tuple[int, ...]]:
    """The twin of ``workload`` and its NCHW (or feature) input shape per example."""
    if workload == "cnn-small":
        return SmallCNN(num_classes=num_classes), (1, 28, 28)
    if workload == "wrn-16-4":
        return WideResNet(16, 4, num_classes=num_classes), (3, 32, 32)
    if workload.startswith("linear"):
        return nn.Linear(feature_dim, num_classes), (feature_dim,)
    raise ValueError(f"unknown workload {workload!r}")


def without_weight_standardisation(module: nn.Module) -> nn.Module:
    """Swap every ``WSConv2d`` for a plain bias-free ``nn.Conv2d`` of the same shape, in place.

    Not the dpscale architecture: it shows what Opacus costs when every layer has a
    hook-based per-sample gradient (no functorch fallback).
    """
    for name, child in module.named_children():
        if isinstance(child, WSConv2d):
            out_ch, in_ch, k, _ = child.weight.shape
            setattr(module, name, nn.Conv2d(in_ch, out_ch, k, stride=child.stride, padding=child.padding, bias=False))
        else:
            without_weight_standardisation(child)
    return module


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
