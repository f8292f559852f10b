"""The Opacus twins in benchmarks/peers_torch.py train the same architectures as dpscale."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root holds benchmarks/

from benchmarks.peers_torch import build, param_count  # noqa: E402
from dpscale.models.registry import param_count as flax_param_count  # noqa: E402


@pytest.mark.parametrize("name", ["cnn-small", "wrn-16-4"])
def test_twin_has_the_flax_parameter_count(name):
    model, _ = build(name)
    assert param_count(model) == flax_param_count(name)


@pytest.mark.parametrize("name, pixels", [("cnn-small", 28), ("wrn-16-4", 32)])
def test_twin_maps_images_to_ten_logits(name, pixels):
    model, shape = build(name)
    assert shape[1:] == (pixels, pixels)
    assert model(torch.zeros(2, *shape)).shape == (2, 10)
