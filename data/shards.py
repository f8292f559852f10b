"""Write one ArrayRecord shard and describe it, and assemble the manifest from shards.

A shard holds the examples of one split whose content hash maps to it, sorted by
(content hash, key): the same data gives byte-identical shards whatever order it was
read in, and the reader's global index (shard after shard) is stable too.

An ingested dataset directory holds::

    <split>-<shard:05d>-of-<n:05d>.array_record   records as in ``data.examples``
    manifest.json   ``data.manifest.Manifest``: source, encoding, image shape, classes,
                    content hash, splits with their shards, counts of inputs and rejections
    report.json     every input that did not become an example: split, key, reason, detail

Outputs go through ``dpscale.files``, so an output directory may be a local path or a URL
(``gs://...`` with the ``gcp`` extra). ArrayRecord's writer needs a local file, so remote
shards are written to a temporary file and then uploaded.

The shards, the manifest and the report *are* the private data (or a plain hash of it): every
local file and directory they are written to is owner-only whatever the caller's umask
(``files.owner_only``); on ``gs://`` the bucket's access control decides instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from dpscale import files
from dpscale.data.examples import Encoded, Rejection, check_shape, combine_hashes, element_hash
from dpscale.data.manifest import ClassFilter, Manifest, ShardEntry, SplitEntry
from dpscale.errors import DataError

MANIFEST = "manifest.json"
REPORT = "report.json"
WRITER_OPTIONS = "group_size:1"  # one record per chunk: cheap random access


def shard_name(split: str, shard: int, num_shards: int) -> str:
    return f"{split}-{shard:05d}-of-{num_shards:05d}.array_record"


def join(directory: str, name: str) -> str:
    return files.join(directory, name)


def is_local(path: str) -> bool:
    return not files.is_url(path)


@files.owner_only
def write_shard(
    output_dir: str,
    split: str,
    shard: int,
    num_shards: int,
    examples: Iterable[Encoded],
    *,
    num_classes: int,
    shape: Sequence[int] | None,
) -> tuple[dict[str, Any], list[Rejection]]:
    """Write one shard's examples of the majority ``shape`` (sorted); reject the others.

    Returns the shard's summary and the wrong-shape rejections.
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    kept, rejected = [], []
    for e in examples:
        checked = check_shape(e, shape)
        (rejected if isinstance(checked, Rejection) else kept).append(checked)
    kept.sort(key=lambda e: (e.digest, e.key))
    name = shard_name(split, shard, num_shards)
    target = join(output_dir, name)
    local_dir = output_dir if is_local(output_dir) else tempfile.mkdtemp()
    tmp = os.path.join(local_dir, f".{name}.{uuid.uuid4().hex}.tmp")  # retries may overlap
    writer = ArrayRecordWriter(tmp, WRITER_OPTIONS)
    counts = [0] * num_classes
    terms = []
    for example in kept:
        writer.write(example.record)
        counts[example.label] += 1
        terms.append(element_hash(split, example.label, example.digest))
    writer.close()
    if is_local(output_dir):
        os.replace(tmp, target)
    else:
        files.upload(tmp, target)
        shutil.rmtree(local_dir, ignore_errors=True)
    summary = {
        "split": split,
        "shard": shard,
        "file": name,
        "num_examples": len(kept),
        "class_counts": counts,
        "hash": combine_hashes(terms),
    }
    return summary, rejected


