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


def test_models_table_has_one_line_per_model():
    result = CliRunner().invoke(cli, ["models"])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == len(list_models())
    assert lines[0].startswith(list_models()[0])
