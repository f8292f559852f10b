"""Every Beam graph passes Beam's own type checks with the hints its steps declare.

Beam checks each step's hints against what the step before it produces while the graph is
built (``pipeline_type_check``, on by default) and, with ``--runtime_type_check``, every element
as it runs. Since Beam 2.78 it also reads the hints of modules written with ``from __future__
import annotations`` (before, such a hint was ``Any`` and checked nothing): dedup's verification
step, hinted with lists where a ``CoGroupByKey`` gives iterables, stopped every dedup run with a
``TypeCheckError``. Here every graph is built with the checks on, and run on small data with
the runtime check on too, so a hint that no longer holds fails a test, not a user's command.
"""

from __future__ import annotations

from typing import Any

import apache_beam as beam
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from apache_beam.options.pipeline_options import TypeOptions
from apache_beam.typehints.decorators import TypeCheckError
from PIL import Image

from dpscale.data.sources import parse_source, plan_source
from dpscale.dedup.copy_decision import CopyOutcome
from dpscale.dedup.join import PRIVATE, PUBLIC, Candidate, Match, ReadTask
from dpscale.dedup.method import Method
from dpscale.dedup.planning import knn_tasks, public_positions
from dpscale.models import pretrained, registry
from dpscale.pipelines import dedup, featurize, ingest
from dpscale.pipelines.runner import pipeline_options
from dpscale.stages import dedup as dedup_stage
from dpscale.stages import featurize as featurize_stage
from dpscale.stages import ingest as ingest_stage

# every check Beam offers at construction (``all`` adds the checks of composite transforms)
CHECKED = ("--type_check_additional=all",)
# and each element against the hints as it runs, in one in-memory worker
RUNTIME_CHECKED = ("--runtime_type_check", "--direct_num_workers=1", "--direct_running_mode=in_memory")


def _checked_pipeline() -> beam.Pipeline:
    options = pipeline_options(CHECKED, parallel=False)
    types = options.view_as(TypeOptions)
    assert types.pipeline_type_check and types.type_check_additional == "all"
    return beam.Pipeline(options=options)


def _dedup_settings() -> dedup.GraphSettings:
    tasks = (ReadTask(PUBLIC, "train", 0, 10), ReadTask(PRIVATE, "test", 0, 3))
    return dedup.GraphSettings(
        public="gs://b/pub",
        private="gs://b/priv",
        output_dir="gs://b/out",
        work_dir="gs://b/out/_dedup_work",
        method=Method(),
        num_public=10,
        num_private=3,
        num_classes=2,
        image_shape=(32, 32, 3),
        tasks=tasks,
        knn_tasks=tuple(knn_tasks(tasks)),
        shard_ranges={("train", 0): (0, 10, 1)},
        public_positions=public_positions(tasks),
        verify_blocks=((("test", 0), 3),),
    )


def _copy_outcome() -> CopyOutcome:
    pair = Match(Candidate("train", 4, 0, "test", 1, 0, 0.9), 0.0, 0.0, True, copy_score=3.0)
    return CopyOutcome(accepted=(pair,), near=(), model={"path": "gs://b/copy-model"})


def _build_ingest(pipeline: beam.Pipeline) -> None:
    settings = ingest.GraphSettings(
        output_dir="gs://b/out",
        validation_fraction=0.1,
        encoding="raw",
        num_inputs=1797,
        shards_per_split={"train": 1, "test": 1, "validation": 1},
    )
    ingest.build(pipeline, plan_source(parse_source("digits")), settings)


def _build_featurize(pipeline: beam.Pipeline) -> None:
    settings = featurize.WorkerSettings(data="gs://b/data", backbone="gs://b/bb", entry="gs://b/cache/e", batch_size=8)
    featurize.build(pipeline, [("train", 0), ("test", 0)], settings)


GRAPHS = {
    "ingest": _build_ingest,
    "dedup": lambda p: dedup.build(p, _dedup_settings()),
    "dedup --copy-model": lambda p: dedup.build(p, _dedup_settings(), _copy_outcome()),
    "featurize": _build_featurize,
}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_every_graph_passes_beams_type_checks_as_it_is_built(name):
    pipeline = _checked_pipeline()
    GRAPHS[name](pipeline)  # a hint that does not hold raises TypeCheckError here
    assert pipeline.to_runner_api().components.transforms


