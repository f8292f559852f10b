"""Where images come from: parse a source string, plan the reading work, read it.

A source string names one of four kinds of input:

- ``tfds:NAME[:SPLIT]``  a TFDS builder, read through ``tfds.data_source`` (array_record,
  no TensorFlow needed);
- ``folder:PATH``        ``PATH/<split>/<class>/*`` or ``PATH/<class>/*`` (one split,
  ``train``), or a ``.tar.gz``/``.tgz``/``.tar`` archive of that layout;
- ``idx:DIR``            MNIST-format IDX files (``train-images-idx3-ubyte[.gz]``, ...);
- ``digits``             scikit-learn's bundled 8x8 digits, with a 20% test split carved by
  content hash (the set ships without one).

Each kind lives in its own module: ``data.folder_source`` (folders and tar archives) and
``data.array_sources`` (IDX, TFDS, digits); the types they share are in ``data.raw_items``.

Planning happens once, on the machine that launches the pipeline: it checks the input
exists, finds the class names and cuts the input into small picklable ``ReadTask``s.
``read_task`` runs on the workers and yields ``RawItem``s, still undecoded for files so
that decoding (and its failures) happen in one place, ``data.examples``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from dpscale.data import array_sources, folder_source
from dpscale.data.raw_items import RawItem, ReadTask, SourcePlan, SourceSpec
from dpscale.errors import DataError, InvalidConfigError


def parse_source(text: str) -> SourceSpec:
    """Parse ``tfds:NAME[:SPLIT]``, ``folder:PATH``, ``idx:DIR`` or ``digits``."""
    kind, _, rest = text.partition(":")
    if kind == "digits" and not rest:
        return SourceSpec("digits", text=text)
    if kind == "tfds" and rest:
        name, _, split = rest.partition(":")
        return SourceSpec("tfds", name, split or None, text=text)
    if kind in ("folder", "idx") and rest:
        return SourceSpec(kind, rest, text=text)
    raise InvalidConfigError(
        f"unknown source {text!r}; expected tfds:NAME[:SPLIT], folder:PATH, idx:DIR or digits")


def plan_source(spec: SourceSpec, *, chunk_size: int = 2048,
                tfds_data_dir: str | None = None) -> SourcePlan:
    """Check the source exists and cut it into ``ReadTask``s of about ``chunk_size`` items."""
    if spec.kind == "folder":
        return folder_source.plan_folder(spec, chunk_size)
    if spec.kind == "idx":
        return array_sources.plan_idx(spec, chunk_size)
    if spec.kind == "tfds":
        return array_sources.plan_tfds(spec, chunk_size, tfds_data_dir)
    return array_sources.plan_digits(spec)


def select_classes(class_names: Sequence[str],
                   wanted: Sequence[str]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A class filter: ``(kept names, label map)`` for keeping only the ``wanted`` classes.

    Kept classes stay in the source's order (so ``3,4`` and ``4,3`` give the same data)
    and are relabelled ``0..k-1``; ``label_map[source label]`` is the new label, or -1
    for a class that is left out.
    """
    unknown = [name for name in wanted if name not in class_names]
    if unknown:
        raise DataError(f"class(es) {', '.join(map(repr, unknown))} not in the source; "
                        f"it has {', '.join(class_names)}")
    keep = set(wanted)
    kept = tuple(name for name in class_names if name in keep)
    new = {name: i for i, name in enumerate(kept)}
    return kept, tuple(new.get(name, -1) for name in class_names)


def read_task(task: ReadTask, class_names: Sequence[str]) -> Iterator[RawItem]:
    """Yield the raw items of one task (runs on a Beam worker)."""
    index = {name: i for i, name in enumerate(class_names)}
    if task.kind in ("files", "tar"):
        yield from folder_source.read_files(task, index)
    elif task.kind == "idx":
        yield from array_sources.read_idx(task, len(class_names))
    elif task.kind == "tfds":
        yield from array_sources.read_tfds(task, len(class_names))
    elif task.kind == "digits":
        yield from array_sources.read_digits()
    else:
        raise ValueError(f"unknown task kind {task.kind!r}")
