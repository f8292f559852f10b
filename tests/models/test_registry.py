"""The registry: names, specs that match the built models, one table of families, user errors."""

import ast
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import pytest

from dpscale.errors import InvalidConfigError
from dpscale.models import registry
from dpscale.models.registry import get_model, get_spec, list_models, param_count

REQUIRED = [
    "wrn-16-4",
    "wrn-40-4",
    "wrn-28-10",
    "nf-resnet-50",
    "nf-resnet-101",
    "nf-resnet-152",
    "nf-resnet-200",
    "nfnet-f0",
    "nfnet-f1",
    "nfnet-f2",
    "nfnet-f3",
    "cnn-small",
]


def test_all_required_names_are_listed():
    names = list_models()
    assert set(REQUIRED) <= set(names)
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name", ["wrn-16-4", "cnn-small", "nf-resnet-50", "nfnet-f0"])
def test_spec_matches_the_model(name):
    spec = get_spec(name)
    model = get_model(name, num_classes=13)
    logits, feats = jax.eval_shape(
        lambda k, x: model.init_with_output(k, x, return_features=True)[0],
        jax.random.key(0),
        jax.ShapeDtypeStruct((2, *spec.input_shape), jnp.float32),
    )
    assert logits.shape == (2, 13)
    assert feats.shape == (2, spec.feature_dim)


@pytest.mark.parametrize("name", list_models())
def test_stored_param_count_matches_the_model_code(name):
    """The constants that keep ``dpscale models`` fast must follow any change to a model."""
    spec = get_spec(name)
    assert spec.params is not None, f"{name}: give its ModelSpec a params count"
    assert spec.params == registry.traced_param_count(name)


def test_param_count_traces_what_has_no_constant():
    # Other class counts and on-demand WRNs have no constant; they are traced.
    assert get_spec("wrn-22-2").params is None
    assert param_count("wrn-22-2") == registry.traced_param_count("wrn-22-2") > 0
    assert param_count("wrn-16-4", num_classes=11) - param_count("wrn-16-4") == 256 + 1


def test_param_count_counts_real_parameters():
    model = get_model("cnn-small")
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
    real = sum(int(leaf.size) for leaf in jax.tree.leaves(variables["params"]))
    assert param_count("cnn-small") == real
    # The classifier is the only part that depends on the number of classes.
    assert param_count("cnn-small", num_classes=11) - real == 128 + 1


def test_any_valid_wrn_name_resolves():
    spec = get_spec("wrn-22-2")
    assert spec.feature_dim == 128 and spec.input_shape == (32, 32, 3)
    with pytest.raises(InvalidConfigError, match="6n\\+4"):
        get_spec("wrn-21-2")


def test_unknown_names_and_bad_class_counts_are_user_errors():
    with pytest.raises(InvalidConfigError, match="unknown model"):
        get_spec("resnet-9000")
    with pytest.raises(InvalidConfigError):
        get_model("cnn-small", num_classes=0)


def test_a_name_listed_twice_is_refused():
    spec = get_spec("cnn-small")
    assert registry._table([spec, get_spec("wrn-16-4")]) == {"cnn-small": spec, "wrn-16-4": get_spec("wrn-16-4")}
    with pytest.raises(ValueError, match="listed twice"):
        registry._table([spec, dataclasses.replace(spec, num_classes=4)])


def test_every_family_is_listed_by_the_registry_and_no_model_module_imports_it():
    families = {spec.name.split("-")[0] for spec in map(get_spec, list_models())}
    assert families == {"wrn", "nf", "nfnet", "cnn", "scatternet", "efficientnet"}
    models_dir = pathlib.Path(registry.__file__).parent
    importers = sorted(
        path.name
        for path in models_dir.glob("*.py")
        if path.name not in ("registry.py", "pretrained.py") and "registry" in _imported(path)
    )
    assert not importers, f"model modules importing the registry: {importers}"


def _imported(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.update(alias.name for alias in node.names)
            names.update((node.module or "").split("."))
        elif isinstance(node, ast.Import):
            names.update(part for alias in node.names for part in alias.name.split("."))
    return names


@pytest.mark.parametrize("name", list_models())
@pytest.mark.parametrize("side", [8, 4])
def test_every_model_takes_a_small_image_or_refuses_it_by_name(name, side):
    """An image smaller than a model was built for (8x8 digits) gives logits or a user error, never a crash."""
    model = get_model(name, num_classes=10)
    x = jax.ShapeDtypeStruct((1, side, side, 1), jnp.float32)
    try:
        logits = jax.eval_shape(lambda k, x: model.init_with_output(k, x)[0], jax.random.key(0), x)
    except InvalidConfigError as error:
        assert f"{side}x{side}" in str(error)
    else:
        assert logits.shape == (1, 10)
