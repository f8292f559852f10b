"""The Beam graph of ``dpscale ingest``: read+decode -> group by shard -> write -> manifest.

Only wiring lives here; every per-element step is a plain function in
``data.sources``, ``data.examples`` or ``data.shards``. The graph uses neither tagged outputs
nor side inputs, so every Beam runner runs it alike (``pipelines.portable``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable
from typing import Any

import apache_beam as beam

from dpscale.data import examples as ex
from dpscale.data.raw_items import SourcePlan
from dpscale.data.shards import write_outputs, write_shard
from dpscale.pipelines import portable
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
    """One read task -> ``(tag, value)``: batches keyed by (split, shard), shape counts, rejections."""

    def __init__(self, class_names: tuple[str, ...], settings: GraphSettings) -> None:
        self.class_names = class_names
        self.settings = settings
        self.examples = beam.metrics.Metrics.counter("ingest", "examples")
        self.rejected = beam.metrics.Metrics.counter("ingest", "rejected")

    def process(self, task: Any):
        out = ex.process_task(
            task,
            self.class_names,
            validation_fraction=self.settings.validation_fraction,
            shards_per_split=self.settings.shards_per_split,
            encoding=self.settings.encoding,
            label_map=self.settings.label_map,
        )
        self.rejected.inc(len(out.rejections))
        self.examples.inc(sum(out.shape_counts.values()))
        mark(self.settings.progress_dir, len(out.rejections) + sum(out.shape_counts.values()) + out.num_excluded)
        if out.num_excluded:
            yield "excluded", out.num_excluded
        for rejection in out.rejections:
            yield "rejected", rejection.as_dict()
        for shape_count in out.shape_counts.items():
            yield "shapes", shape_count
        for batch in out.batches.items():
            yield "batches", batch


def _write_shard(group: tuple[tuple[str, int], dict[str, Iterable[Any]]], *, settings: GraphSettings, num_classes: int):
    """One shard's batches (with the majority shape) -> ``("summaries", ...)`` and ``("rejected", ...)``."""
    (split, shard), parts = group
    batches = list(parts["batches"])  # a join's values are iterables (maybe not lists): no truth value
    if not batches:  # a planned shard that no example hashed to: no file, as before
        return
    [shape] = parts["shape"]
    summary, rejected = write_shard(
        settings.output_dir,
        split,
        shard,
        settings.shards_per_split.get(split, 1),
        itertools.chain.from_iterable(batches),
        num_classes=num_classes,
        shape=shape,
    )
    for rejection in rejected:
        yield "rejected", rejection.as_dict()
    yield "summaries", summary


def _planned_shards(settings: GraphSettings) -> list[tuple[str, int]]:
    return [(split, shard) for split, n in sorted(settings.shards_per_split.items()) for shard in range(n)]


def _finish(parts: dict[str, list[Any]], **kwargs: Any) -> Any:
    """``write_outputs`` once every shard is written, from the gathered lists."""
    return write_outputs(
        None,
        summaries=parts["summaries"],
        rejections=parts["rejections"],
        image_shape=ex.majority_shape(parts["shape_counts"]),
        num_excluded=sum(parts["excluded"]),
        **kwargs,
    )


def build(pipeline: beam.Pipeline, plan: SourcePlan, settings: GraphSettings) -> None:
    """Add the ingest graph for ``plan`` to ``pipeline``.

    Work moves in per-task batches (a few hundred elements for CIFAR-10, not 60,000):
    Beam's per-element overhead in Python outweighed the decoding itself.
    """
    classes = settings.class_names if settings.class_names is not None else plan.class_names
    processed = portable.by_tag(
        pipeline
        | "Tasks" >> beam.Create(list(plan.tasks))
        | "SpreadTasks" >> beam.Reshuffle()
        | "ReadDecodeEncode" >> beam.ParDo(_ProcessTask(plan.class_names, settings)),
        ("batches", "rejected", "shapes", "excluded"),
        label="Processed",
    )
    shape_counts = processed["shapes"] | "SumShapes" >> beam.CombinePerKey(sum)
    # the majority shape, handed to every planned shard (a shard's group waits for it)
    majority = (
        shape_counts
        | "KeyShapes" >> beam.Map(lambda sc: (None, sc))
        | "AllShapes" >> beam.GroupByKey()
        | "Majority" >> beam.Map(lambda kv: ex.majority_shape(list(kv[1])))
    )
    shard_shape = portable.broadcast(majority, lambda _: _planned_shards(settings), label="ShapePerShard")
    written = portable.by_tag(
        {"batches": processed["batches"], "shape": shard_shape}
        | "GroupShards" >> beam.CoGroupByKey()
        | "WriteShards" >> beam.FlatMap(_write_shard, settings=settings, num_classes=len(classes)),
        ("summaries", "rejected"),
        label="Written",
    )
    rejections = (processed["rejected"], written["rejected"]) | "AllRejections" >> beam.Flatten()
    _ = portable.gather(
        pipeline,
        {
            "summaries": written["summaries"],
            "rejections": rejections,
            "shape_counts": shape_counts,
            "excluded": processed["excluded"],
        },
        label="Finish",
    ) | "WriteManifest" >> beam.Map(
        _finish,
        output_dir=settings.output_dir,
        source=plan.spec.text,
        class_names=classes,
        validation_fraction=settings.validation_fraction,
        encoding=settings.encoding,
        num_inputs=settings.num_inputs,
        source_class_names=plan.class_names if settings.label_map is not None else None,
    )


def shards_per_split(
    split_sizes: dict[str, int], *, validation_fraction: float, examples_per_shard: int
) -> dict[str, int]:
    """Shard counts from the planned sizes (known before reading), ``validation`` included."""
    sizes = dict(split_sizes)
    if validation_fraction > 0:
        moved = int(math.ceil(sizes.get("train", 0) * validation_fraction))
        sizes["validation"] = sizes.get("validation", 0) + moved
        sizes["train"] = sizes.get("train", 0) - moved
    return {s: max(1, math.ceil(n / examples_per_shard)) for s, n in sizes.items()}
