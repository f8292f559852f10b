"""``dpscale models [--json]`` prints the registry."""

import json

from click.testing import CliRunner

from dpscale.cli import cli
from dpscale.models.registry import get_spec, list_models, param_count


def test_models_json_lists_every_model_with_counts():
    result = CliRunner().invoke(cli, ["models", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [row["name"] for row in rows] == list_models()
    by_name = {row["name"]: row for row in rows}
    for name in ("wrn-16-4", "nf-resnet-50", "nfnet-f3", "cnn-small"):
        row = by_name[name]
        assert row["params"] == param_count(name)
        assert tuple(row["input_shape"]) == get_spec(name).input_shape
        assert isinstance(row["pretrained"], bool)
    assert by_name["nfnet-f3"]["params"] > 250_000_000
    assert by_name["cnn-small"]["input_shape"] == [28, 28, 1]


def test_models_table_has_a_header_one_line_per_model_and_says_what_its_columns_mean():
    result = CliRunner().invoke(cli, ["models"])
    assert result.exit_code == 0, result.output
    header, *rest = result.output.splitlines()
    assert header.split() == ["model", "parameters", "input", "classes", "weights", "cuts", "(tops)"]
    rows, legend = rest[: len(list_models())], rest[len(list_models()) :]
    assert [row.split()[0] for row in rows] == list_models()
    for column in ("parameters", "classes"):  # right-aligned under its header: no row shifted
        end = header.index(column) + len(column)
        assert all(row[end - 1].isdigit() and row[end] == " " for row in rows), (column, result.output)
    assert len({row.index("ImageNet") if "ImageNet" in row else row.rindex("  -  ") + 2 for row in rows}) == 1
    assert rows[0].split()[-2:] == ["-", "-"] and "- = none published" in "\n".join(legend)
    assert "ImageNet = published weights" in "\n".join(legend)
    lite0 = next(row for row in rows if row.startswith("efficientnet-lite0 "))
    assert lite0.endswith("ImageNet  blocks_0 .. blocks_15 (pretrained)")
    assert "featurize --backbone NAME --cut CUT" in "\n".join(legend)


def test_the_listing_is_the_registry_s_own_description_of_every_model():
    """``dpscale models`` reads models.catalogue (no JAX); every row must say what the registry says."""
    from dpscale.models import catalogue, registry

    assert list(catalogue.MODELS) == [registry.describe(name) for name in list_models()]
