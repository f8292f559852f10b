"""The Beam graph of ``dpscale dedup``.

    read tasks -> signatures keyed by (LSH band, partition)  [public and private]
      -> CoGroupByKey -> exact distance on candidates -> closest private match per public
      -> CoGroupByKey with the public shards -> filtered shards -> report + manifest

Only wiring lives here; the per-element work is in ``dedup.join`` and ``dedup.output``.
Matches are grouped by public shard, so each shard writer sees only its own removals (no
side input that grows with the data).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import apache_beam as beam

from dpscale.dedup import join, output
from dpscale.dedup.image_hash import HashConfig
from dpscale.pipelines.ingest import SMALL_DATA
from dpscale.pipelines.progress import mark


def parallel(num_public: int, num_private: int) -> bool:
    """Whether two local worker processes pay off (a private image's views cost about 10 public images)."""
    return num_public + num_private * 10 >= SMALL_DATA


@dataclasses.dataclass(frozen=True)
class GraphSettings:
    public: str
    private: str
    output_dir: str
    hash_config: HashConfig
    tasks: tuple[join.ReadTask, ...]
    shard_ranges: dict[tuple[str, int], tuple[int, int, int]]
    num_public: int
    num_private: int
    num_classes: int
    image_shape: tuple[int, ...]
    partitions: int
    progress_dir: str | None = None


class _Signatures(beam.DoFn):
    """A read task -> ((band, partition), Entries) for its side."""

    def __init__(self, settings: GraphSettings) -> None:
        self.settings = settings
        self.datasets: dict[str, Any] = {}

    def setup(self) -> None:
        from dpscale.data.dataset import IngestedDataset

        self.datasets = {join.PUBLIC: IngestedDataset(self.settings.public),
                         join.PRIVATE: IngestedDataset(self.settings.private)}

    def process(self, task: join.ReadTask):
        s = self.settings
        for key, entries in join.signature_entries(task, self.datasets[task.side],
                                                   s.hash_config, partitions=s.partitions):
            yield beam.pvalue.TaggedOutput(task.side, (key, entries))
        mark(s.progress_dir, task.stop - task.start)

    def teardown(self) -> None:
        for ds in self.datasets.values():
            ds.close()


def _join(group: tuple[Any, dict[str, list[join.Entries]]], *, threshold: float):
    _, sides = group
    for side in (join.PUBLIC, join.PRIVATE):  # counted, so a lossy runner cannot pass
        rows = sum(len(e.index) for e in sides[side])
        yield beam.pvalue.TaggedOutput("received", (side, rows))
    matches, candidates = join.join_group(sides[join.PUBLIC], sides[join.PRIVATE],
                                          threshold=threshold)
    yield beam.pvalue.TaggedOutput("candidates", candidates)
    for m in matches:
        yield (m.public_split, m.public_index, m.private_split, m.private_index), m


class _Verify(beam.DoFn):
    """Best view of each (public, private) pair -> the pair if the fine check agrees."""

    def __init__(self, settings: GraphSettings) -> None:
        self.settings = settings
        self.datasets: tuple[Any, ...] = ()
        self.rejected = beam.metrics.Metrics.counter("dedup", "rejected_by_verification")

    def setup(self) -> None:
        from dpscale.data.dataset import IngestedDataset

        self.datasets = (IngestedDataset(self.settings.public),
                         IngestedDataset(self.settings.private))

    def process(self, match: join.Match):
        checked = join.verify(match, *self.datasets, self.settings.hash_config)
        if checked is None:
            self.rejected.inc()
            yield beam.pvalue.TaggedOutput("rejected", 1)
            return
        yield (checked.public_split, checked.public_index), checked

    def teardown(self) -> None:
        for ds in self.datasets:
            ds.close()


def _filter_shard(group: tuple[tuple[str, int], dict[str, list[Any]]], *,
                  settings: GraphSettings):
    (split, shard), parts = group
    if not parts["shard"]:  # a match for a shard we did not plan: a bug, not data
        raise RuntimeError(f"match for unknown public shard {split}/{shard}")
    summary, removed = output.filter_shard(
        settings.public, settings.output_dir, split, shard,
        settings.shard_ranges[(split, shard)], parts["matches"],
        num_classes=settings.num_classes, shape=settings.image_shape)
    for r in removed:
        yield beam.pvalue.TaggedOutput("removed", r)
    yield summary


def build(pipeline: beam.Pipeline, settings: GraphSettings) -> None:
    """Add the dedup graph to ``pipeline``."""
    signatures = (pipeline
                  | "Tasks" >> beam.Create(list(settings.tasks))
                  | "SpreadTasks" >> beam.Reshuffle()
                  | "Signatures" >> beam.ParDo(_Signatures(settings))
                                        .with_outputs(join.PUBLIC, join.PRIVATE))
    joined = ({join.PUBLIC: signatures[join.PUBLIC], join.PRIVATE: signatures[join.PRIVATE]}
              | "GroupBuckets" >> beam.CoGroupByKey()
              | "ExactDistance" >> beam.FlatMap(_join, threshold=settings.hash_config.threshold)
                                       .with_outputs("candidates", "received", main="pairs"))
    verified = (joined.pairs
                | "BestViewPerPair" >> beam.CombinePerKey(join.closest)
                | "PairMatches" >> beam.Values()
                | "Verify" >> beam.ParDo(_Verify(settings)).with_outputs("rejected",
                                                                        main="matches"))
    closest = (verified.matches
               | "ClosestPrivate" >> beam.CombinePerKey(join.closest)
               | "ByShard" >> beam.Map(lambda kv: ((kv[1].public_split, kv[1].public_shard),
                                                   kv[1])))
    shard_keys = (pipeline
                  | "Shards" >> beam.Create([(k, None) for k in sorted(settings.shard_ranges)]))
    written = ({"shard": shard_keys, "matches": closest}
               | "GroupShard" >> beam.CoGroupByKey()
               | "WriteShards" >> beam.FlatMap(_filter_shard, settings=settings)
                                      .with_outputs("removed", main="summaries"))
    candidates = joined.candidates | "CountCandidates" >> beam.CombineGlobally(sum)
    rejected = verified.rejected | "CountRejected" >> beam.CombineGlobally(sum)
    received = joined.received | "CountReceived" >> beam.CombinePerKey(sum)
    _ = (pipeline
         | "Finish" >> beam.Create([None])
         | "WriteReport" >> beam.Map(
             output.write_outputs, public_path=settings.public, private_path=settings.private,
             output_dir=settings.output_dir,
             summaries=beam.pvalue.AsList(written.summaries),
             removed=beam.pvalue.AsList(written.removed),
             matches=beam.pvalue.AsList(closest | "Matches" >> beam.Values()),
             candidates=beam.pvalue.AsSingleton(candidates),
             rejected_by_verification=beam.pvalue.AsSingleton(rejected),
             received=beam.pvalue.AsDict(received),
             config=settings.hash_config, num_public=settings.num_public,
             num_private=settings.num_private))
