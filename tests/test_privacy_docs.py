"""The privacy docs (README's "What is private", docs/privacy.md) name only flags and files that exist.

What the docs promise about each output is tested where it is made (the tests they name); this
checks that the words point at real things: a renamed flag or file cannot leave a promise behind.
"""

import fnmatch
import pathlib
import re

import click

from dpscale.cli import cli
from dpscale.dedup.output import REPORT as DEDUP_REPORT
from dpscale.training import release, sweep_report
from dpscale.training.grid import run_name
from dpscale.training.run_directory import RunDirectory
from dpscale.training.sweep_directory import BASELINE_DIR, SELECTION_DIR

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _privacy_text() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## What is private") :]
    section = section[: section.index("\n## ", 1)]
    return section + (ROOT / "docs" / "privacy.md").read_text()


def _options(group: click.Group) -> set[str]:
    found = set()
    for command in group.commands.values():
        found |= _options(command) if isinstance(command, click.Group) else set()
        for param in command.params:
            found |= {o.lstrip("-") for o in [*param.opts, *param.secondary_opts] if o.startswith("--")}
    return found


def test_every_flag_the_privacy_docs_name_exists():
    named = set(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", _privacy_text()))
    assert {"private-diagnostics", "print-private-diagnostics", "batch-capacity"} <= named
    assert named - _options(cli) == set()


def test_every_not_private_file_the_privacy_docs_name_is_one_dpscale_writes():
    run = RunDirectory("run")
    written = {
        release.DIAGNOSTICS_FILE,
        release.SIMULATION_FILE,
        BASELINE_DIR,
        SELECTION_DIR,
        DEDUP_REPORT,
        *(release.diagnostic_name(name) for name in sweep_report.TABLES),
        *(run.scores_file(split, diagnostic=True) for split in ("holdout", "train")),
        run_name((("epsilon", 1.0), ("learning_rate", 2.0)), 0, kind="simulated", simulate_batch=32),
    }
    named = set(re.findall(r"`([^`\s]*NOT-PRIVATE[^`\s]*)`", _privacy_text())) - {release.NOT_PRIVATE}
    assert {"chosen.NOT-PRIVATE.csv", "simulation.NOT-PRIVATE.json", "metrics.holdout.NOT-PRIVATE.json"} <= named
    for name in named:
        pattern = re.sub(r"<[^>]+>", "*", name.rstrip("/").rsplit("/", 1)[-1])
        assert fnmatch.filter(written, pattern), name
