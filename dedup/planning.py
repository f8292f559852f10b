"""How dedup cuts its work: which splits, which index ranges, how many LSH groups.

Planning runs once where the pipeline is launched, from the manifests alone (no image is
read): read tasks never straddle a public shard, so each shard's removals can be written
by one worker; the number of partitions per band keeps every group of the bucket join
near ``GROUP_TARGET`` entries however large the data grows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dpscale.data.dataset import IngestedDataset
from dpscale.dedup.image_hash import HashConfig
from dpscale.dedup.join import ReadTask

GROUP_TARGET = 50_000  # entries per (band, partition) group the planner aims for


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


def partitions_per_band(num_public: int, num_private: int, config: HashConfig) -> int:
    """Groups per band so a group holds about GROUP_TARGET entries (>= 1)."""
    entries = num_public + num_private * config.num_views
    return max(1, math.ceil(entries / GROUP_TARGET))
