"""The Zarr feature store: chunk-wise writes, completion, and refusing partial or stale entries."""

import json
import os
import shutil

import numpy as np
import pytest

from dpscale.cache import feature_store as fstore
from dpscale.cache.keys import FeatureKey
from dpscale.errors import DataError

KEY = FeatureKey(
    data_identity="a" * 64, weights_sha256="b" * 64, model="cnn-small", resolution=16, mean=(8.0,), std=(4.0,)
)
DIM = 5


def layout(key=KEY, chunk_rows=4):
    return fstore.EntryLayout(
        key=key,
        feature_dim=DIM,
        class_names=("x", "y", "z"),
        splits={"train": fstore.SplitLayout(10, chunk_rows), "test": fstore.SplitLayout(3, chunk_rows)},
    )


def rows(split, start, stop):
    """Deterministic fake features/labels/ids of rows [start, stop) of a split."""
    base = 100.0 if split == "test" else 0.0
    r = np.arange(start, stop)
    feats = (base + r[:, None] * 10 + np.arange(DIM)[None, :]).astype(np.float32)
    ids = [bytes([i % 256]) * 32 for i in r]
    return feats, (r % 3).astype(np.int32), ids


def write(store, chunks=None):
    for split, chunk in store.all_chunks() if chunks is None else chunks:
        start, stop = store.layout.splits[split].rows(chunk)
        store.write_chunk(split, chunk, *rows(split, start, stop))


@pytest.fixture()
def complete(tmp_path):
    store = fstore.FeatureStore.create(str(tmp_path), layout())
    write(store)
    store.finalize()
    return store


def test_split_layout_cuts_whole_chunks():
    split = fstore.SplitLayout(10, 4)
    assert split.num_chunks == 3
    assert [split.rows(c) for c in range(3)] == [(0, 4), (4, 8), (8, 10)]
    with pytest.raises(IndexError):
        split.rows(3)


def test_complete_entry_reads_back(complete, tmp_path):
    fs = fstore.open_features(complete.path)
    assert complete.path == os.path.join(str(tmp_path), KEY.digest)
    assert fs.splits == ["test", "train"]
    assert (fs.feature_dim, fs.class_names, fs.num_examples("train")) == (DIM, ["x", "y", "z"], 10)
    feats, labels, ids = rows("train", 0, 10)
    np.testing.assert_array_equal(fs.features("train")[:], feats)
    assert fs.features("train").dtype == np.float32
    np.testing.assert_array_equal(fs.labels("train"), labels)
    assert fs.labels("train").dtype == np.int32
    assert fs.ids("train") == [i.hex() for i in ids]
    np.testing.assert_array_equal(fs.features("test")[:], rows("test", 0, 3)[0])
    assert fs.metadata["key"]["data_identity"] == KEY.data_identity and fs.digest == KEY.digest
    assert fs.metadata["key"]["resolution"] == 16 and fs.key == KEY
    idx = np.array([[9, 0, 0], [3, 7, 2]])
    xb, yb = fs.get("train", idx)
    np.testing.assert_array_equal(xb, feats[idx])
    np.testing.assert_array_equal(yb, labels[idx])
    with pytest.raises(IndexError):
        fs.get("train", [10])
    with pytest.raises(DataError, match="split 'validation'"):
        fs.features("validation")
    assert fstore.FeatureStore.open(str(tmp_path), KEY).num_examples("test") == 3


def test_partial_entry_is_refused_and_resumes_missing_chunks_only(tmp_path):
    store = fstore.FeatureStore.create(str(tmp_path), layout())
    write(store, [("train", 0), ("test", 0)])
    assert store.missing_chunks() == [("train", 1), ("train", 2)]
    with pytest.raises(RuntimeError, match="2 of 4 chunks"):
        store.finalize()
    with pytest.raises(DataError, match="incomplete .*2 of 4 chunks"):
        fstore.open_features(store.path)
    with pytest.raises(DataError, match="incomplete"):
        fstore.FeatureStore.open(str(tmp_path), KEY)
    # a new run with the same layout keeps what was written
    again = fstore.FeatureStore.create(str(tmp_path), layout())
    assert again.missing_chunks() == [("train", 1), ("train", 2)]
    write(again, again.missing_chunks())
    again.finalize()
    np.testing.assert_array_equal(fstore.open_features(store.path).features("train")[:], rows("train", 0, 10)[0])


