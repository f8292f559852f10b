"""The ``dpscale`` command line: one thin subcommand per stage.

Every command parses its flags, builds the stage's frozen config, calls the
stage's ``run`` and prints the result. User errors (``DpscaleError`` and click's
own usage errors) become one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from dpscale.errors import DpscaleError


class _DpscaleGroup(click.Group):
    """A click group whose user errors are one line on stderr with exit code 2."""

    def main(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D401 - click API
        kwargs["standalone_mode"] = False
        try:
            super().main(*args, **kwargs)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("dpscale: aborted", err=True)
            sys.exit(130)
        except click.ClickException as exc:
            click.echo(f"dpscale: error: {exc.format_message()}", err=True)
            sys.exit(2)
        except DpscaleError as exc:
            message = " ".join(str(exc).split())
            click.echo(f"dpscale: error: {message}", err=True)
            sys.exit(2)
        sys.exit(0)


def _quiet_library_logs() -> None:
    """Keep absl/dp-accounting chatter (bisection convergence warnings) off the CLI."""
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:  # absl comes with dp-accounting; tolerate its absence
        pass
    logging.getLogger("absl").setLevel(logging.ERROR)


@click.group(cls=_DpscaleGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dpscale")
def cli() -> None:
    """dpscale: train image classifiers with differential privacy, at scale.

    Each subcommand is one stateless stage of the pipeline
    (ingest -> dedup -> featurize -> train -> evaluate), plus the privacy
    tools (epsilon, calibrate) and `quickstart`, which runs the whole path
    offline on a small embedded data set.
    """
    _quiet_library_logs()


def main() -> None:
    """Console-script entry point."""
    cli()
