"""The Beam graph of ``dpscale dedup``.

    read tasks -> descriptors, one file per task          [public and private]
      -> (private task x public group) nearest-neighbour tasks -> top k * max_pages per private
      -> verification on the images, one task per block of private images: page 1 (ranks
         1..k) of every private image, the next page only where the last was crowded
         with accepted duplicates (``dedup.pages``)
      -> closest accepted private per public
      -> CoGroupByKey with the public shards -> filtered shards -> report + manifest

Only wiring lives here; the per-element work is in ``dedup.join`` and ``dedup.output``. The
graph uses neither tagged outputs nor side inputs, so every Beam runner runs it alike
(``pipelines.portable``): the neighbour search waits for the descriptors through a keyed join,
and the report gathers its inputs on one key.
Descriptors travel through files in the run's work directory, not through Beam's data
plane, so what Beam shuffles is tasks and at most k * max_pages candidates per private image.
Matches are grouped by public shard, so each shard writer sees only its own removals.
Progress (local runs): rows described, then (private x public rows searched) / public rows,
then k per private image verified; all planned from the manifests, so the bar never shows a
count computed from the private data (such as the number of candidates).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import apache_beam as beam

from dpscale.dedup import join, output, pages, planning
from dpscale.dedup.method import Method
from dpscale.pipelines import portable
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


PROGRESS_LABEL = "dedup: images described + private images searched + pairs verified"


def progress_total(num_public: int, num_private: int, k: int) -> int:
    """Units of local progress (``PROGRESS_LABEL``): every image described, every private image searched
    (over all public rows), then k candidate pairs verified per private image (the planned page)."""
    return (num_public + num_private) + num_private + k * num_private


def progress_units(num_public: int, num_private: int, k: int) -> str:
    """What the bar's total is made of, for the log line that opens a run."""
    return (
        f"progress counts {progress_total(num_public, num_private, k):,} items: {num_public + num_private:,} "
        f"images described, {num_private:,} private images searched and {k * num_private:,} candidate pairs "
        f"verified ({k} per private image; pages verified where crowded are not counted)"
    )


class _WithDatasets(beam.DoFn):
    def __init__(self, settings: GraphSettings) -> None:
        self.settings = settings
        self.datasets: dict[str, Any] = {}

    def setup(self) -> None:
        from dpscale.data.dataset import IngestedDataset

        self.datasets = {
            join.PUBLIC: IngestedDataset(self.settings.public),
            join.PRIVATE: IngestedDataset(self.settings.private),
        }

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


