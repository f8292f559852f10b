"""A gs:// path without the gcp extra: one line naming what to install, exit 2, in every command."""

import sys

import pytest
from click.testing import CliRunner

from dpscale.cli import cli

B = "gs://dpscale-test"
COMMANDS = {
    "ingest": ["ingest", "digits", f"{B}/digits"],
    "dedup": ["dedup", f"{B}/public", f"{B}/private", f"{B}/out"],
    "featurize": ["featurize", f"{B}/digits", "--backbone", f"{B}/backbone"],
    "train": ["train", f"{B}/digits", f"{B}/run", "--epsilon", "1", "--steps", "2", "--batch-size", "8"],
    "train-local-data": ["train", "DATA", f"{B}/run", "--epsilon", "1", "--steps", "2", "--batch-size", "8"],
    "resume": ["train", "--resume", f"{B}/run"],
    "evaluate": ["evaluate", f"{B}/run"],
    "export-backbone": ["export-backbone", f"{B}/run", f"{B}/backbone"],
    "sweep": [
        "sweep",
        f"{B}/cache/entry",
        f"{B}/sweep",
        "--epsilons",
        "1",
        "--steps",
        "2",
        "--batch-size",
        "8",
        "--learning-rates",
        "1",
    ],
    "quickstart": ["quickstart", "--work-dir", f"{B}/qs"],
    "audit": ["audit", f"{B}/digits"],
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_gs_path_without_gcsfs_is_one_line_naming_the_extra(name, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "DATA").mkdir()  # a local path that exists, where the command also takes a gs:// one
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # import gcsfs -> ImportError, as when not installed
    monkeypatch.setitem(sys.modules, "gcsfs.core", None)
    result = CliRunner().invoke(cli, COMMANDS[name])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("dpscale: error:")]
    assert len(errors) == 1 and 'pip install "dpscale[gcp]"' in errors[0], result.output
    assert "Traceback" not in result.output
    assert not [p for p in tmp_path.rglob("*") if p.name != "DATA"]  # nothing written locally (no "gs:" dir)
