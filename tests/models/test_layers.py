"""Weight standardisation is a differentiable op on the kernel; scaled WS preserves variance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpscale.models.layers import GroupNorm, ScaledWSConv, WSConv, scaled_gelu, scaled_relu, standardize_kernel


def _x(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape)


def test_ws_conv_uses_standardised_kernel():
    conv = WSConv(8, 3)
    x = _x((2, 9, 9, 4))
    variables = jax.jit(conv.init)(jax.random.key(1), x)
    kernel = variables["params"]["kernel"]
    # Shifting and scaling the raw kernel per output channel must not change the output.
    moved = kernel * 3.0 + 0.5
    out = jax.jit(conv.apply)(variables, x)
    out_moved = jax.jit(conv.apply)({"params": {"kernel": moved}}, x)
    # (up to eps = 1e-5 against a kernel variance of ~1/36)
    np.testing.assert_allclose(out, out_moved, atol=1e-3, rtol=2e-3)
    w = standardize_kernel(kernel, eps=1e-5)
    np.testing.assert_allclose(w.mean(axis=(0, 1, 2)), 0.0, atol=1e-5)
    np.testing.assert_allclose(w.var(axis=(0, 1, 2)), 1.0, atol=1e-3)
    assert "bias" not in variables["params"]


def test_ws_gradient_flows_through_the_statistics():
    # out(t * W) = out(W) for t > 0, so the kernel gradient is orthogonal to the kernel;
    # a WS applied outside autodiff (stop_gradient on the statistics) would not satisfy this.
    conv = WSConv(8, 3)
    x = _x((2, 9, 9, 4))
    variables = jax.jit(conv.init)(jax.random.key(1), x)

    def loss(kernel):
        return jnp.sum(jax.jit(conv.apply)({"params": {"kernel": kernel}}, x) ** 3)

    kernel = variables["params"]["kernel"]
    grad = jax.grad(loss)(kernel)
    cosine = jnp.vdot(grad, kernel) / (jnp.linalg.norm(grad) * jnp.linalg.norm(kernel))
    assert abs(float(cosine)) < 1e-3
    assert float(jnp.linalg.norm(grad)) > 0.0


def test_scaled_ws_conv_preserves_unit_variance_and_has_gain_and_bias():
    conv = ScaledWSConv(64, 3)
    x = _x((8, 16, 16, 32))
    variables = jax.jit(conv.init)(jax.random.key(2), x)
    assert set(variables["params"]) == {"kernel", "gain", "bias"}
    out = jax.jit(conv.apply)(variables, x)
    assert float(jnp.var(out)) == pytest.approx(1.0, rel=0.1)
    doubled = dict(variables["params"], gain=2.0 * variables["params"]["gain"])
    np.testing.assert_allclose(jax.jit(conv.apply)({"params": doubled}, x), 2.0 * out, atol=1e-4, rtol=1e-4)


def test_scaled_ws_grouped_conv_kernel_shape():
    conv = ScaledWSConv(32, 3, feature_group_count=4)
    variables = jax.jit(conv.init)(jax.random.key(0), _x((1, 8, 8, 16)))
    assert variables["params"]["kernel"].shape == (3, 3, 4, 32)


@pytest.mark.parametrize("act", [scaled_relu, scaled_gelu])
def test_scaled_activations_are_variance_preserving(act):
    z = _x((1_000_000,))
    assert float(jnp.var(act(z))) == pytest.approx(1.0, abs=0.01)


def test_group_norm_defaults_to_16_groups_per_example():
    norm = GroupNorm()
    assert norm.num_groups == 16
    x = _x((2, 4, 4, 32))
    variables = jax.jit(norm.init)(jax.random.key(0), x)
    out = jax.jit(norm.apply)(variables, x)
    # Each example, each group of 2 channels: zero mean over space and its channels.
    grouped = out.reshape(2, 4, 4, 16, 2)
    np.testing.assert_allclose(grouped.mean(axis=(1, 2, 4)), 0.0, atol=1e-5)
    single = jax.jit(norm.apply)(variables, x[:1])
    np.testing.assert_allclose(single, out[:1], atol=1e-6)
