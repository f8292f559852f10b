"""The README's reproduce blocks (``<!-- reproduce: NAME -->`` then a fenced bash block) stay runnable.

A block is the whole path from raw data to the JSON line a result quotes; running one takes an hour, so
CI checks what can drift without running it: every ``dpscale`` command and flag exists, the block ends in
a test-split score (whose JSON line gives ``epsilon`` and ``test_accuracy``), and no command fixes the
secret seed (a fixed seed makes the noise reproducible, so the result would not be private).
"""

import pathlib
import re
import shlex
import shutil
import subprocess

import click
import pytest

from dpscale.cli import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- reproduce: ([\w.-]+) -->\s*```bash\n(.*?)```", re.DOTALL)


def _blocks() -> dict[str, str]:
    return dict(BLOCK.findall((ROOT / "README.md").read_text()))


def _dpscale_commands(block: str) -> list[list[str]]:
    """Each ``dpscale ...`` invocation of a block, as argv after ``dpscale`` (continuations joined)."""
    text = block.replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        for part in re.split(r"&&|\|\||;|\|", line):
            words = shlex.split(part)
            if words and words[0] == "dpscale":
                commands.append(words[1:])
    return commands


def _flags(command: click.Command) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}


def test_the_readme_has_reproduce_blocks_with_names_unique():
    markers = re.findall(r"<!-- reproduce: ([\w.-]+) -->", (ROOT / "README.md").read_text())
    assert markers and len(markers) == len(set(markers)) == len(_blocks())


@pytest.mark.parametrize("name", sorted(_blocks()))
def test_every_command_and_flag_of_a_block_exists(name):
    commands = _dpscale_commands(_blocks()[name])
    assert commands, f"block {name} runs no dpscale command"
    for argv in commands:
        command = cli.get_command(click.Context(cli), argv[0])
        assert command is not None, f"block {name}: no command `dpscale {argv[0]}`"
        for word in argv[1:]:
            if word.startswith("-"):
                flag = word.split("=", 1)[0]
                assert flag in _flags(command), f"block {name}: `dpscale {argv[0]}` has no flag {flag}"


@pytest.mark.parametrize("name", sorted(_blocks()))
def test_a_block_ends_in_a_private_test_score(name):
    commands = _dpscale_commands(_blocks()[name])
    assert commands[-1][0] == "evaluate", f"block {name} must end with `dpscale evaluate` (its test_accuracy)"
    assert "--split" not in commands[-1] and "--private-diagnostics" not in commands[-1]
    for argv in commands:
        assert "--seed" not in argv, f"block {name}: `dpscale {argv[0]}` fixes the secret seed"
        assert "--sampling" not in argv, f"block {name}: the accountant assumes the default Poisson sampling"


def test_the_block_parser_sees_every_command():
    block = "apt-get install x\ndpscale ingest a b && dpscale train a r \\\n  --steps 3  # comment --seed 1\n"
    assert _dpscale_commands(block) == [["ingest", "a", "b"], ["train", "a", "r", "--steps", "3"]]


def _system_installs(block: str) -> str:
    """A block's lines up to its last that installs system packages (apt-get), to run as they are written."""
    lines = block.splitlines()
    last = max((i for i, line in enumerate(lines) if "apt-get" in line), default=-1)
    return "\n".join(lines[: last + 1])


@pytest.mark.parametrize("name", sorted(n for n, b in _blocks().items() if _system_installs(b)))
@pytest.mark.parametrize("as_root", [True, False], ids=["root-without-sudo", "user-with-sudo"])
def test_a_blocks_system_install_runs_as_root_and_as_a_user(name, as_root, tmp_path):
    """Root (a container, often without sudo) runs apt-get itself; a user runs it through sudo."""
    stubs, log = tmp_path / "bin", tmp_path / "calls"
    stubs.mkdir()
    scripts = {
        "id": f'[ "$1" = -u ] && echo {0 if as_root else 1000}',
        "apt-get": f'echo "${{THROUGH_SUDO:-direct}} apt-get $*" >> {log}',
    }
    if not as_root:
        scripts["sudo"] = 'THROUGH_SUDO=sudo exec "$@"'
    for command, body in scripts.items():
        (stubs / command).write_text(f"#!/bin/sh\n{body}\n")
        (stubs / command).chmod(0o755)
    done = subprocess.run(
        [shutil.which("bash"), "-euo", "pipefail", "-c", _system_installs(_blocks()[name])],
        env={"PATH": str(stubs)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    assert any(c.endswith("apt-get update") for c in calls) and any(" apt-get install -y " in c for c in calls)
    assert {c.split()[0] for c in calls} == {"direct" if as_root else "sudo"}, calls
