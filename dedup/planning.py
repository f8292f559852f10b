"""How dedup cuts its work: which splits, which index ranges, which blocks meet.

Planning runs once where the pipeline is launched, from the manifests alone (no image is
read): read tasks never straddle a public shard, so each shard's removals can be written
by one worker; nearest-neighbour tasks pair one private task with a group of public tasks
of about ``PUBLIC_PER_KNN_TASK`` images, so a task's memory is bounded and their number
grows with (private images x public images) / (block sizes): the blocking a cluster
spreads over its workers.
"""

from __future__ import annotations

from collections.abc import Sequence

from dpscale.data.dataset import IngestedDataset
from dpscale.dedup.join import PRIVATE, PUBLIC, ReadTask

PUBLIC_PER_KNN_TASK = 25_000  # public images one nearest-neighbour task searches


def select_splits(dataset: IngestedDataset, wanted: Sequence[str]) -> list[str]:
    """``wanted`` (all when empty), each checked to exist."""
    for split in wanted:
        dataset.num_examples(split)  # DataError naming the splits it has
    return list(wanted) or dataset.splits


def read_tasks(dataset: IngestedDataset, side: str, per_task: int,
               splits: Sequence[str]) -> list[ReadTask]:
    """Index ranges of ``splits``, never straddling a shard (public tasks know theirs)."""
    tasks = []
    for split in splits:
        start = 0
        for shard, entry in enumerate(dataset.manifest.splits[split].shards):
            stop = start + entry.num_examples
            tasks += [ReadTask(side, split, s, min(s + per_task, stop), shard)
                      for s in range(start, stop, per_task)]
            start = stop
    return tasks


def shard_ranges(dataset: IngestedDataset,
                 splits: Sequence[str]) -> dict[tuple[str, int], tuple[int, int, int]]:
    """(split, shard) -> (first index, end index, number of shards in the split)."""
    ranges = {}
    for split in splits:
        entries = dataset.manifest.splits[split].shards
        start = 0
        for shard, entry in enumerate(entries):
            ranges[(split, shard)] = (start, start + entry.num_examples, len(entries))
            start += entry.num_examples
    return ranges


def knn_tasks(tasks: Sequence[ReadTask],
              public_per_task: int = PUBLIC_PER_KNN_TASK) -> list[tuple[ReadTask, tuple[ReadTask, ...]]]:
    """Every private task paired with every group of consecutive public tasks."""
    private = [t for t in tasks if t.side == PRIVATE]
    groups: list[list[ReadTask]] = [[]]
    size = 0
    for t in (t for t in tasks if t.side == PUBLIC):
        if groups[-1] and size + t.stop - t.start > public_per_task:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.stop - t.start
    return [(p, tuple(g)) for p in private for g in groups if g]