def _knn(pair: tuple[join.ReadTask, tuple[join.ReadTask, ...]], *, settings: GraphSettings, _done: Any = None):
    private, public = pair
    m = settings.method
    rows, total = private.stop - private.start, max(settings.num_public, 1)

    def searched(t: join.ReadTask) -> None:
        # cumulative floors: one private task's marks over all public rows sum to its rows
        start = settings.public_positions[t.name]
        mark(settings.progress_dir, rows * (start + t.stop - t.start) // total - rows * start // total)

    for c in join.knn_task(
        private, public, settings.work_dir, k=m.neighbours, min_similarity=m.min_similarity, searched=searched
    ):
        yield (c.private_split, c.private_index), c


class _Verify(_WithDatasets):
    """One block of private images: verify its candidates page by page, then mark its images.

    Yields ``(tag, value)``: accepted matches keyed by public image, near misses, and the counts
    the completeness check and the report need: candidates verified, candidates left unverified
    (uncrowded pages) and private images expanded.
    """

    def process(self, group: tuple[tuple[str, int], dict[str, Iterable[Any]]]):
        s = self.settings
        block, parts = group
        images = list(parts["images"])
        if len(images) != 1:  # a candidate outside the planned blocks: a bug, not data
            raise RuntimeError(f"verification block {block} planned {len(images)} times")
        method = s.method

        def verify(cs: list[join.Candidate]) -> list[join.Match]:
            return [
                m
                for i in range(0, len(cs), VERIFY_BATCH)
                for m in join.verify_candidates(
                    cs[i : i + VERIFY_BATCH],
                    self.datasets[join.PUBLIC],
                    self.datasets[join.PRIVATE],
                    threshold=method.threshold,
                    refine_rejected=method.refine,
                )
            ]

        matches, skipped, expanded = pages.verify_by_page(
            list(parts["candidates"]),
            verify,
            k=method.k,
            max_pages=method.max_pages,
            crowded_fraction=method.crowded_fraction,
        )
        for m in matches:
            if m.accepted:
                yield "accepted", ((m.candidate.public_split, m.candidate.public_index), m)
            elif m.fine_distance <= method.threshold * method.near_factor:
                yield "near", m
        yield "verified", len(matches)
        yield "skipped", skipped
        yield "expanded", expanded
        # planned (k per image), never the expanded count: that is computed from private data
        mark(s.progress_dir, method.k * images[0])


def _filter_shard(group: tuple[tuple[str, int], dict[str, Iterable[Any]]], *, settings: GraphSettings):
    (split, shard), parts = group
    if not list(parts["shard"]):  # a match for a shard we did not plan: a bug, not data
        raise RuntimeError(f"match for unknown public shard {split}/{shard}")
    summary, removed = output.filter_shard(
        settings.public,
        settings.output_dir,
        split,
        shard,
        settings.shard_ranges[(split, shard)],
        parts["matches"],
        num_classes=settings.num_classes,
        shape=settings.image_shape,
    )
    for r in removed:
        yield "removed", r
    yield "summaries", summary


def _ready_task(group: tuple[int, dict[str, Iterable[Any]]]):
    """A neighbour task, once every descriptor file is written (its group holds the signal)."""
    _, parts = group
    tasks = list(parts["task"])
    if tasks and not list(parts["described"]):  # the join is the barrier: it cannot be missing
        raise RuntimeError("a neighbour task ran before the descriptors were written")
    yield from tasks


def _write_report(parts: dict[str, list[Any]], **kwargs: Any) -> Any:
    """``output.write_outputs`` from the gathered lists (absent counts are zero)."""
    return output.write_outputs(
        None,
        summaries=parts["summaries"],
        removed=parts["removed"],
        matches=parts["matches"],
        matched_private=parts["matched_private"],
        near=parts["near"],
        described=dict(parts["described"]),
        num_candidates=sum(parts["num_candidates"]),
        num_verified=sum(parts["num_verified"]),
        num_skipped=sum(parts["num_skipped"]),
        num_expanded=sum(parts["num_expanded"]),
        **kwargs,
    )


def _rank(c: join.Candidate) -> tuple[float, int]:
    """Order of candidates of one private image: similarity, then the lower public index."""
    return c.similarity, -c.public_index


def build(pipeline: beam.Pipeline, settings: GraphSettings, copy: CopyOutcome | None = None) -> None:
    """Add the dedup graph to ``pipeline``; ``copy``: the copy decision's pairs, removed too."""
    described = (
        pipeline
        | "Tasks" >> beam.Create(list(settings.tasks))
        | "SpreadTasks" >> beam.Reshuffle()
        | "Describe" >> beam.ParDo(_Describe(settings))
    )
    described_count = described | "CountDescribed" >> beam.CombinePerKey(sum)
    # the neighbour search starts once every descriptor file exists: each task's group waits for
    # the signal sent (after every description) to every task's key
    num_knn = len(settings.knn_tasks)
    done = portable.total(described_count | "Rows" >> beam.Values(), label="AllDescribed")
    candidates = (
        {
            "task": pipeline | "KnnTasks" >> beam.Create(list(enumerate(settings.knn_tasks))),
            "described": portable.broadcast(done, lambda _: range(num_knn), label="ToEveryKnnTask"),
        }
        | "AfterDescribe" >> beam.CoGroupByKey()
        | "ReadyTasks" >> beam.FlatMap(_ready_task)
        | "SpreadKnn" >> beam.Reshuffle()
        | "Neighbours" >> beam.FlatMap(_knn, settings=settings)
        | "TopKPerPrivate" >> beam.combiners.Top.PerKey(settings.method.neighbours, key=_rank)
        | "Candidates" >> beam.FlatMap(lambda kv: kv[1])
    )
    num_candidates = portable.count(candidates, label="CountCandidates")
    per_block = settings.private_per_block
    by_block = candidates | "ByBlock" >> beam.Map(lambda c: ((c.private_split, c.private_index // per_block), c))
    blocks = pipeline | "VerifyBlocks" >> beam.Create(list(settings.verify_blocks))
    verified = portable.by_tag(
        {"images": blocks, "candidates": by_block}
        | "GroupBlock" >> beam.CoGroupByKey()
        | "SpreadBlocks" >> beam.Reshuffle()
        | "Verify" >> beam.ParDo(_Verify(settings)),
        ("accepted", "near", "verified", "skipped", "expanded"),
        label="Verified",
    )
    num_verified = portable.total(verified["verified"], label="CountVerified")
    num_skipped = portable.total(verified["skipped"], label="CountSkipped")
    num_expanded = portable.total(verified["expanded"], label="CountExpanded")
    accepted = verified["accepted"]
    if copy is not None:
        copied = pipeline | "CopyMatches" >> beam.Create(
            [((m.candidate.public_split, m.candidate.public_index), m) for m in copy.accepted]
        )
        accepted = (accepted, copied) | "WithCopyMatches" >> beam.Flatten()
    # every private image with an accepted pair, also when its public twin is credited to
    # another private image (closest() keeps one per public image)
    matched_private = (
        accepted
        | "PrivateOfPair" >> beam.Map(lambda kv: (kv[1].candidate.private_split, kv[1].candidate.private_index))
        | "DistinctPrivate" >> beam.Distinct()
    )
    closest = (
        accepted
        | "ClosestPrivate" >> beam.CombinePerKey(join.closest)
        | "ByShard" >> beam.Map(lambda kv: ((kv[1].candidate.public_split, kv[1].candidate.public_shard), kv[1]))
    )
    shard_keys = pipeline | "Shards" >> beam.Create([(k, None) for k in sorted(settings.shard_ranges)])
    written = portable.by_tag(
        {"shard": shard_keys, "matches": closest}
        | "GroupShard" >> beam.CoGroupByKey()
        | "WriteShards" >> beam.FlatMap(_filter_shard, settings=settings),
        ("summaries", "removed"),
        label="Written",
    )
    _ = portable.gather(
        pipeline,
        {
            "summaries": written["summaries"],
            "removed": written["removed"],
            "matches": closest | "Matches" >> beam.Values(),
            "matched_private": matched_private,
            "near": verified["near"],
            "described": described_count,
            "num_candidates": num_candidates,
            "num_verified": num_verified,
            "num_skipped": num_skipped,
            "num_expanded": num_expanded,
        },
        label="Finish",
    ) | "WriteReport" >> beam.Map(
        _write_report,
        public_path=settings.public,
        private_path=settings.private,
        output_dir=settings.output_dir,
        method=settings.method,
        num_public=settings.num_public,
        num_private=settings.num_private,
        public_splits=settings.public_splits,
        private_splits=settings.private_splits,
        copy_near=() if copy is None else copy.near,
        copy_model=None if copy is None else copy.model,
    )
