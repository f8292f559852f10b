"""Backbones split at a cut (models/cuts.py): the top on cached activations is the network above the cut."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from dpscale.errors import DataError, InvalidConfigError
from dpscale.models import cuts, registry, scattering
from dpscale.models.classifier import Classifier
from dpscale.privacy.ghost import make_ghost_clipped_sum_fn
from dpscale.privacy.sampling import SampledBatch
from dpscale.training.feeds import ActivationFeed


def _loss(model, params, state, x, y):
    logits = model.apply({"params": params, **state}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _perturbed(tree, seed, scale=0.05):
    """Parameters moved off their initial values (a zero head would zero every other gradient)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten([leaf + scale * jax.random.normal(k, leaf.shape) for k, leaf in zip(keys, leaves)])


def _merged(full, top_params):
    """The full network's parameters with the top's trained ones in their places."""
    if isinstance(top_params, dict):
        return {k: _merged(full[k], top_params[k]) if k in top_params else v for k, v in full.items()}
    return top_params


class ScatterThenTop(nn.Module):
    """What a top above the scattering cut computes from images: the maps, then the top (one network)."""

    top: cuts.ScatterTop

    @nn.compact
    def __call__(self, x):
        maps = scattering.scatter_maps(x, J=2, L=8, num_groups=27)
        stages = scattering.ScatterCNNTop(self.top.channels, activation=self.top.activation, name="backbone")
        return Classifier(10, name="head")(stages(maps))


CASES = [
    ("efficientnet-lite0", (32, 32, 3), "blocks_3", "pretrained"),
    ("efficientnet-lite0", (32, 32, 3), "blocks_14", "pretrained"),
    ("efficientnet-lite0", (32, 32, 3), "blocks_15", "pretrained"),
]


@pytest.mark.parametrize("top_name", ["cnn", "cnn-wide", "cnn-tanh"])
def test_a_scattering_top_on_cached_maps_is_the_network_from_images(top_name):
    model = registry.get_model("scatternet-linear", num_classes=10)
    x = jax.random.normal(jax.random.key(1), (3, 28, 28, 1))
    maps = cuts.activations_fn(model, "scattering", {})(x)
    top = cuts.build_top(model, "scattering", top_name, variables={}, num_classes=10, activation_shape=(7, 7, 81))
    params = top.init_params(jax.random.key(0))
    whole = ScatterThenTop(cuts.SCATTER_TOPS[top_name])
    np.testing.assert_allclose(top.model.apply({"params": params}, maps), whole.apply({"params": params}, x), rtol=1e-4, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize(("name", "shape", "cut", "top_name"), CASES)
def test_the_top_on_activations_has_the_full_networks_logits_and_gradients(name, shape, cut, top_name):
    model = registry.get_model(name, num_classes=10)
    x = jax.random.normal(jax.random.key(1), (3, *shape))
    y = jnp.array([1, 4, 7])
    variables = _perturbed(model.init(jax.random.key(0), x), 2)
    acts = cuts.activations_fn(model, cut, variables)(x)
    top = cuts.build_top(
        model, cut, top_name, variables=variables, num_classes=10, activation_shape=tuple(acts.shape[1:])
    )
    params = _perturbed(top.init_params(jax.random.key(3)), 4)
    full = {**variables, "params": _merged(variables["params"], params)}
    state = {k: v for k, v in full.items() if k != "params"}
    np.testing.assert_allclose(
        top.model.apply({"params": params, **top.model_state}, acts), model.apply(full, x), rtol=1e-4, atol=1e-5
    )
    via_top = jax.grad(lambda p: _loss(top.model, p, top.model_state, acts, y))(params)
    via_full = jax.grad(lambda p: _loss(model, _merged(full["params"], p), state, x, y))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6), via_top, via_full)


def test_the_pretrained_top_starts_from_the_backbones_weights_and_a_zero_classifier():
    model = registry.get_model("efficientnet-lite0", num_classes=1000)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
    top = cuts.build_top(
        model, "blocks_12", "pretrained", variables=variables, num_classes=5, activation_shape=(2, 2, 192)
    )
    params = top.init_params(jax.random.key(9))
    assert sorted(params["backbone"]) == ["blocks_13", "blocks_14", "blocks_15", "head_bn", "head_conv"]
    np.testing.assert_array_equal(params["backbone"]["blocks_14"]["project_conv"]["kernel"],
                                  variables["params"]["backbone"]["blocks_14"]["project_conv"]["kernel"])  # fmt: skip
    assert not np.any(params["head"]["fc"]["kernel"]) and params["head"]["fc"]["kernel"].shape == (1280, 5)
    assert sorted(top.model_state["batch_stats"]["backbone"]) == ["blocks_13", "blocks_14", "blocks_15", "head_bn"]