def _takes_a_list(group: tuple[tuple[str, int], dict[str, list[Any]]]) -> int:
    return len(group[1])


def test_the_check_reads_these_modules_hints():
    """The tests above prove something only if Beam reads hints written as strings (postponed
    annotations, as in every module here): a list where CoGroupByKey gives iterables must fail."""
    if tuple(int(p) for p in beam.__version__.split(".")[:2]) < (2, 78):
        pytest.skip(f"Beam {beam.__version__} reads postponed annotations as Any (2.78 reads them)")
    pipeline = _checked_pipeline()
    blocks = pipeline | "Blocks" >> beam.Create([(("test", 0), 3)])
    candidates = pipeline | "Candidates" >> beam.Create([(("test", 0), 0.5)])
    # dedup's join: (Beam 2.78 types the values of a tag of 10 characters or more as iterables)
    grouped = {"images": blocks, "candidates": candidates} | beam.CoGroupByKey()
    with pytest.raises(TypeCheckError, match="Iterable"):
        _ = grouped | beam.Map(_takes_a_list)


def test_the_runs_below_check_every_element():
    """``RUNTIME_CHECKED`` really checks elements: a str through a step hinted int fails the run (the hint
    is given explicitly: Beam before 2.78 would read this module's annotations as Any)."""
    with pytest.raises(TypeCheckError, match="Runtime type violation"):
        with beam.Pipeline(options=pipeline_options(RUNTIME_CHECKED, parallel=False)) as pipeline:
            _ = (
                pipeline
                | beam.Create(["not an int"]).with_output_types(Any)
                | beam.Map(lambda x: x).with_input_types(int)
            )


def _smooth(seed: int) -> np.ndarray:
    low = np.random.default_rng(seed).integers(0, 256, (5, 5, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(low).resize((32, 32), Image.Resampling.BICUBIC))


def test_ingest_and_dedup_run_with_every_element_checked(tmp_path):
    """Ingest and dedup on a few images with ``--runtime_type_check``: dedup removes the two mirrored copies."""
    for split, images in [
        ("test", [_smooth(i) for i in range(4)]),
        ("train", [_smooth(100 + i) for i in range(6)] + [_smooth(0)[:, ::-1], _smooth(2)[:, ::-1]]),
    ]:
        for i, image in enumerate(images):
            path = tmp_path / "src" / split / "c" / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.ascontiguousarray(image)).save(path)
    data = str(tmp_path / "data")
    ingested = ingest_stage.run(
        ingest_stage.IngestConfig(
            f"folder:{tmp_path / 'src'}", data, examples_per_shard=4, pipeline_args=RUNTIME_CHECKED
        )
    )
    assert ingested.num_examples == {"test": 4, "train": 8}
    done = dedup_stage.run(
        dedup_stage.DedupConfig(
            data,
            data,
            str(tmp_path / "deduped"),
            public_splits=("train",),
            private_splits=("test",),
            examples_per_task=3,
            pipeline_args=RUNTIME_CHECKED,
        )
    )
    assert (done.num_removed, done.num_kept) == (2, 6)


def test_featurize_runs_with_every_element_checked(tmp_path):
    data = str(tmp_path / "digits")
    ingest_stage.run(ingest_stage.IngestConfig("digits", data, pipeline_args=RUNTIME_CHECKED))
    model = registry.get_model("cnn-small", num_classes=10)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 12, 12, 1)))
    prep = pretrained.Preprocessing(resolution=12, mean=(8.0,), std=(4.0,))
    backbone = str(tmp_path / "backbone")
    pretrained.save_pretrained(backbone, variables, model="cnn-small", num_classes=10, preprocessing=prep)
    result = featurize_stage.run(
        featurize_stage.FeaturizeConfig(
            data, backbone, cache_dir=str(tmp_path / "cache"), chunk_rows=512, pipeline_args=RUNTIME_CHECKED
        )
    )
    assert result.chunks_computed == result.chunks_total > 1
