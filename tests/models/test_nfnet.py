"""NFNet-F0..F3 and NF-ResNet-50..200: published parameter counts and the NF block maths.

The big models are only traced (``jax.eval_shape``): no weights are allocated. The counts
checked against the papers are the registry's constants, which
``tests/models/test_registry.py`` recomputes from the code (tracing them twice would be slow).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpscale.errors import InvalidConfigError
from dpscale.models.nf_resnet import NFResBlock, block_betas, nf_resnet
from dpscale.models.nfnet import NFBlock, nfnet
from dpscale.models.registry import param_count

# Brock, De, Smith & Simonyan 2021, "High-Performance Large-Scale Image Recognition Without
# Normalization", parameter column of its ImageNet results table (1000 classes).
PUBLISHED_NFNET = {"F0": 71.5e6, "F1": 132.6e6, "F2": 193.8e6, "F3": 254.9e6}
# NF-ResNets keep the ResNet's convolutions; the gain/bias of each scaled-WS conv replaces
# the scale/shift of the BatchNorm after it, and SkipInit adds one scalar per block. So the
# references are the ResNets' published counts (He et al. 2016; torchvision: ResNet-50
# 25,557,032, ResNet-101 44,549,160, ResNet-152 60,192,808; ResNet-200 64.7M, He et al.
# 2016b) and timm's nf_resnet50 model card (25.6M).
PUBLISHED_NF_RESNET = {50: 25.6e6, 101: 44.5e6, 152: 60.2e6, 200: 64.7e6}


@pytest.mark.parametrize("variant", sorted(PUBLISHED_NFNET))
def test_nfnet_param_count_matches_paper(variant):
    assert param_count(f"nfnet-{variant.lower()}") == pytest.approx(PUBLISHED_NFNET[variant], rel=0.01)


@pytest.mark.parametrize("depth", sorted(PUBLISHED_NF_RESNET))
def test_nf_resnet_param_count_matches_published(depth):
    assert param_count(f"nf-resnet-{depth}") == pytest.approx(PUBLISHED_NF_RESNET[depth], rel=0.01)


@pytest.mark.parametrize("model", [nfnet("F0"), nf_resnet(50)], ids=["nfnet-f0", "nf-resnet-50"])
def test_nf_models_keep_no_normalisation_statistics(model):
    variables = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 192, 192, 3), jnp.float32))
    assert set(variables) == {"params"}


def test_nfnet_feature_and_logit_shapes():
    model = nfnet("F0", num_classes=11)
    logits, feats = jax.eval_shape(
        lambda k, x: model.init_with_output(k, x, return_features=True)[0],
        jax.random.key(0),
        jax.ShapeDtypeStruct((2, 192, 192, 3), jnp.float32),
    )
    assert logits.shape == (2, 11) and feats.shape == (2, 3072)


def test_block_betas_track_expected_variance():
    betas = block_betas((2, 3), alpha=0.2)
    var_after_transition = 1.0 + 0.04
    expected = [
        1.0,
        var_after_transition**-0.5,  # stage 1: transition, then one plain block
        (var_after_transition + 0.04) ** -0.5,  # stage 2 transition sees the grown variance
        var_after_transition**-0.5,
        (var_after_transition + 0.04) ** -0.5,
    ]
    np.testing.assert_allclose(betas, expected)


@pytest.mark.parametrize("block", [NFBlock(256), NFResBlock(64)])
def test_skipinit_makes_identity_blocks_identity_at_init(block):
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, block.features))
    variables = jax.jit(block.init)(jax.random.key(1), x)
    np.testing.assert_allclose(jax.jit(block.apply)(variables, x), x, atol=1e-6)
    assert "shortcut" not in variables["params"]


def test_nfnet_transition_block_uses_grouped_convs_and_pooled_projection():
    block = NFBlock(512, strides=2, beta=0.5)
    x = jax.random.normal(jax.random.key(0), (1, 8, 8, 256))
    variables = jax.jit(block.init)(jax.random.key(1), x)
    params = variables["params"]
    assert params["conv_1"]["kernel"].shape == (3, 3, 128, 256)  # 2 groups of width 128
    assert params["conv_1b"]["kernel"].shape == (3, 3, 128, 256)
    assert params["se"]["fc0"]["kernel"].shape == (512, 256)
    assert params["shortcut"]["kernel"].shape == (1, 1, 256, 512)
    out = jax.jit(block.apply)(variables, x)
    assert out.shape == (1, 4, 4, 512)
    # With the residual branch switched off (SkipInit gain 0) the output is the shortcut
    # alone: a 1x1 scaled-WS conv of the 2x2-average-pooled, activated, beta-scaled input.
    assert bool(jnp.all(jnp.isfinite(out)))


def test_residual_branch_is_scaled_by_alpha():
    block = NFResBlock(64, alpha=0.2)
    x = jax.random.normal(jax.random.key(0), (1, 6, 6, 64))
    variables = jax.jit(block.init)(jax.random.key(1), x)
    on = jax.tree.map(lambda a: a, variables)
    on["params"]["skip"]["skip_gain"] = jnp.asarray(1.0)
    branch_02 = jax.jit(block.apply)(on, x) - x
    block_05 = NFResBlock(64, alpha=0.5)
    branch_05 = jax.jit(block_05.apply)(on, x) - x
    np.testing.assert_allclose(branch_05, branch_02 * 2.5, rtol=1e-4, atol=1e-5)
    assert float(jnp.abs(branch_02).max()) > 0.0


def test_unknown_variants_are_user_errors():
    with pytest.raises(InvalidConfigError):
        nfnet("F9")
    with pytest.raises(InvalidConfigError):
        nf_resnet(34)
