"""Graph pieces that every Beam runner executes alike: tagged outputs and joins without side inputs.

dpscale's graphs avoid two Beam features whose support differs between runners:

* **Multi-output ParDos** (``with_outputs`` / ``TaggedOutput``): Beam's DaskRunner puts every
  tag's elements into one bag, so each consumer of one output also receives the others.
  Here a step yields ``(tag, value)`` pairs on its one output and ``by_tag`` splits them
  with one filter per tag.
* **Side inputs** (``AsSingleton``, ``AsList``, ``AsDict``, and ``CombineGlobally``, which
  injects its default through one): the DaskRunner evaluates a side input by recomputing its
  producer inside the consuming task, once per side input, so upstream work (and its
  writes) ran several times. Here the final step of a graph joins everything it needs on one
  constant key (``gather``), a value is sent to the keys that need it by a keyed join
  (``broadcast``), and global sums are keyed combines (``total``).

Both are plain Beam (Map, FlatMap, CombinePerKey, CoGroupByKey), so the local runner and
Dataflow run them as before; on the local runner the extra filters fuse into their producer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import apache_beam as beam

_KEY = None  # the one key of a global group


def _select(element: tuple[str, Any], tag: str) -> Iterable[Any]:
    if element[0] == tag:
        yield element[1]


def by_tag(tagged: beam.PCollection, tags: Sequence[str], *, label: str) -> dict[str, beam.PCollection]:
    """Split a PCollection of ``(tag, value)`` pairs into one PCollection of values per tag."""
    return {tag: tagged | f"{label}/{tag}" >> beam.FlatMap(_select, tag) for tag in tags}


def total(values: beam.PCollection, *, label: str) -> beam.PCollection:
    """The sum of ``values`` as one element (none if ``values`` is empty: ``gather`` then sees ``[]``)."""
    return (
        values
        | f"{label}/Key" >> beam.Map(lambda v: (_KEY, v))
        | f"{label}/Sum" >> beam.CombinePerKey(sum)
        | f"{label}/Value" >> beam.Values()
    )


def count(values: beam.PCollection, *, label: str) -> beam.PCollection:
    """How many elements ``values`` has, as one element (none if it is empty)."""
    return total(values | f"{label}/One" >> beam.Map(lambda _: 1), label=label)


def gather(pipeline: beam.Pipeline, parts: dict[str, beam.PCollection], *, label: str) -> beam.PCollection:
    """One element: ``{name: [every element of parts[name]]}`` (lists in no particular order).

    The group is keyed by a constant and always exists (an element of its own makes it), so a
    part that is empty gives ``[]``; the group is complete only once every part is.
    """
    keyed = {name: pcoll | f"{label}/Key {name}" >> beam.Map(lambda v: (_KEY, v)) for name, pcoll in parts.items()}
    keyed["_start"] = pipeline | f"{label}/Start" >> beam.Create([(_KEY, None)])
    return (
        keyed
        | f"{label}/Group" >> beam.CoGroupByKey()
        | f"{label}/Lists" >> beam.Map(_lists, tuple(parts)).with_output_types(Any)
    )


def _lists(group: tuple[Any, dict[str, Iterable[Any]]], names: tuple[str, ...]) -> dict[str, list[Any]]:
    return {name: list(group[1][name]) for name in names}


def broadcast(values: beam.PCollection, keys: Callable[[Any], Iterable[Any]], *, label: str) -> beam.PCollection:
    """``(key, value)`` for each key of ``keys(value)``: a value handed to the groups that need it.

    Joined with a ``CoGroupByKey`` on those keys, a group then waits for the value (the
    barrier a side input gave) and sees it without any side input.
    """
    return values | label >> beam.FlatMap(lambda v: [(k, v) for k in keys(v)])
