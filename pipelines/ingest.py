"""The Beam graph of ``dpscale ingest``: read+decode -> group by shard -> write -> manifest.

Only wiring lives here; every per-element step is a plain function in
``data.sources``, ``data.examples`` or ``data.shards``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import apache_beam as beam

from dpscale.data import examples as ex
from dpscale.data.raw_items import SourcePlan
from dpscale.data.shards import write_outputs, write_shard
from dpscale.pipelines.progress import mark

SMALL_DATA = 20_000  # below this many examples one in-memory worker beats two processes


def parallel(num_examples: int) -> bool:
    """Whether two local worker processes pay off for this many inputs."""
    return num_examples >= SMALL_DATA


@dataclasses.dataclass(frozen=True)
class GraphSettings:
    """What the graph needs besides the source plan."""

    output_dir: str
    validation_fraction: float
    shards_per_split: dict[str, int]
    encoding: str
    num_inputs: int  # planned; the manifest is refused unless all are accounted for
    progress_dir: str | None = None  # local runs: where finished tasks are marked
    class_names: tuple[str, ...] | None = None  # a class filter's kept classes (None: all)
    label_map: tuple[int, ...] | None = None  # source label -> kept label, -1 = left out


class _ProcessTask(beam.DoFn):
    """One read task -> batches keyed by (split, shard), shape counts, rejections."""

    def __init__(self, class_names: tuple[str, ...], settings: GraphSettings) -> None:
        self.class_names = class_names
        self.settings = settings
        self.examples = beam.metrics.Metrics.counter("ingest", "examples")
        self.rejected = beam.metrics.Metrics.counter("ingest", "rejected")

    def process(self, task: Any):
        out = ex.process_task(task, self.class_names,
                              validation_fraction=self.settings.validation_fraction,
                              shards_per_split=self.settings.shards_per_split,
                              encoding=self.settings.encoding, label_map=self.settings.label_map)
        self.rejected.inc(len(out.rejections))
        self.examples.inc(sum(out.shape_counts.values()))
        mark(self.settings.progress_dir,
             len(out.rejections) + sum(out.shape_counts.values()) + out.num_excluded)
        if out.num_excluded:
            yield beam.pvalue.TaggedOutput("excluded", out.num_excluded)
        for rejection in out.rejections:
            yield beam.pvalue.TaggedOutput("rejected", rejection.as_dict())
        for shape_count in out.shape_counts.items():
            yield beam.pvalue.TaggedOutput("shapes", shape_count)
        yield from out.batches.items()


def _write_shard(group: tuple[tuple[str, int], Any], shape: Any, *,
                 settings: GraphSettings, num_classes: int):
    (split, shard), batches = group
    summary, rejected = write_shard(
        settings.output_dir, split, shard, settings.shards_per_split.get(split, 1),
        itertools.chain.from_iterable(batches), num_classes=num_classes, shape=shape)
    for rejection in rejected:
        yield beam.pvalue.TaggedOutput("rejected", rejection.as_dict())
    yield summary


def build(pipeline: beam.Pipeline, plan: SourcePlan, settings: GraphSettings) -> None:
    """Add the ingest graph for ``plan`` to ``pipeline``.

    Work moves in per-task batches (a few hundred elements for CIFAR-10, not 60,000):
    Beam's per-element overhead in Python outweighed the decoding itself.
    """
    classes = settings.class_names if settings.class_names is not None else plan.class_names
    processed = (pipeline
                 | "Tasks" >> beam.Create(list(plan.tasks))
                 | "SpreadTasks" >> beam.Reshuffle()
                 | "ReadDecodeEncode" >> beam.ParDo(_ProcessTask(plan.class_names, settings))
                                             .with_outputs("rejected", "shapes", "excluded",
                                                           main="batches"))
    excluded = processed.excluded | "CountExcluded" >> beam.CombineGlobally(sum)
    shape = (processed.shapes
             | "SumShapes" >> beam.CombinePerKey(sum)
             | "ShapeList" >> beam.combiners.ToList()
             | "Majority" >> beam.Map(ex.majority_shape))
    written = (processed.batches
               | "GroupShards" >> beam.GroupByKey()
               | "WriteShards" >> beam.FlatMap(
                   _write_shard, beam.pvalue.AsSingleton(shape), settings=settings,
                   num_classes=len(classes)).with_outputs("rejected", main="summaries"))
    summaries = written.summaries | "SummaryList" >> beam.combiners.ToList()
    rejections = ((processed.rejected, written.rejected)
                  | "AllRejections" >> beam.Flatten()
                  | "RejectionList" >> beam.combiners.ToList())
    _ = (pipeline
         | "Finish" >> beam.Create([None])
         | "WriteManifest" >> beam.Map(
             write_outputs, output_dir=settings.output_dir,
             summaries=beam.pvalue.AsSingleton(summaries),
             rejections=beam.pvalue.AsSingleton(rejections),
             image_shape=beam.pvalue.AsSingleton(shape),
             source=plan.spec.text, class_names=classes,
             validation_fraction=settings.validation_fraction, encoding=settings.encoding,
             num_inputs=settings.num_inputs, num_excluded=beam.pvalue.AsSingleton(excluded),
             source_class_names=plan.class_names if settings.label_map is not None else None))


def shards_per_split(split_sizes: dict[str, int], *, validation_fraction: float,
                     examples_per_shard: int) -> dict[str, int]:
    """Shard counts from the planned sizes (known before reading), ``validation`` included."""
    sizes = dict(split_sizes)
    if validation_fraction > 0:
        moved = int(math.ceil(sizes.get("train", 0) * validation_fraction))
        sizes["validation"] = sizes.get("validation", 0) + moved
        sizes["train"] = sizes.get("train", 0) - moved
    return {s: max(1, math.ceil(n / examples_per_shard)) for s, n in sizes.items()}
