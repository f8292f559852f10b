"""What an error line advises is something a user can type: ``check_advice`` holds every refusal to it.

A command quoted in an error line (```dpscale featurize DATA --backbone B --repair ENTRY```) must be
a ``dpscale`` command that parses, every flag it names one of that command's own (a quoted ``dpscale NAME``
alone only names a command: it must exist); a flag named outside
such a quote (``add --force``) must be a flag of some ``dpscale`` command. Whether running it does what
the line says is for the tests that run it (``test_error_advice``).
"""

import re
import shlex

import click

from dpscale.cli import cli

_QUOTED = re.compile(r"`([^`]*)`")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*(?![\w])")


def _flags(command: click.Command) -> set[str]:
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts) if opt.startswith("--")}


def suggested(line: str) -> list[list[str]]:
    """The ``dpscale`` commands quoted in ``line``, as words."""
    return [shlex.split(text) for text in _QUOTED.findall(line) if text.startswith("dpscale ")]


def check_advice(line: str) -> None:
    """Every command ``line`` quotes exists and parses, and every flag it names is one dpscale has."""
    for words in suggested(line):
        name, *args = words[1:]
        assert name in cli.commands, f"{line}: no command `dpscale {name}`"
        command = cli.commands[name]
        ours = args[: args.index("--")] if "--" in args else args
        unknown = [word for word in ours if word.startswith("--") and word.split("=")[0] not in _flags(command)]
        assert not unknown, f"{line}: `dpscale {name}` has no {unknown}"
        if args:  # `dpscale NAME` alone names the command; with arguments it is a command line to type
            command.make_context(name, list(args), resilient_parsing=False)  # it parses: arguments, types
    everywhere = set().union(*(_flags(command) for command in cli.commands.values()))
    outside = _QUOTED.sub("", line)
    unknown = [flag for flag in _FLAG.findall(outside) if flag not in everywhere]
    assert not unknown, f"{line}: no dpscale command has {unknown}"