def build_manifest(
    summaries: Sequence[dict[str, Any]],
    *,
    source: str,
    class_names: Sequence[str],
    image_shape: Sequence[int] | None,
    rejections: Sequence[dict[str, str]],
    validation_fraction: float,
    encoding: str,
) -> Manifest:
    """Combine shard summaries into the manifest (deterministic: no times, sorted keys)."""
    splits: dict[str, dict[str, Any]] = {}
    for s in sorted(summaries, key=lambda s: (s["split"], s["shard"])):
        entry = splits.setdefault(
            s["split"], {"num_examples": 0, "hash": 0, "shards": [], "class_counts": [0] * len(class_names)}
        )
        entry["num_examples"] += s["num_examples"]
        entry["hash"] = combine_hashes([entry["hash"], s["hash"]])
        entry["class_counts"] = [a + b for a, b in zip(entry["class_counts"], s["class_counts"])]
        entry["shards"].append(ShardEntry(s["file"], s["num_examples"]))
    total = combine_hashes([e["hash"] for e in splits.values()])
    reasons: dict[str, int] = {}
    for r in rejections:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    return Manifest(
        source=source,
        record_encoding=encoding,
        image_shape=tuple(image_shape) if image_shape else None,
        class_names=tuple(class_names),
        content_hash=f"{total:064x}",
        validation_fraction=validation_fraction,
        splits={
            name: SplitEntry(
                num_examples=e["num_examples"],
                class_counts=dict(zip(class_names, e["class_counts"])),
                content_hash=f"{e['hash']:064x}",
                shards=tuple(e["shards"]),
            )
            for name, e in sorted(splits.items())
        },
        num_rejected=len(rejections),
        rejected_by_reason=dict(sorted(reasons.items())),
    )


def _unrelated_files(output_dir: str, patterns: Sequence[str]) -> list[str]:
    """Names in a local ``output_dir`` that no output of this command matches (shards, manifest, reports, temps)."""
    import fnmatch

    if not files.isdir(output_dir):
        return []
    ours = (*patterns, ".*.tmp")
    return sorted(name for name in files.listdir(output_dir) if not any(fnmatch.fnmatch(name, p) for p in ours))


def check_output(output_dir: str, *, overwrite: bool, extra_files: Sequence[str] = ()) -> list[str]:
    """The outputs of a previous run in ``output_dir`` (to replace); refuses what must not be mixed into.

    The output must be a new or empty directory, or hold only a previous output of the same
    command (replaced only with ``overwrite``): anything else (a file, a directory of other
    files) is refused. Cheap, so commands call it before any work.
    """
    patterns = ("*.array_record", MANIFEST, REPORT, *extra_files)
    if is_local(output_dir) and os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise DataError(f"output {output_dir!r} is an existing file, not a directory: give a new directory")
    unrelated = _unrelated_files(output_dir, patterns)
    if unrelated:
        shown = ", ".join(unrelated[:3]) + (f" and {len(unrelated) - 3} more" if len(unrelated) > 3 else "")
        raise DataError(
            f"output {output_dir!r} holds files that are not an output of this command ({shown}): "
            "give a new or empty directory"
        )
    existing = [path for pattern in patterns for path in files.glob(join(output_dir, pattern))]
    if existing and not overwrite:
        raise DataError(
            f"output {output_dir!r} already holds a dataset or the remains of a "
            "failed run (use --overwrite to replace it)"
        )
    return existing


@files.owner_only
def prepare_output(output_dir: str, *, overwrite: bool, extra_files: Sequence[str] = ()) -> None:
    """Refuse to mix runs in one directory (``check_output``); with ``overwrite`` clear the old outputs first."""
    existing = check_output(output_dir, overwrite=overwrite, extra_files=extra_files)
    for path in existing:
        files.remove(path)
    files.makedirs(output_dir)


def rebuild_command(directory: str, manifest: Manifest) -> str:
    """The command that writes ``directory`` again from its source, as the manifest records it."""
    if manifest.source.startswith("dedup:"):
        return f"the `dpscale dedup` command that wrote {directory!r}, with --overwrite"
    options = [f"--validation-fraction {manifest.validation_fraction:g}"] if manifest.validation_fraction else []
    if manifest.record_encoding != "raw":
        options.append(f"--image-encoding {manifest.record_encoding}")
    if manifest.class_filter is not None:
        options.append(f"--classes {','.join(manifest.class_names)}")
    return " ".join(["`dpscale ingest", manifest.source, directory, *options, "--overwrite`"])


def _shard_problem(path: str, expected: int, positions: Sequence[int] | None) -> str | None:
    """Why the shard at ``path`` cannot be read (None: it reads): opened, counted, ``positions`` read."""
    from array_record.python.array_record_data_source import ArrayRecordDataSource

    try:
        with ArrayRecordDataSource([path]) as source:
            if len(source) != expected:
                return f"it holds {len(source)} records, the manifest says {expected}"
            if positions:
                source.__getitems__(list(positions))
    except (RuntimeError, OSError, ValueError) as exc:
        return _reason(exc)
    return None


