"""The Beam graph of ``dpscale dedup``.

    read tasks -> descriptors, one file per task          [public and private]
      -> (private task x public group) nearest-neighbour tasks -> top k * max_pages per private
      -> verification on the images, one task per block of private images: page 1 (ranks
         1..k) of every private image, the next page only where the last was crowded
         with accepted duplicates (``dedup.pages``)
      -> closest accepted private per public
      -> CoGroupByKey with the public shards -> filtered shards -> report + manifest

Only wiring lives here; the per-element work is in ``dedup.join`` and ``dedup.output``.
Descriptors travel through files in the run's work directory, not through Beam's data
plane, so what Beam shuffles is tasks and at most k * max_pages candidates per private image.
Matches are grouped by public shard, so each shard writer sees only its own removals.
Progress (local runs): rows described, then (private x public rows searched) / public rows,
then k per private image verified; all planned from the manifests, so the bar never shows a
count computed from the private data (such as the number of candidates).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import apache_beam as beam

from dpscale.dedup import join, output, pages, planning
from dpscale.dedup.method import Method
from dpscale.pipelines.ingest import SMALL_DATA
from dpscale.pipelines.progress import mark

if TYPE_CHECKING:  # the copy decision runs before the graph; workers need not import jax
    from dpscale.dedup.copy_decision import CopyOutcome

VERIFY_BATCH = 256  # candidates verified per call


def parallel(num_public: int, num_private: int) -> bool:
    """Whether two local worker processes pay off."""
    return num_public + num_private * 10 >= SMALL_DATA


@dataclasses.dataclass(frozen=True)
class GraphSettings:
    public: str
    private: str
    output_dir: str
    work_dir: str
    method: Method
    tasks: tuple[join.ReadTask, ...]
    knn_tasks: tuple[tuple[join.ReadTask, tuple[join.ReadTask, ...]], ...]
    shard_ranges: dict[tuple[str, int], tuple[int, int, int]]
    num_public: int
    num_private: int
    num_classes: int
    image_shape: tuple[int, ...]
    #: public task name -> first row among all public rows (``planning.public_positions``)
    public_positions: dict[str, int]
    #: ((private split, block), images) for every verification block (``planning.verify_blocks``)
    verify_blocks: tuple[tuple[tuple[str, int], int], ...]
    public_splits: tuple[str, ...] = ()
    private_splits: tuple[str, ...] = ()
    progress_dir: str | None = None
    private_per_block: int = planning.PRIVATE_PER_VERIFY_TASK


def progress_total(num_public: int, num_private: int, k: int) -> int:
    """Units of local progress: describe (every image), neighbours, verification (k per private)."""
    return (num_public + num_private) + num_private + k * num_private


class _WithDatasets(beam.DoFn):
    def __init__(self, settings: GraphSettings) -> None:
        self.settings = settings
        self.datasets: dict[str, Any] = {}

    def setup(self) -> None:
        from dpscale.data.dataset import IngestedDataset

        self.datasets = {join.PUBLIC: IngestedDataset(self.settings.public),
                         join.PRIVATE: IngestedDataset(self.settings.private)}

    def teardown(self) -> None:
        for ds in self.datasets.values():
            ds.close()


class _Describe(_WithDatasets):
    """A read task -> its descriptors on disk; (side, images) counted for the report."""

    def process(self, task: join.ReadTask):
        s = self.settings
        rows = join.embed_task(task, self.datasets[task.side], s.work_dir)
        mark(s.progress_dir, rows)
        yield task.side, rows


def _knn(pair: tuple[join.ReadTask, tuple[join.ReadTask, ...]], *, settings: GraphSettings,
         _done: Any = None):
    private, public = pair
    m = settings.method
    rows, total = private.stop - private.start, max(settings.num_public, 1)

    def searched(t: join.ReadTask) -> None:
        # cumulative floors: one private task's marks over all public rows sum to its rows
        start = settings.public_positions[t.name]
        mark(settings.progress_dir, rows * (start + t.stop - t.start) // total - rows * start // total)

    for c in join.knn_task(private, public, settings.work_dir, k=m.neighbours,
                           min_similarity=m.min_similarity, searched=searched):
        yield (c.private_split, c.private_index), c


class _Verify(_WithDatasets):
    """One block of private images: verify its candidates page by page, then mark its images.

    Side outputs count what the completeness check and the report need: candidates verified,
    candidates left unverified (uncrowded pages) and private images expanded.
    """

    def process(self, group: tuple[tuple[str, int], dict[str, list[Any]]]):
        s = self.settings
        block, parts = group
        images = list(parts["images"])
        if len(images) != 1:  # a candidate outside the planned blocks: a bug, not data
            raise RuntimeError(f"verification block {block} planned {len(images)} times")
        method = s.method

        def verify(cs: list[join.Candidate]) -> list[join.Match]:
            return [m for i in range(0, len(cs), VERIFY_BATCH)
                    for m in join.verify_candidates(cs[i:i + VERIFY_BATCH], self.datasets[join.PUBLIC],
                                                    self.datasets[join.PRIVATE],
                                                    threshold=method.threshold,
                                                    refine_rejected=method.refine)]

        matches, skipped, expanded = pages.verify_by_page(
            list(parts["candidates"]), verify, k=method.k, max_pages=method.max_pages,
            crowded_fraction=method.crowded_fraction)
        for m in matches:
            if m.accepted:
                yield (m.candidate.public_split, m.candidate.public_index), m
            elif m.fine_distance <= method.threshold * method.near_factor:
                yield beam.pvalue.TaggedOutput("near", m)
        yield beam.pvalue.TaggedOutput("verified", len(matches))
        yield beam.pvalue.TaggedOutput("skipped", skipped)
        yield beam.pvalue.TaggedOutput("expanded", expanded)
        # planned (k per image), never the expanded count: that is computed from private data
        mark(s.progress_dir, method.k * images[0])


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


def _rank(c: join.Candidate) -> tuple[float, int]:
    """Order of candidates of one private image: similarity, then the lower public index."""
    return c.similarity, -c.public_index


def build(pipeline: beam.Pipeline, settings: GraphSettings, copy: CopyOutcome | None = None) -> None:
    """Add the dedup graph to ``pipeline``; ``copy``: the copy decision's pairs, removed too."""
    described = (pipeline
                 | "Tasks" >> beam.Create(list(settings.tasks))
                 | "SpreadTasks" >> beam.Reshuffle()
                 | "Describe" >> beam.ParDo(_Describe(settings)))
    described_count = described | "CountDescribed" >> beam.CombinePerKey(sum)
    # the neighbour search starts once every descriptor file exists (side input barrier)
    candidates = (pipeline
                  | "KnnTasks" >> beam.Create(list(settings.knn_tasks))
                  | "AfterDescribe" >> beam.Map(lambda t, _: t,
                                                beam.pvalue.AsDict(described_count))
                  | "SpreadKnn" >> beam.Reshuffle()
                  | "Neighbours" >> beam.FlatMap(_knn, settings=settings)
                  | "TopKPerPrivate" >> beam.combiners.Top.PerKey(settings.method.neighbours,
                                                                   key=_rank)
                  | "Candidates" >> beam.FlatMap(lambda kv: kv[1]))
    num_candidates = candidates | "CountCandidates" >> beam.combiners.Count.Globally()
    per_block = settings.private_per_block
    by_block = candidates | "ByBlock" >> beam.Map(
        lambda c: ((c.private_split, c.private_index // per_block), c))
    blocks = pipeline | "VerifyBlocks" >> beam.Create(list(settings.verify_blocks))
    verified = ({"images": blocks, "candidates": by_block}
                | "GroupBlock" >> beam.CoGroupByKey()
                | "SpreadBlocks" >> beam.Reshuffle()
                | "Verify" >> beam.ParDo(_Verify(settings)).with_outputs(
                    "verified", "skipped", "expanded", "near", main="accepted"))
    num_verified = verified.verified | "CountVerified" >> beam.CombineGlobally(sum)
    num_skipped = verified.skipped | "CountSkipped" >> beam.CombineGlobally(sum)
    num_expanded = verified.expanded | "CountExpanded" >> beam.CombineGlobally(sum)
    accepted = verified.accepted
    if copy is not None:
        copied = pipeline | "CopyMatches" >> beam.Create(
            [((m.candidate.public_split, m.candidate.public_index), m) for m in copy.accepted])
        accepted = (accepted, copied) | "WithCopyMatches" >> beam.Flatten()
    # every private image with an accepted pair, also when its public twin is credited to
    # another private image (closest() keeps one per public image)
    matched_private = (accepted
                       | "PrivateOfPair" >> beam.Map(lambda kv: (kv[1].candidate.private_split,
                                                                 kv[1].candidate.private_index))
                       | "DistinctPrivate" >> beam.Distinct())
    closest = (accepted
               | "ClosestPrivate" >> beam.CombinePerKey(join.closest)
               | "ByShard" >> beam.Map(lambda kv: ((kv[1].candidate.public_split,
                                                    kv[1].candidate.public_shard), kv[1])))
    shard_keys = (pipeline
                  | "Shards" >> beam.Create([(k, None) for k in sorted(settings.shard_ranges)]))
    written = ({"shard": shard_keys, "matches": closest}
               | "GroupShard" >> beam.CoGroupByKey()
               | "WriteShards" >> beam.FlatMap(_filter_shard, settings=settings)
                                      .with_outputs("removed", main="summaries"))
    _ = (pipeline
         | "Finish" >> beam.Create([None])
         | "WriteReport" >> beam.Map(
             output.write_outputs, public_path=settings.public, private_path=settings.private,
             output_dir=settings.output_dir,
             summaries=beam.pvalue.AsList(written.summaries),
             removed=beam.pvalue.AsList(written.removed),
             matches=beam.pvalue.AsList(closest | "Matches" >> beam.Values()),
             matched_private=beam.pvalue.AsList(matched_private),
             near=beam.pvalue.AsList(verified.near),
             described=beam.pvalue.AsDict(described_count),
             num_candidates=beam.pvalue.AsSingleton(num_candidates),
             num_verified=beam.pvalue.AsSingleton(num_verified),
             num_skipped=beam.pvalue.AsSingleton(num_skipped),
             num_expanded=beam.pvalue.AsSingleton(num_expanded),
             method=settings.method, num_public=settings.num_public,
             num_private=settings.num_private, public_splits=settings.public_splits,
             private_splits=settings.private_splits,
             copy_near=() if copy is None else copy.near,
             copy_model=None if copy is None else copy.model))
