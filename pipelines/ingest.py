"""The Beam graph of ``dpscale ingest``: read -> decode -> validate -> shard -> manifest.

Only wiring lives here; every per-element step is a plain function in
``stages.sources``, ``stages.examples`` or ``stages.shards``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import apache_beam as beam
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions

from dpscale.stages import examples as ex
from dpscale.stages.shards import write_outputs, write_shard
from dpscale.stages.sources import SourcePlan, read_task

DEFAULT_RUNNER = "FnApiRunner"
SMALL_DATA = 20_000  # below this many examples one in-memory worker beats two processes


def pipeline_options(args: tuple[str, ...] | list[str], *,
                     estimated_examples: int) -> PipelineOptions:
    """Beam options from command-line style ``args``; local defaults only fill gaps.

    Without ``--runner`` this is the local engine behind Beam's DirectRunner
    (``FnApiRunner``; naming it directly skips DirectRunner's attempt to fetch the Prism
    binary from the internet on every run) on both cores for large inputs
    (multi-processing) and one in-memory worker for small ones, where process start-up
    and pickling cost more than they save. Anything given explicitly wins.
    """
    options = PipelineOptions(list(args))
    standard = options.view_as(StandardOptions)
    if standard.runner is None:
        standard.runner = DEFAULT_RUNNER
    if standard.runner.lower() in ("directrunner", "direct", "fnapirunner"):
        direct = options.view_as(DirectOptions)
        given = " ".join(args)
        if "direct_num_workers" not in given:
            direct.direct_num_workers = 1 if estimated_examples < SMALL_DATA else 2
        if "direct_running_mode" not in given:
            direct.direct_running_mode = ("in_memory" if direct.direct_num_workers == 1
                                          else "multi_processing")
    return options


@dataclasses.dataclass(frozen=True)
class GraphSettings:
    """What the graph needs besides the source plan."""

    output_dir: str
    validation_fraction: float
    shards_per_split: dict[str, int]
    encoding: str
    num_inputs: int  # planned; the manifest is refused unless all are accounted for


class _Decode(beam.DoFn):
    """Raw item -> Example (main output) or Rejection (tagged ``rejected``)."""

    def __init__(self) -> None:
        self.decoded = beam.metrics.Metrics.counter("ingest", "decoded")
        self.rejected = beam.metrics.Metrics.counter("ingest", "rejected")

    def process(self, item: Any):
        result = ex.to_example(item)
        if isinstance(result, ex.Rejection):
            self.rejected.inc()
            yield beam.pvalue.TaggedOutput("rejected", result.as_dict())
        else:
            self.decoded.inc()
            yield result


def _check_shape(example: ex.Example, shape: Any):
    result = ex.check_shape(example, shape)
    if isinstance(result, ex.Rejection):
        yield beam.pvalue.TaggedOutput("rejected", result.as_dict())
    else:
        yield result


def build(pipeline: beam.Pipeline, plan: SourcePlan, settings: GraphSettings) -> None:
    """Add the ingest graph for ``plan`` to ``pipeline``."""
    classes = plan.class_names
    raw = (pipeline
           | "Tasks" >> beam.Create(list(plan.tasks))
           | "SpreadTasks" >> beam.Reshuffle()
           | "Read" >> beam.FlatMap(read_task, classes)
           | "SpreadItems" >> beam.Reshuffle())
    decoded = raw | "Decode" >> beam.ParDo(_Decode()).with_outputs("rejected", main="ok")

    shape = (decoded.ok
             | "Shape" >> beam.Map(lambda e: tuple(e.image.shape))
             | "CountShapes" >> beam.combiners.Count.PerElement()
             | "ShapeList" >> beam.combiners.ToList()
             | "Majority" >> beam.Map(ex.majority_shape))
    checked = (decoded.ok
               | "CheckShape" >> beam.FlatMap(_check_shape, beam.pvalue.AsSingleton(shape))
                                     .with_outputs("rejected", main="ok"))

    shards = settings.shards_per_split
    summaries = (checked.ok
                 | "Validation" >> beam.Map(ex.assign_validation,
                                            settings.validation_fraction)
                 | "KeyByShard" >> beam.Map(
                     lambda e: ((e.split, ex.shard_index(e, shards.get(e.split, 1))), e))
                 | "GroupShards" >> beam.GroupByKey()
                 | "WriteShards" >> beam.MapTuple(
                     lambda key, items: write_shard(
                         settings.output_dir, key[0], key[1], shards.get(key[0], 1), items,
                         num_classes=len(classes), encoding=settings.encoding))
                 | "SummaryList" >> beam.combiners.ToList())
    rejections = ((decoded.rejected, checked.rejected)
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
             num_inputs=settings.num_inputs))


def shards_per_split(split_sizes: dict[str, int], *, validation_fraction: float,
                     examples_per_shard: int) -> dict[str, int]:
    """Shard counts from the planned sizes (known before reading), ``validation`` included."""
    sizes = dict(split_sizes)
    if validation_fraction > 0:
        moved = int(math.ceil(sizes.get("train", 0) * validation_fraction))
        sizes["validation"] = sizes.get("validation", 0) + moved
        sizes["train"] = sizes.get("train", 0) - moved
    return {s: max(1, math.ceil(n / examples_per_shard)) for s, n in sizes.items()}
