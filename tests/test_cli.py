"""The command line starts fast where a command needs no model: `--help`, `models` and the privacy tools
import neither JAX, Flax, optax nor Beam (`dpscale models` took 12.7 s on a loaded machine to print a table).

Imports are counted, not timed: a fresh interpreter runs the command and reports ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("jax", "flax", "optax", "apache_beam", "orbax", "tensorflow_datasets", "zarr")
RUN_AND_LIST = """
import json, sys
from dpscale.cli import cli
try:
    cli(sys.argv[1:], prog_name="dpscale")
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}), file=sys.stderr)
"""


def _imported(*args: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", RUN_AND_LIST, *args], capture_output=True, text=True, timeout=300)
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report["code"] in (0, None), done.stderr
    return {name.split(".")[0] for name in report["modules"]}


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["models"],
        ["models", "--json"],
        ["epsilon", "--noise-multiplier", "1", "--steps", "100", "--batch-size", "100", "--num-examples", "10000"],
        [
            "calibrate",
            "--epsilon",
            "8",
            "--num-examples",
            "10000",
            "--batch-size",
            "100",
            "--steps",
            "100",
            "--accountant",
            "rdp",
        ],
    ],
    ids=" ".join,
)
def test_commands_that_need_no_model_import_no_jax_and_no_beam(args):
    heavy = _imported(*args) & set(HEAVY)
    assert not heavy, f"`dpscale {' '.join(args)}` imported {sorted(heavy)}"


def test_the_check_sees_a_command_that_does_import_jax():
    """The check can fail: `train --help` lists choices read from the train stage, which imports JAX."""
    assert "jax" in _imported("train", "--help")
