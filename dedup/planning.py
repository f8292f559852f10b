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
PRIVATE_PER_VERIFY_TASK = 256  # private images whose candidates one verification task checks


def select_splits(dataset: IngestedDataset, wanted: Sequence[str]) -> list[str]:
    """``wanted`` (all when empty), each checked to exist."""
    for split in wanted:
        dataset.num_examples(split)  # DataError naming the splits it has
    return list(wanted) or dataset.splits


def read_tasks(dataset: IngestedDataset, side: str, per_task: int, splits: Sequence[str]) -> list[ReadTask]:
    """Index ranges of ``splits``, never straddling a shard (public tasks know theirs)."""
    tasks = []
    for split in splits:
        start = 0
        for shard, entry in enumerate(dataset.manifest.splits[split].shards):
            stop = start + entry.num_examples
            tasks += [ReadTask(side, split, s, min(s + per_task, stop), shard) for s in range(start, stop, per_task)]
            start = stop
    return tasks


def shard_ranges(dataset: IngestedDataset, splits: Sequence[str]) -> dict[tuple[str, int], tuple[int, int, int]]:
    """(split, shard) -> (first index, end index, number of shards in the split)."""
    ranges = {}
    for split in splits:
        entries = dataset.manifest.splits[split].shards
        start = 0
        for shard, entry in enumerate(entries):
            ranges[(split, shard)] = (start, start + entry.num_examples, len(entries))
            start += entry.num_examples
    return ranges


def knn_tasks(
    tasks: Sequence[ReadTask], public_per_task: int = PUBLIC_PER_KNN_TASK
) -> list[tuple[ReadTask, tuple[ReadTask, ...]]]:
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


def public_positions(tasks: Sequence[ReadTask]) -> dict[str, int]:
    """Public task name -> its first row in the concatenation of all public tasks.

    The neighbour search reports progress as (private rows x public rows searched) / public
    rows; cumulative positions make each private task's marks add up to its rows exactly.
    """
    positions, start = {}, 0
    for t in (t for t in tasks if t.side == PUBLIC):
        positions[t.name] = start
        start += t.stop - t.start
    return positions


def verify_blocks(
    dataset: IngestedDataset, splits: Sequence[str], per_block: int = PRIVATE_PER_VERIFY_TASK
) -> list[tuple[tuple[str, int], int]]:
    """((split, block), private images in it) for every block of ``per_block`` private images.

    Verification runs one task per block, including blocks without candidates, so its
    progress counts planned images only: how many candidates there are (a count computed
    from the private data) never shows on the progress bar.
    """
    blocks = []
    for split in splits:
        n = dataset.num_examples(split)
        blocks += [((split, b), min(per_block, n - b * per_block)) for b in range(-(-n // per_block))]
    return blocks