def _reason(exc: BaseException) -> str:
    """The first clause of a reader's error, short enough for one line."""
    text = " ".join(str(exc).split()).split("; ")[0]
    return (text if len(text) <= 150 else text[:147] + "...") or type(exc).__name__


def damaged_shard_error(
    directory: str, manifest: Manifest, split: str, error: BaseException, *, indices: Sequence[int] | None = None
) -> DataError:
    """One line naming the shard of ``split`` that cannot be read, and the command that rebuilds the dataset.

    ArrayRecord's reader says what is wrong (a checksum, a cut-off file) but not in which of a
    split's files: the shards are probed one by one (only those holding ``indices``, if given),
    which costs nothing unless something already failed.
    """
    entries = [s for s in manifest.splits[split].shards if s.num_examples]
    wanted: dict[int, list[int]] = {}
    if indices is not None:
        bounds = np.cumsum([s.num_examples for s in entries])
        for index in indices:
            shard = int(np.searchsorted(bounds, index, side="right"))
            wanted.setdefault(shard, []).append(int(index) - (int(bounds[shard - 1]) if shard else 0))
    for number, entry in enumerate(entries):
        if indices is not None and number not in wanted:
            continue
        path = join(directory, entry.file)
        problem = _shard_problem(path, entry.num_examples, wanted.get(number))
        if problem is not None:
            return DataError(
                f"shard {path!r} of split {split!r} is damaged ({problem}); rebuild the dataset with "
                f"{rebuild_command(directory, manifest)}"
            )
    return DataError(
        f"split {split!r} of {directory!r} cannot be read ({_reason(error)}); rebuild the dataset with "
        f"{rebuild_command(directory, manifest)}"
    )


@files.owner_only
def write_json(path: str, payload: Any) -> None:
    data = (json.dumps(payload, indent=2, sort_keys=False) + "\n").encode()
    files.write_atomic(path, lambda f: f.write(data), binary=True)


def read_json(path: str) -> Any:
    return json.loads(files.read_text(path))


def read_manifest(directory: str) -> Manifest:
    """The manifest of the dataset in ``directory``; ``DataError`` if there is none or it is malformed."""
    try:
        payload = read_json(join(directory, MANIFEST))
    except (OSError, ValueError) as exc:
        raise DataError(f"{directory!r} is not an ingested dataset (no readable {MANIFEST})") from exc
    return Manifest.from_json(payload, where=repr(directory))


def write_manifest(directory: str, manifest: Manifest) -> None:
    write_json(join(directory, MANIFEST), manifest.to_json())


def write_outputs(
    _: Any,
    *,
    output_dir: str,
    summaries: Sequence[dict[str, Any]],
    rejections: Sequence[dict[str, str]],
    image_shape: Sequence[int] | None,
    source: str,
    class_names: Sequence[str],
    validation_fraction: float,
    encoding: str,
    num_inputs: int,
    num_excluded: int = 0,
    source_class_names: Sequence[str] | None = None,
) -> Manifest:
    """Write report.json, then manifest.json last: a manifest means a complete dataset.

    Every planned input must be an example, a rejection or (with a class filter, whose
    source classes are ``source_class_names``) left out by the filter; if the runner lost
    some, no manifest is written and the run fails instead of passing for complete.
    """
    ordered = sorted(rejections, key=lambda r: (r["split"], r["key"], r["reason"]))
    write_json(join(output_dir, REPORT), {"num_rejected": len(ordered), "rejected": ordered})
    manifest = build_manifest(
        summaries,
        source=source,
        class_names=class_names,
        image_shape=image_shape,
        rejections=ordered,
        validation_fraction=validation_fraction,
        encoding=encoding,
    )
    accounted = len(ordered) + num_excluded + manifest.num_examples
    if accounted != num_inputs:
        raise RuntimeError(
            f"ingest accounted for {accounted} of {num_inputs} inputs; "
            "the runner lost or duplicated data, no manifest written"
        )
    manifest = dataclasses.replace(
        manifest,
        num_inputs=num_inputs,
        class_filter=None if source_class_names is None else ClassFilter(tuple(source_class_names), num_excluded),
    )
    write_manifest(output_dir, manifest)
    return manifest
