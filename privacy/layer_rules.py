"""Book-keeping's per-layer rules: each example's parameter gradient from a layer's input and output gradient.

A rule takes the unbound layer, its parameters, the other variables the call read (frozen
BatchNorm statistics, leaves ``[b, ...]``), the recorded input ``x`` and output gradient ``g``
(``[b, K, ...]``, the 1/K of the view average already in ``g``) and returns ``{name: [b, *shape]}``.
``privacy.bookkeeping`` proves that these calls cover every parameter, and the clipped sum holds
what a rule returns and clips it by its own norm, so a rule cannot raise the sensitivity; a wrong
rule gives wrong gradients silently, so each is checked against ``vmap(grad)``
(tests/privacy/test_layer_rules.py).

Rules are keyed by exact type (a subclass may use its parameters otherwise), and ``problem``
refuses the settings a rule does not compute (a grouped or dilated convolution, BatchNorm on
batch statistics, ...): the model then goes to ``vmap(grad)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen.linear import canonicalize_padding

from dpscale.models.efficientnet_lite import DepthwiseConv
from dpscale.models.layers import GroupNorm, WSConv, as_pair, standardize_kernel
from dpscale.privacy.rounding import Format, contract

PyTree = Any
Grads = dict[str, jax.Array]


def shifted_windows(x: jax.Array, window: tuple[int, int], strides: tuple[int, int], padding: Any) -> jax.Array:
    """``[n, H', W', kh, kw, C]``: the input under each kernel tap, by padding and strided slices.

    Pure data movement; ``lax.conv_general_dilated_patches`` builds the same windows with a
    one-hot convolution that costs ``(kh*kw*C)^2`` multiply-adds per output pixel.
    """
    (kh, kw), (sh, sw) = window, strides
    if isinstance(padding, str):
        padding = jax.lax.padtype_to_pads(x.shape[1:3], window, strides, padding)
    (top, bottom), (left, right) = padding
    x = jnp.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)))
    out_h, out_w = (x.shape[1] - kh) // sh + 1, (x.shape[2] - kw) // sw + 1
    rows = []
    for i in range(kh):
        cols = [x[:, i : i + (out_h - 1) * sh + 1 : sh, j : j + (out_w - 1) * sw + 1 : sw, :] for j in range(kw)]
        rows.append(jnp.stack(cols, axis=3))
    return jnp.stack(rows, axis=3)


def _kernel_gradient(
    x: jax.Array, g: jax.Array, kernel_shape: tuple[int, ...], strides: Any, padding: Any, fmt: Format
) -> jax.Array:
    """``dK_i = windows(x_i)^T g_i`` summed over positions and views, ``[b, kh, kw, cin, cout]``, at ``fmt``:
    what it rounds is in the held gradient, whose own norm clips it."""
    kh, kw, cin, cout = kernel_shape
    b = x.shape[0]
    windows = shifted_windows(x.reshape((-1,) + x.shape[2:]), (kh, kw), strides, padding)
    return contract(fmt, "bpijc,bpo->bijco", windows.reshape(b, -1, kh, kw, cin), g.reshape(b, -1, cout))


def _bias_gradient(g: jax.Array) -> jax.Array:
    return jnp.sum(g.reshape(g.shape[0], -1, g.shape[-1]), axis=1)


def _wsconv_rule(module: WSConv, params: PyTree, state: PyTree, x: jax.Array, g: jax.Array, fmt: Format) -> Grads:
    """The product of the standardised kernel's gradient, then back through WS (the same map for all)."""
    kernel = params["kernel"]
    d_weight = _kernel_gradient(x, g, kernel.shape, as_pair(module.strides), module.padding, fmt)
    _, standardize_vjp = jax.vjp(lambda k: standardize_kernel(k, eps=module.eps).astype(x.dtype), kernel)
    grads = {"kernel": jax.vmap(lambda d: standardize_vjp(d)[0])(d_weight)}
    if module.use_bias:
        grads["bias"] = _bias_gradient(g)
    return grads


def _conv_rule(module: nn.Conv, params: PyTree, state: PyTree, x: jax.Array, g: jax.Array, fmt: Format) -> Grads:
    strides = (1, 1) if module.strides is None else as_pair(module.strides)
    grads = {"kernel": _kernel_gradient(x, g, params["kernel"].shape, strides, _conv_padding(module), fmt)}
    if module.use_bias:
        grads["bias"] = _bias_gradient(g)
    return grads


def _depthwise_rule(
    module: DepthwiseConv, params: PyTree, state: PyTree, x: jax.Array, g: jax.Array, fmt: Format
) -> Grads:
    """``dK_i[a, c] = sum over positions of x_i(under tap a)[c] g_i[c]``, one tap at a time (the
    windows of all taps at once would be k*k copies of the input). Elementwise, so at float32
    whatever ``fmt``: no matrix product to run at lower precision."""
    k, s = module.kernel_size, module.stride
    b, c = x.shape[0], x.shape[-1]
    flat = x.reshape((-1,) + x.shape[2:])
    (top, bottom), (left, right) = jax.lax.padtype_to_pads(flat.shape[1:3], (k, k), (s, s), "SAME")
    flat = jnp.pad(flat, ((0, 0), (top, bottom), (left, right), (0, 0)))
    out_h, out_w = g.shape[-3], g.shape[-2]
    taps = []
    for i in range(k):
        for j in range(k):
            tap = flat[:, i : i + (out_h - 1) * s + 1 : s, j : j + (out_w - 1) * s + 1 : s, :]
            taps.append(jnp.sum((tap.reshape(g.shape) * g).reshape(b, -1, c), axis=1))
    return {"kernel": jnp.stack(taps, axis=1).reshape(b, k, k, 1, c)}


