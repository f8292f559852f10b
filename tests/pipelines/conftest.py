"""Shared helpers for the pipeline tests."""

import pytest
from click.testing import CliRunner

from dpscale.cli import cli
from dpscale.errors import DataError


@pytest.fixture
def config_from_cli(monkeypatch):
    """``(stage_module, argv) -> config``: run the CLI with the stage's ``run`` replaced, return its config.

    The replacement raises a DataError after recording the config, so no pipeline runs and
    nothing touches the network; the CLI must report it as one line with exit code 2.
    """

    def invoke(stage, argv):
        seen = {}

        def fake_run(config):
            seen["config"] = config
            raise DataError("stop here")

        monkeypatch.setattr(stage, "run", fake_run)
        result = CliRunner().invoke(cli, argv)
        assert result.exit_code == 2 and result.output == "dpscale: error: stop here\n", result.output
        return seen["config"]

    return invoke
