"""Where images come from: parse a source string, plan the reading work, read it.

A source string names one of four kinds of input:

- ``tfds:NAME[:SPLIT]``  a TFDS builder, read through ``tfds.data_source`` (array_record,
  no TensorFlow needed);
- ``folder:PATH``        ``PATH/<split>/<class>/*`` or ``PATH/<class>/*`` (one split,
  ``train``), or a ``.tar.gz``/``.tgz``/``.tar`` archive of that layout;
- ``idx:DIR``            MNIST-format IDX files (``train-images-idx3-ubyte[.gz]``, ...);
- ``digits``             scikit-learn's bundled 8x8 digits, with a 20% test split carved by
  content hash (the set ships without one).

Each kind lives in its own module, which describes it as a ``SourceKind`` (syntax, parse,
plan, read): ``data.folder_source`` (folders and tar archives) and ``data.array_sources``
(IDX, TFDS, digits); the types they share are in ``data.raw_items``. ``SOURCE_KINDS`` below
lists them, and parsing, planning and reading look the kind up there. A new kind is one
``SourceKind`` added to that table.

Planning happens once, on the machine that launches the pipeline: it checks the input
exists, finds the class names and cuts the input into small picklable ``ReadTask``s.
``read_task`` runs on the workers and yields ``RawItem``s, still undecoded for files so
that decoding (and its failures) happen in one place, ``data.examples``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from dpscale.data import array_sources, folder_source
from dpscale.data.raw_items import PlanOptions, RawItem, ReadTask, SourceKind, SourcePlan, SourceSpec
from dpscale.errors import DataError, InvalidConfigError

#: Every kind of source, in the order the error for an unknown source lists them.
SOURCE_KINDS: tuple[SourceKind, ...] = (
    array_sources.TFDS,
    folder_source.FOLDER,
    array_sources.IDX,
    array_sources.DIGITS,
)
_BY_NAME = {kind.name: kind for kind in SOURCE_KINDS}
_BY_TASK_KIND = {task_kind: kind for kind in SOURCE_KINDS for task_kind in kind.task_kinds}


def _expected() -> str:
    """``a, b, c or d``: the syntax of every kind."""
    syntaxes = [kind.syntax for kind in SOURCE_KINDS]
    return f"{', '.join(syntaxes[:-1])} or {syntaxes[-1]}"


def parse_source(text: str) -> SourceSpec:
    """Parse a source string: ``tfds:NAME[:SPLIT]``, ``folder:PATH``, ``idx:DIR`` or ``digits``."""
    name, _, rest = text.partition(":")
    kind = _BY_NAME.get(name)
    parsed = kind.parse(rest) if kind is not None else None
    if parsed is None:
        raise InvalidConfigError(f"unknown source {text!r}; expected {_expected()}")
    location, split = parsed
    return SourceSpec(kind.name, location, split, text=text)


def plan_source(spec: SourceSpec, *, chunk_size: int = 2048, tfds_data_dir: str | None = None) -> SourcePlan:
    """Check the source exists and cut it into ``ReadTask``s of about ``chunk_size`` items."""
    if spec.kind not in _BY_NAME:
        raise InvalidConfigError(f"unknown source kind {spec.kind!r}; expected {_expected()}")
    return _BY_NAME[spec.kind].plan(spec, PlanOptions(chunk_size=chunk_size, tfds_data_dir=tfds_data_dir))


def select_classes(class_names: Sequence[str], wanted: Sequence[str]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A class filter: ``(kept names, label map)`` for keeping only the ``wanted`` classes.

    Kept classes stay in the source's order (so ``3,4`` and ``4,3`` give the same data)
    and are relabelled ``0..k-1``; ``label_map[source label]`` is the new label, or -1
    for a class that is left out.
    """
    unknown = [name for name in wanted if name not in class_names]
    if unknown:
        raise DataError(f"class(es) {', '.join(map(repr, unknown))} not in the source; it has {', '.join(class_names)}")
    keep = set(wanted)
    kept = tuple(name for name in class_names if name in keep)
    new = {name: i for i, name in enumerate(kept)}
    return kept, tuple(new.get(name, -1) for name in class_names)


def read_task(task: ReadTask, class_names: Sequence[str]) -> Iterator[RawItem]:
    """Yield the raw items of one task (runs on a Beam worker)."""
    if task.kind not in _BY_TASK_KIND:
        raise ValueError(f"unknown task kind {task.kind!r}")
    yield from _BY_TASK_KIND[task.kind].read(task, class_names)