def test_chunk_data_without_its_marker_does_not_count(complete):
    os.remove(os.path.join(complete.path, "chunks", "train", "000001.done"))
    assert complete.missing_chunks() == [("train", 1)]
    os.remove(os.path.join(complete.path, fstore.COMPLETE))
    with pytest.raises(DataError, match="3 of 4"):
        fstore.open_features(complete.path)


def test_another_layout_clears_the_entry(complete, tmp_path):
    other = fstore.FeatureStore.create(str(tmp_path), layout(chunk_rows=5))
    assert other.path == complete.path
    assert len(other.missing_chunks()) == len(other.all_chunks()) == 3
    assert not other.is_complete()


def test_stale_or_mismatched_entries_are_refused(complete, tmp_path):
    other_key = FeatureKey(**{**KEY.as_dict(), "resolution": 32})
    # asked for another key (e.g. a copied entry)
    with pytest.raises(DataError, match="another key .*resolution"):
        fstore.open_features(complete.path, expected_key=other_key)
    # moved under another digest's name
    moved = os.path.join(str(tmp_path), other_key.digest)
    shutil.copytree(complete.path, moved)
    with pytest.raises(DataError, match="directory name"):
        fstore.open_features(moved)
    with pytest.raises(DataError, match="directory name"):
        fstore.FeatureStore.open(str(tmp_path), other_key)
    # metadata edited so the key no longer hashes to the digest
    meta_path = os.path.join(complete.path, fstore.METADATA)
    meta = json.loads(open(meta_path).read())
    meta["key"]["resolution"] = 32
    open(meta_path, "w").write(json.dumps(meta))
    with pytest.raises(DataError, match="does not hash"):
        fstore.open_features(complete.path)


def test_completion_marker_of_another_key_is_not_complete(complete):
    with open(os.path.join(complete.path, fstore.COMPLETE), "w") as f:
        f.write("c" * 64 + "\n")
    with pytest.raises(DataError, match="incomplete"):
        fstore.open_features(complete.path)


def test_missing_or_foreign_entries_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="run dpscale featurize"):
        fstore.FeatureStore.open(str(tmp_path), KEY)
    with pytest.raises(DataError, match="not a feature-cache entry .*give the entry directory"):
        fstore.open_features(str(tmp_path))
    (tmp_path / fstore.METADATA).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(DataError, match="not a dpscale feature-store entry"):
        fstore.open_features(str(tmp_path))


def test_wrong_chunk_shapes_are_refused(tmp_path):
    store = fstore.FeatureStore.create(str(tmp_path), layout())
    feats, labels, ids = rows("train", 0, 4)
    with pytest.raises(ValueError, match="features"):
        store.write_chunk("train", 0, feats[:3], labels[:3], ids[:3])
    with pytest.raises(ValueError, match="rows"):
        store.write_chunk("train", 0, feats, labels[:3], ids)
    assert ("train", 0) in store.missing_chunks()


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DPSCALE_CACHE_DIR", str(tmp_path / "c"))
    assert fstore.default_cache_dir() == str(tmp_path / "c")
    monkeypatch.delenv("DPSCALE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert fstore.default_cache_dir() == str(tmp_path / "dpscale" / "features")


def test_an_entry_made_through_the_api_is_owner_only_under_any_umask(tmp_path, umask_022):
    """The entry *is* private data: FeatureStore closes it itself, not only the command line's umask."""
    from ..conftest import not_owner_only

    store = fstore.FeatureStore.create(str(tmp_path / "cache"), layout())
    write(store)
    store.finalize()
    assert not_owner_only(store.path) == []
    assert fstore.open_features(store.path).num_examples("train") == 10
    assert os.umask(0o022) == 0o022  # the caller's umask is given back
    # An entry an older dpscale left readable is closed when it is used again.
    os.chmod(store.path, 0o755)
    fstore.FeatureStore.create(str(tmp_path / "cache"), layout())
    assert os.stat(store.path).st_mode & 0o777 == 0o700