def _vjp_rule(module: nn.Module, params: PyTree, state: PyTree, x: jax.Array, g: jax.Array, fmt: Format) -> Grads:
    """Per-example VJP of the layer itself w.r.t. its parameters (exact by construction), with the
    variables the call read (frozen statistics) as constants.

    Cheap for dense layers and normalisations: under ``vmap`` their parameter gradient is a
    batched contraction or reduction, unlike a convolution's.
    """

    def one(xi: jax.Array, gi: jax.Array, si: PyTree) -> PyTree:
        _, vjp = jax.vjp(lambda p: module.apply({"params": p, **si}, xi), params)
        return vjp(gi)[0]

    return dict(jax.vmap(one)(x, g, state))


def _conv_padding(module: nn.Conv) -> Any:
    return canonicalize_padding(module.padding, 2)


def _ones(value: Any) -> bool:
    return value is None or value == 1 or (not isinstance(value, int) and all(v == 1 for v in value))


def _wsconv_problem(module: WSConv, x: jax.Array) -> str | None:
    if module.feature_group_count != 1:
        return "grouped WSConv"
    if x.ndim != 4:
        return f"WSConv on a {x.ndim}-d input (expected NHWC)"
    return None


def _conv_problem(module: nn.Conv, x: jax.Array) -> str | None:
    if isinstance(module.kernel_size, int) or len(module.kernel_size) != 2 or x.ndim != 4:
        return f"nn.Conv with kernel {module.kernel_size} on a {x.ndim}-d input (expected 2-d, NHWC)"
    if module.feature_group_count != 1:
        return "grouped nn.Conv"
    if not (_ones(module.input_dilation) and _ones(module.kernel_dilation)):
        return "dilated nn.Conv"
    if module.mask is not None:
        return "masked nn.Conv"
    if (
        module.conv_general_dilated is not None
        or module.conv_general_dilated_cls is not None
        or module.promote_dtype is not nn.dtypes.promote_dtype
    ):
        return "nn.Conv with its own convolution or dtype promotion"
    if isinstance(module.padding, str) and module.padding not in ("SAME", "VALID"):
        return f"nn.Conv with padding {module.padding!r}"
    return None


def _depthwise_problem(module: DepthwiseConv, x: jax.Array) -> str | None:
    return None if x.ndim == 4 else f"DepthwiseConv on a {x.ndim}-d input (expected NHWC)"


def _groupnorm_problem(module: nn.GroupNorm, x: jax.Array) -> str | None:
    return "GroupNorm with axis_name (cross-device statistics)" if module.axis_name is not None else None


def _batchnorm_problem(module: nn.BatchNorm, x: jax.Array) -> str | None:
    if module.use_running_average is not True:
        return "BatchNorm on batch statistics (only frozen ones: use_running_average=True)"
    if module.axis not in (-1, (-1,)) or module.axis_name is not None:
        return f"BatchNorm over axis {module.axis!r} or axis_name {module.axis_name!r} (expected the last axis)"
    return None


@dataclasses.dataclass(frozen=True)
class Rule:
    """A layer type's parameters, the other collections its call may read (constants to the rule),
    its per-example gradients, and what settings it refuses (a reason, or None)."""

    param_names: frozenset[str]
    grads: Callable[[Any, PyTree, PyTree, jax.Array, jax.Array, Format], Grads]
    problem: Callable[[Any, jax.Array], str | None] = lambda module, x: None
    state: frozenset[str] = frozenset()


_KERNEL_BIAS = frozenset({"kernel", "bias"})
_SCALE_BIAS = frozenset({"scale", "bias"})

# Exact types only: a subclass may use its parameters differently.
RULES: dict[type, Rule] = {
    WSConv: Rule(_KERNEL_BIAS, _wsconv_rule, _wsconv_problem),
    nn.Conv: Rule(_KERNEL_BIAS, _conv_rule, _conv_problem),
    DepthwiseConv: Rule(frozenset({"kernel"}), _depthwise_rule, _depthwise_problem),
    nn.Dense: Rule(_KERNEL_BIAS, _vjp_rule),
    nn.GroupNorm: Rule(_SCALE_BIAS, _vjp_rule, _groupnorm_problem),
    GroupNorm: Rule(_SCALE_BIAS, _vjp_rule, _groupnorm_problem),
    nn.BatchNorm: Rule(_SCALE_BIAS, _vjp_rule, _batchnorm_problem, frozenset({"batch_stats"})),
}
