"""The scattering front end: shapes, the filter bank's defining properties, and the models on it."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpscale.errors import InvalidConfigError
from dpscale.models import pretrained, registry, scattering


@pytest.fixture(scope="module")
def scatter():
    return jax.jit(lambda x: scattering.Scattering2D(J=2, L=8).apply({}, x))


def test_shape_and_channel_count(scatter):
    x = jax.random.normal(jax.random.key(0), (3, 28, 28, 2))
    assert scatter(x).shape == (3, 7, 7, 2 * 81)
    assert [scattering.num_channels(J, 8) for J in (1, 2, 3)] == [9, 81, 217]
    with pytest.raises(InvalidConfigError, match="divisible by 4"):
        scattering.Scattering2D(J=2).apply({}, jnp.zeros((1, 30, 30, 1)))


def test_wavelets_have_zero_mean_and_the_low_pass_keeps_the_mean(scatter):
    """A constant image: the low-pass returns the constant, every wavelet coefficient is 0."""
    psi, phi = scattering.filter_bank(44, 2, 8)
    np.testing.assert_allclose(psi[:, 0, 0], 0.0, atol=1e-6)  # zero-frequency response
    assert phi[0, 0] == pytest.approx(1.0, abs=1e-6)
    out = np.asarray(scatter(jnp.full((1, 28, 28, 1), 0.7)))
    np.testing.assert_allclose(out[..., 0], 0.7, rtol=1e-5)
    np.testing.assert_allclose(out[..., 1:], 0.0, atol=1e-5)


@pytest.mark.parametrize("angle, expected_index", [(0.0, 7), (math.pi / 2, 3)])
def test_first_order_responds_most_to_its_own_orientation(scatter, angle, expected_index):
    """Stripes whose wave runs at ``angle`` light up the scale-0 wavelet of that angle
    (index l has angle pi * (L - 1 - l) / L)."""
    y, x = np.mgrid[0:28, 0:28].astype(np.float32)
    stripes = np.cos(scattering.XI0 * (x * math.cos(angle) + y * math.sin(angle)))
    out = np.asarray(scatter(jnp.asarray(stripes)[None, :, :, None]))[0]
    energy = (out[2:5, 2:5, 1:9] ** 2).sum(axis=(0, 1))  # centre, first order, scale 0
    assert int(np.argmax(energy)) == expected_index
    assert energy.max() > 5 * np.median(energy)


def test_examples_do_not_mix(scatter):
    x = jax.random.normal(jax.random.key(1), (4, 28, 28, 1))
    together = np.asarray(scatter(x))
    alone = np.asarray(scatter(x[2:3]))
    np.testing.assert_allclose(together[2:3], alone, rtol=1e-4, atol=1e-5)


def test_registered_models_build_and_the_linear_backbone_is_parameter_free():
    x = jnp.zeros((2, 28, 28, 1))
    linear = registry.get_model("scatternet-linear")
    assert jax.tree.leaves(linear.init(jax.random.key(0), x, method="features")) == []
    assert registry.get_spec("scatternet-linear").parameter_free_backbone
    variables = linear.init(jax.random.key(0), x)
    assert linear.apply(variables, x, method="features").shape == (
        2,
        registry.get_spec("scatternet-linear").feature_dim,
    )
    cnn = registry.get_model("scatternet-cnn")
    cnn_vars = cnn.init(jax.random.key(0), x)
    assert cnn.apply(cnn_vars, x).shape == (2, 10)
    assert cnn.apply(cnn_vars, x, method="features").shape == (2, registry.get_spec("scatternet-cnn").feature_dim)
    with pytest.raises(InvalidConfigError, match="must divide"):
        scattering.scatter_linear(num_groups=10)
    with pytest.raises(InvalidConfigError, match="divisible by num_groups=16"):
        scattering.scatter_cnn(channels=(64, 40))
    with pytest.raises(InvalidConfigError, match="unknown activation 'gelu'"):
        scattering.scatter_cnn(activation="gelu")


def test_the_tanh_top_applies_tanh_where_the_default_applies_relu():
    maps = jax.random.normal(jax.random.key(3), (2, 7, 7, 81))
    # one stage, so both activations see the same normalised maps
    relu, tanh = scattering.ScatterCNNTop((16,)), scattering.ScatterCNNTop((16,), activation="tanh")
    params = relu.init(jax.random.key(0), maps)  # the same parameters: the activation has none
    relu_out, tanh_out = np.asarray(relu.apply(params, maps)), np.asarray(tanh.apply(params, maps))
    assert relu_out.min() == 0.0 and tanh_out.min() < -0.1 and np.abs(tanh_out).max() <= 1.0
    assert np.all((relu_out > 0) == (tanh_out > 0))  # both keep the normalised map's sign


def test_parameter_free_backbone_is_built_on_first_use_only(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSCALE_WEIGHTS_DIR", str(tmp_path))
    directory = pretrained.resolve_backbone("scatternet-linear")
    assert pretrained.is_complete(directory)
    meta_file = os.path.join(directory, pretrained.METADATA_FILE)
    first = os.stat(meta_file).st_mtime_ns
    assert pretrained.resolve_backbone("scatternet-linear") == directory
    assert os.stat(meta_file).st_mtime_ns == first  # not rewritten
    model, variables, prep = pretrained.load_pretrained("scatternet-linear")
    assert (prep.resolution, prep.mean, prep.std) == (28, (127.5,), (127.5,))
    images = np.random.default_rng(0).integers(0, 256, (2, 28, 28, 1)).astype(np.uint8)
    expected = registry.get_model("scatternet-linear").apply(
        {}, (images.astype(np.float32) - 127.5) / 127.5, method="features"
    )
    np.testing.assert_allclose(model.apply(variables, prep(images), method="features"), expected, rtol=1e-5, atol=1e-5)
    # a model with trained backbone weights is never invented
    with pytest.raises(Exception, match="cnn-small has no weights to load by name"):
        pretrained.read_metadata(pretrained.resolve_backbone("cnn-small"))