def test_unknown_cuts_and_tops_are_refused_with_the_ones_there_are():
    lite = registry.get_model("efficientnet-lite0", num_classes=10)
    with pytest.raises(InvalidConfigError, match="its cuts: blocks_0"):
        cuts.check_cut(lite, "efficientnet-lite0", "blocks_16")
    with pytest.raises(InvalidConfigError, match="has no cuts"):
        cuts.check_cut(registry.get_model("wrn-16-4", num_classes=10), "wrn-16-4", "blocks_1")
    with pytest.raises(InvalidConfigError, match="tops: cnn, cnn-wide"):
        cuts.build_top(
            registry.get_model("scatternet-linear", num_classes=10),
            "scattering",
            "pretrained",
            variables={},
            num_classes=10,
            activation_shape=(7, 7, 81),
        )


def test_clipping_the_top_on_activations_equals_clipping_the_network_on_images():
    """The scattering has no parameters, so the top's are the whole network's: K = 2 views clipped from
    the images and from their scattering maps give the same clipped sum (views averaged before clipping)."""
    model = ScatterThenTop(cuts.SCATTER_TOPS["cnn"])
    images = jax.random.normal(jax.random.key(1), (4, 2, 28, 28, 1))
    labels = jnp.tile(jnp.array([[1], [3], [5], [7]]), (1, 2))
    backbone = registry.get_model("scatternet-linear", num_classes=10)
    maps = cuts.activations_fn(backbone, "scattering", {})(images.reshape(-1, 28, 28, 1))
    maps = maps.reshape(4, 2, *maps.shape[1:])
    top = cuts.build_top(backbone, "scattering", "cnn", variables={}, num_classes=10, activation_shape=maps.shape[2:])
    params = _perturbed(top.init_params(jax.random.key(0)), 1)
    mask = jnp.array([1.0, 1.0, 0.0, 1.0])

    def clipped(net, inputs):
        def loss_fn(p, state, views):
            return _loss(net, p, state, views["image"], views["label"])

        batch = {"image": inputs, "label": labels}
        fn = make_ghost_clipped_sum_fn(loss_fn, clip_norm=0.1, example=(params, {}, batch))
        return jax.jit(fn)(params, {}, batch, mask)

    on_images, on_maps = clipped(model, images), clipped(top.model, maps)
    assert int(on_images.num_clipped) == int(on_maps.num_clipped) == 3
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6), on_images.value, on_maps.value)


def test_each_example_alone_moves_the_pretrained_tops_clipped_sum_by_at_most_one():
    model = registry.get_model("efficientnet-lite0", num_classes=10)
    variables = _perturbed(model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3))), 2)
    top = cuts.build_top(
        model, "blocks_14", "pretrained", variables=variables, num_classes=10, activation_shape=(1, 1, 192)
    )
    params = _perturbed(top.init_params(jax.random.key(0)), 3)
    scales = jnp.array([1e-3, 1.0, 1e3, 1e6]).reshape(4, 1, 1, 1, 1)
    batch = {"image": scales * jax.random.normal(jax.random.key(5), (4, 2, 1, 1, 192)), "label": jnp.zeros((4, 2), int)}

    def loss_fn(p, state, views):
        return _loss(top.model, p, state, views["image"], views["label"])

    # Per-layer clipping covers every layer of the top (no UnsupportedModelError: no fallback to vmap).
    fn = jax.jit(make_ghost_clipped_sum_fn(loss_fn, clip_norm=1.0, example=(params, top.model_state, batch)))
    for i in range(4):
        out = fn(params, top.model_state, batch, jnp.zeros(4).at[i].set(1.0))
        leaves = [np.asarray(leaf, np.float64) for leaf in jax.tree_util.tree_leaves(out.value)]
        assert np.sqrt(sum(np.sum(leaf * leaf) for leaf in leaves)) <= 1.0


def _sampled(indices):
    indices = np.asarray(indices)
    return SampledBatch(indices=indices, mask=(indices >= 0).astype(np.float32))


