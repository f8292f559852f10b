"""Shard writing and the manifest: deterministic, complete or absent."""

import json

import numpy as np
import pytest

from dpscale.data import shards
from dpscale.data.dataset import IngestedDataset
from dpscale.data.examples import Example, content_digest, encode


def _examples(n, split="train"):
    out = []
    for i in range(n):
        img = np.full((2, 2, 1), i, np.uint8)
        out.append(encode(Example(split, f"k{i}", i % 2, img, content_digest(img))))
    return out


def _finish(tmp_path, summaries, num_inputs, rejections=()):
    return shards.write_outputs(
        None,
        output_dir=str(tmp_path),
        summaries=summaries,
        rejections=list(rejections),
        image_shape=(2, 2, 1),
        source="test",
        class_names=["even", "odd"],
        validation_fraction=0.0,
        encoding="raw",
        num_inputs=num_inputs,
    )


def test_shard_is_sorted_and_identical_for_any_input_order(tmp_path):
    items = _examples(9)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = shards.write_shard(str(tmp_path / "a"), "train", 0, 1, items, num_classes=2, shape=(2, 2, 1))
    b = shards.write_shard(str(tmp_path / "b"), "train", 0, 1, items[::-1], num_classes=2, shape=(2, 2, 1))
    assert a == b and a[0]["num_examples"] == 9 and a[0]["class_counts"] == [5, 4]
    assert a[1] == []
    name = shards.shard_name("train", 0, 1)
    assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_manifest_written_only_when_every_input_is_accounted_for(tmp_path):
    summary, _ = shards.write_shard(str(tmp_path), "train", 0, 1, _examples(4), num_classes=2, shape=(2, 2, 1))
    rejection = {"split": "train", "key": "x.png", "reason": "undecodable", "detail": ""}
    with pytest.raises(RuntimeError, match="accounted for 5 of 6"):
        _finish(tmp_path, [summary], 6, [rejection])
    assert not (tmp_path / shards.MANIFEST).exists()
    manifest = _finish(tmp_path, [summary], 5, [rejection])
    assert manifest.num_inputs == 5 and manifest.num_rejected == 1
    assert json.loads((tmp_path / shards.MANIFEST).read_text()) == manifest.to_json()
    ds = IngestedDataset(str(tmp_path))
    images, labels = ds.get("train", [0, 1, 2, 3])
    assert sorted(int(x) for x in images[:, 0, 0, 0]) == [0, 1, 2, 3]
    assert list(labels) == [int(x) % 2 for x in images[:, 0, 0, 0]]
    np.testing.assert_array_equal(ds.split_images("train"), images)  # the whole split, in index order
    # example ids: read from the headers in index order, in chunks, the pixels' hash whatever the split or label
    ids = ds.ids("train", chunk=3)
    assert ids.dtype == np.uint64 and list(ids) == [
        int.from_bytes(content_digest(images[i])[:8], "big") for i in range(4)
    ]


def test_wrong_shape_examples_are_returned_as_rejections(tmp_path):
    odd = np.zeros((3, 2, 1), np.uint8)
    items = _examples(3) + [encode(Example("train", "odd.png", 0, odd, content_digest(odd)))]
    summary, rejected = shards.write_shard(str(tmp_path), "train", 0, 1, items, num_classes=2, shape=(2, 2, 1))
    assert summary["num_examples"] == 3
    assert [(r.key, r.reason) for r in rejected] == [("odd.png", "wrong_shape")]


def test_reader_refuses_a_directory_without_manifest(tmp_path):
    from dpscale.errors import DataError

    with pytest.raises(DataError):
        IngestedDataset(str(tmp_path))


def test_shards_manifest_and_report_are_owner_only_under_any_umask(tmp_path, umask_022):
    """Ingested data is the private data: the library's own writers close it, whatever the caller's umask."""
    from ..conftest import not_owner_only

    out = str(tmp_path / "data")
    shards.prepare_output(out, overwrite=False)
    summary, _ = shards.write_shard(out, "train", 0, 1, _examples(4), num_classes=2, shape=(2, 2, 1))
    _finish(tmp_path / "data", [summary], 4)
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [
        shards.MANIFEST,
        shards.REPORT,
        shards.shard_name("train", 0, 1),
    ]
    assert not_owner_only(out) == []
