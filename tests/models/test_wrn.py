"""WRN-d-k: layout, parameter counts against Zagoruyko & Komodakis 2016, GroupNorm + WS only."""

import jax
import jax.numpy as jnp
import pytest

from dpscale.errors import InvalidConfigError
from dpscale.models.wrn import wide_resnet

# Published parameter counts (Zagoruyko & Komodakis 2016, "Wide Residual Networks", CIFAR
# tables, 10 classes). Normalisation layers have 2 parameters per channel,
# GroupNorm exactly like BatchNorm, so the counts carry over. WRN-16-4 (2.7M) is the model
# of De et al. 2022.
PUBLISHED_PARAMS = {
    (16, 4): 2.7e6,
    (16, 8): 11.0e6,
    (40, 4): 8.9e6,
    (28, 10): 36.5e6,
}


def _abstract_params(model, shape=(1, 32, 32, 3)):
    variables = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct(shape, jnp.float32))
    return variables


@pytest.mark.parametrize("depth,width", sorted(PUBLISHED_PARAMS))
def test_param_count_matches_published(depth, width):
    variables = _abstract_params(wide_resnet(depth, width, num_classes=10))
    count = sum(leaf.size for leaf in jax.tree.leaves(variables["params"]))
    # 1% of a number published to 2-3 significant digits (2.7M is itself rounded by ~2%).
    tolerance = 0.02 if (depth, width) == (16, 4) else 0.01
    assert count == pytest.approx(PUBLISHED_PARAMS[depth, width], rel=tolerance)
    assert set(variables) == {"params"}  # no batch statistics anywhere


def test_layout_of_wrn_16_4():
    params = _abstract_params(wide_resnet(16, 4, num_classes=7))["params"]
    backbone = params["backbone"]
    blocks = sorted(k for k in backbone if k.startswith("stage"))
    assert blocks == [f"stage{s}_block{b}" for s in (1, 2, 3) for b in (1, 2)]
    assert backbone["stem"]["kernel"].shape == (3, 3, 3, 16)
    assert backbone["stage1_block1"]["shortcut"]["kernel"].shape == (1, 1, 16, 64)
    assert "shortcut" not in backbone["stage1_block2"]
    assert backbone["stage3_block1"]["conv_0"]["kernel"].shape == (3, 3, 128, 256)
    assert backbone["final_norm"]["scale"].shape == (256,)
    assert params["head"]["fc"]["kernel"].shape == (256, 7)


def test_spatial_downsampling_and_output_shape():
    model = wide_resnet(10, 1, num_classes=5)
    out = jax.eval_shape(
        lambda k, x: model.init_with_output(k, x, return_features=True)[0],
        jax.random.key(0),
        jax.ShapeDtypeStruct((3, 32, 32, 3), jnp.float32),
    )
    logits, feats = out
    assert logits.shape == (3, 5) and feats.shape == (3, 64)


@pytest.mark.parametrize("depth,width", [(15, 4), (4, 4), (16, 0)])
def test_invalid_depth_or_width_is_a_user_error(depth, width):
    with pytest.raises(InvalidConfigError):
        wide_resnet(depth, width)