def test_the_activation_feed_takes_k_distinct_cached_views_and_zeroes_padding():
    n, views = 6, 4
    activations = np.arange(n * views, dtype=np.float32).reshape(n, views, 1, 1, 1) + 1  # value = 1 + 4 row + view
    labels = np.arange(n) % 3
    batch = _sampled([[5, 0, -1, 2]])
    feed = ActivationFeed(activations, labels, augmult=2, key=jax.random.key(0))
    (inputs, mask), = feed.microbatches(batch, step=0)  # fmt: skip
    image = np.asarray(inputs["image"]).reshape(4, 2)
    assert image.shape == (4, 2) and not image[2].any() and np.asarray(mask).tolist() == [1, 1, 0, 1]
    for slot, row in ((0, 5), (1, 0), (3, 2)):
        taken = (image[slot] - 1 - views * row).astype(int)
        assert len(set(taken)) == 2 and set(taken) <= set(range(views))
    np.testing.assert_array_equal(np.asarray(inputs["label"]), [[2, 2], [0, 0], [0, 0], [2, 2]])
    again = ActivationFeed(activations, labels, augmult=2, key=jax.random.key(0)).microbatches(batch, step=0)
    np.testing.assert_array_equal(again[0][0]["image"], inputs["image"])  # the same draw in every process
    other_steps = {tuple(np.asarray(feed.microbatches(batch, step=s)[0][0]["image"]).ravel()) for s in range(1, 6)}
    assert len(other_steps) > 1  # drawn afresh each step
    every = ActivationFeed(activations, labels, augmult=views, key=jax.random.key(0)).microbatches(batch, step=3)
    np.testing.assert_array_equal(np.asarray(every[0][0]["image"])[0].ravel(), 1 + views * 5 + np.arange(views))


@pytest.mark.parametrize("top_name", ["cnn", "cnn-wide", "cnn-tanh"])
def test_a_scattering_top_joined_below_its_cut_is_the_registered_model_from_images(top_name):
    backbone = registry.get_model("scatternet-linear", num_classes=10)
    x = jax.random.normal(jax.random.key(1), (3, 28, 28, 1))
    maps = cuts.activations_fn(backbone, "scattering", {})(x)
    top = cuts.build_top(backbone, "scattering", top_name, variables={}, num_classes=10, activation_shape=(7, 7, 81))
    params = _perturbed(top.init_params(jax.random.key(0)), 1)
    name = cuts.joined_model_name("scatternet-linear", backbone, top_name)
    whole = registry.get_model(name, num_classes=10)
    joined = cuts.join(backbone, "scattering", top, whole=whole, variables={}, params=params, state={})
    np.testing.assert_allclose(whole.apply(joined, x), top.model.apply({"params": params}, maps), rtol=1e-4, atol=1e-5)
    assert cuts.cut_names(whole) == ("scattering",)  # its maps are the same cut
    # cnn-tanh's other is cnn: the same shapes, another activation
    other = registry.get_model(cuts.SCATTER_TOP_MODELS["cnn-wide" if top_name == "cnn" else "cnn"], num_classes=10)
    pooled = registry.get_model("scatternet-cnn", num_classes=10)  # the same stages, pooled, not flattened
    for wrong in (other, pooled):
        with pytest.raises(DataError, match="not the scattering the activations were cut with, then this top"):
            cuts.join(backbone, "scattering", top, whole=wrong, variables={}, params=params, state={})


def test_a_lite_top_joins_only_as_the_top_it_is():
    model = registry.get_model("efficientnet-lite0", num_classes=10)
    variables = _perturbed(model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3))), 2)
    top = cuts.build_top(
        model, "blocks_13", "pretrained", variables=variables, num_classes=4, activation_shape=(1, 1, 192)
    )
    params = _perturbed(top.init_params(jax.random.key(0)), 3)
    whole = registry.get_model("efficientnet-lite0", num_classes=4)

    def join(p, s=top.model_state):
        return cuts.join(model, "blocks_13", top, whole=whole, variables=variables, params=p, state=s)

    joined = join(params)
    assert joined["batch_stats"] is variables["batch_stats"] and joined["params"]["head"] is params["head"]
    np.testing.assert_array_equal(joined["params"]["backbone"]["blocks_14"]["project_conv"]["kernel"],
                                  params["backbone"]["blocks_14"]["project_conv"]["kernel"])  # fmt: skip
    np.testing.assert_array_equal(joined["params"]["backbone"]["blocks_13"]["project_conv"]["kernel"],
                                  variables["params"]["backbone"]["blocks_13"]["project_conv"]["kernel"])  # fmt: skip
    with pytest.raises(DataError, match=r"\(backbone/blocks_13/\S+ is not the top.s\)"):
        join({**params, "backbone": {**params["backbone"], "blocks_13": params["backbone"]["blocks_14"]}})
    with pytest.raises(DataError, match=r"\(backbone/head_conv/kernel is missing\)"):
        join({**params, "backbone": {k: v for k, v in params["backbone"].items() if k != "head_conv"}})
    with pytest.raises(DataError, match="frozen statistics above 'blocks_13' are not the backbone's own"):
        join(params, jax.tree.map(lambda a: a + 1, top.model_state))
