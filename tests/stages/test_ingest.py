"""End to end: ingest small sources, check manifest, report, hash and random access."""

import gzip
import json
import os
import shutil
import tarfile

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from dpscale.cli import cli
from dpscale.data.dataset import IngestedDataset
from dpscale.errors import DataError, InvalidConfigError
from dpscale.stages.ingest import IngestConfig, run

CIFAR = "/work/shared/data/cifar10-jpeg.tar.gz"
FAST = ("--runner=FnApiRunner", "--direct_num_workers=1", "--direct_running_mode=in_memory")


def _image(seed: int, shape=(6, 6, 3)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _save_png(path, array) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array).save(path, format="PNG")


def make_folder(root, *, seed0: int = 0):
    """train/{a,b,c} x 4 + test/{a,b} x 2 PNGs, plus a corrupt, a gray and an unknown-class file."""
    truth = {}
    seed = seed0
    for split, per_class, classes in [("train", 4, "abc"), ("test", 2, "ab")]:
        for cls in classes:
            for i in range(per_class):
                img = _image(seed)
                _save_png(root / split / cls / f"{i}.png", img)
                truth[f"{split}/{cls}/{i}.png"] = (img, "abc".index(cls))
                seed += 1
    (root / "train" / "a" / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    _save_png(root / "train" / "b" / "gray.png", _image(99, (6, 6, 1)))
    _save_png(root / "test" / "zebra" / "0.png", _image(98))
    return truth


def ingest(source, out, **kwargs) -> "IngestedDataset":
    run(IngestConfig(str(source), str(out), pipeline_args=FAST, **kwargs))
    return IngestedDataset(str(out))


@pytest.fixture(scope="module")
def folder_dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    truth = make_folder(root)
    out = tmp_path_factory.mktemp("out") / "ds"
    return ingest(f"folder:{root}", out), truth, root


def test_manifest_counts_and_classes(folder_dataset):
    ds, _, _ = folder_dataset
    m = ds.manifest
    assert m.class_names == ("a", "b", "c") and ds.num_classes == 3
    assert m.image_shape == (6, 6, 3)
    assert m.splits["train"].num_examples == 12
    assert m.splits["train"].class_counts == {"a": 4, "b": 4, "c": 4}
    assert m.splits["test"].class_counts == {"a": 2, "b": 2, "c": 0}
    assert m.to_json()["format_version"] == 1 and m.record_encoding == "raw"
    assert m.source.startswith("folder:")
    assert len(ds) == 16


def test_bad_inputs_are_reported_not_dropped(folder_dataset):
    ds, _, _ = folder_dataset
    report = json.loads(open(os.path.join(ds.path, "report.json")).read())
    by_key = {r["key"]: r["reason"] for r in report["rejected"]}
    assert by_key == {
        "train/a/corrupt.jpg": "undecodable",
        "train/b/gray.png": "wrong_shape",
        "test/zebra/0.png": "unknown_label",
    }
    assert ds.manifest.num_rejected == 3
    assert ds.manifest.rejected_by_reason == {"undecodable": 1, "unknown_label": 1, "wrong_shape": 1}


def test_random_access_returns_the_right_image_and_label(folder_dataset):
    ds, truth, _ = folder_dataset
    n = ds.num_examples("train")
    order = np.random.default_rng(0).permutation(n)
    images, labels = ds.get("train", order)
    assert images.shape == (n, 6, 6, 3) and images.dtype == np.uint8
    for example, image, label in zip(ds.examples("train", order), images, labels):
        want_image, want_label = truth[example.key]
        np.testing.assert_array_equal(image, want_image)
        assert label == want_label
    repeat, _ = ds.get("train", [order[0], order[0]])
    np.testing.assert_array_equal(repeat[0], repeat[1])
    np.testing.assert_array_equal(ds.labels("train"), ds.get("train", range(n))[1])
    with pytest.raises(IndexError):
        ds.get("train", [n])
    with pytest.raises(IndexError):
        ds.get("train", [-1])  # padding only when asked for


def test_get_takes_padded_sampler_batches(folder_dataset):
    ds, _, _ = folder_dataset
    batch = np.array([[3, 0, -1], [5, -1, -1]])
    images, labels = ds.get("train", batch, padding_index=-1)
    assert images.shape == (2, 3, 6, 6, 3) and labels.shape == (2, 3)
    want_images, want_labels = ds.get("train", [3, 0, 5])
    np.testing.assert_array_equal(images[0, :2], want_images[:2])
    np.testing.assert_array_equal(images[1, 0], want_images[2])
    assert list(labels[batch >= 0]) == list(want_labels)
    assert not images[batch < 0].any() and not labels[batch < 0].any()
    with pytest.raises(DataError):
        ds.get("validation", [0])


def test_same_data_other_order_and_names_gives_same_hash_and_index(folder_dataset, tmp_path):
    ds, truth, _ = folder_dataset
    # Same pixels and labels, written in reverse order under other file names.
    root = tmp_path / "renamed"
    for i, (key, (img, label)) in enumerate(sorted(truth.items(), reverse=True)):
        split = key.split("/")[0]
        _save_png(root / split / "abc"[label] / f"img{i:03d}.png", img)
    other = ingest(f"folder:{root}", tmp_path / "out")
    assert other.content_hash == ds.content_hash
    assert other.manifest.splits["train"].content_hash == ds.manifest.splits["train"].content_hash
    np.testing.assert_array_equal(other.get("train", range(12))[0], ds.get("train", range(12))[0])
    # Changing one label changes the hash.
    moved = next((root / "train" / "a").iterdir())
    shutil.move(moved, root / "train" / "b" / moved.name)
    changed = ingest(f"folder:{root}", tmp_path / "out2")
    assert changed.content_hash != ds.content_hash


def test_validation_split_is_deterministic(tmp_path):
    root = tmp_path / "img"
    for i in range(60):
        _save_png(root / f"c{i % 2}" / f"{i}.png", _image(i, (4, 4, 3)))
    first = ingest(f"folder:{root}", tmp_path / "a", validation_fraction=0.25, examples_per_shard=10)
    second = ingest(f"folder:{root}", tmp_path / "b", validation_fraction=0.25)
    ids = lambda d: sorted(e.id for e in d.examples("validation", range(d.num_examples("validation"))))  # noqa: E731
    assert 5 <= first.num_examples("validation") <= 25
    assert first.num_examples("train") + first.num_examples("validation") == 60
    assert ids(first) == ids(second)
    assert len(first.manifest.splits["train"].shards) > 1  # several shards, one index
    assert first.content_hash == second.content_hash  # shard count does not change the data


def test_tar_gz_source(tmp_path):
    root = tmp_path / "pack" / "data"
    truth = make_folder(root, seed0=200)
    archive = tmp_path / "data.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(root, arcname="data")
    ds = ingest(f"folder:{archive}", tmp_path / "out")
    assert ds.num_examples("train") == 12 and ds.num_examples("test") == 4
    assert ds.manifest.num_rejected == 3
    e = ds.examples("test", [0])[0]
    key = e.key.split("/", 1)[1]
    np.testing.assert_array_equal(e.image, truth[key][0])


def _write_idx(path, array):
    header = bytes([0, 0, 8, array.ndim]) + np.array(array.shape, ">u4").tobytes()
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_idx_source_and_unknown_label(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (10, 5, 5), dtype=np.uint8)
    labels = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    _write_idx(tmp_path / "train-images-idx3-ubyte.gz", images)
    _write_idx(tmp_path / "train-labels-idx1-ubyte.gz", labels)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", images[:3])
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.array([1, 9, 2]))
    ds = ingest(f"idx:{tmp_path}", tmp_path / "out")
    assert ds.manifest.splits["train"].class_counts == {"0": 4, "1": 3, "2": 3}
    assert ds.num_examples("test") == 2
    assert [r["reason"] for r in json.load(open(tmp_path / "out" / "report.json"))["rejected"]] == ["unknown_label"]
    got, got_labels = ds.get("train", range(10))
    index = {img.tobytes(): i for i, img in enumerate(images)}
    for img, label in zip(got, got_labels):
        assert labels[index[img[..., 0].tobytes()]] == label


def test_digits_source_png_encoding(tmp_path):
    ds = ingest("digits", tmp_path / "out", image_encoding="png")
    assert ds.image_shape == (8, 8, 1)
    assert ds.num_examples("train") + ds.num_examples("test") == 1797
    assert ds.manifest.record_encoding == "png"
    images, labels = ds.get("test", [0, 1, 2])
    assert images.shape == (3, 8, 8, 1) and set(labels) <= set(range(10))


def test_ingested_data_is_owner_only_and_the_umask_is_restored(tmp_path):
    """Shards, manifest and report are the private data: nobody else may read them (they were 0644)."""
    before = os.umask(0o022)
    try:
        ingest("digits", tmp_path / "out")
        assert os.umask(0o022) == 0o022  # restored after the stage
    finally:
        os.umask(before)
    found = [os.path.join(d, n) for d, dirs, files in os.walk(tmp_path / "out") for n in dirs + files]
    assert found and all(not os.stat(p).st_mode & 0o077 for p in found + [str(tmp_path / "out")])


def test_output_dir_is_not_silently_mixed(tmp_path, folder_dataset):
    _, _, root = folder_dataset
    ingest(f"folder:{root}", tmp_path / "out")
    with pytest.raises(DataError):
        ingest(f"folder:{root}", tmp_path / "out")
    again = ingest(f"folder:{root}", tmp_path / "out", overwrite=True, examples_per_shard=5)
    assert len(again.manifest.splits["train"].shards) == 3
    assert len(list((tmp_path / "out").glob("train-*.array_record"))) == 3


def test_all_inputs_rejected_still_gives_a_readable_report(tmp_path):
    root = tmp_path / "img"
    (root / "a").mkdir(parents=True)
    (root / "a" / "1.jpg").write_bytes(b"not an image")
    ds = ingest(f"folder:{root}", tmp_path / "out")
    assert ds.splits == [] and ds.image_shape == () and len(ds) == 0
    assert ds.manifest.rejected_by_reason == {"undecodable": 1}


def test_config_validation():
    with pytest.raises(InvalidConfigError):
        IngestConfig("digits", "/tmp/x", validation_fraction=1.0)
    with pytest.raises(InvalidConfigError):
        IngestConfig("digits", "/tmp/x", image_encoding="webp")


def test_cli_ingest_and_one_line_errors(tmp_path, folder_dataset):
    _, _, root = folder_dataset
    runner = CliRunner()
    result = runner.invoke(
        cli, ["ingest", f"folder:{root}", str(tmp_path / "o"), "--validation-fraction", "0.2", "--", *FAST]
    )
    assert result.exit_code == 0, result.output
    assert "rejected: 3" in result.output and "content hash:" in result.output
    assert IngestedDataset(str(tmp_path / "o")).manifest.validation_fraction == 0.2
    missing = runner.invoke(cli, ["ingest", f"folder:{tmp_path}/missing", str(tmp_path / "p")])
    assert missing.exit_code == 2
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0]
    bad = runner.invoke(cli, ["ingest", "csv:/x", str(tmp_path / "p")])
    assert bad.exit_code == 2


@pytest.mark.skipif(not os.path.exists(CIFAR), reason="needs the shared CIFAR-10 JPEG archive")
def test_cifar10_jpeg_slice(tmp_path):
    root = tmp_path / "cifar"
    with tarfile.open(CIFAR) as tar:
        members = [m for m in tar if m.isfile() and m.name.split("/")[-1] < "0004.jpg"]
        tar.extractall(root, members=members, filter="data")
    ds = ingest(f"folder:{root}", tmp_path / "out")
    assert ds.image_shape == (32, 32, 3)
    assert len(ds.class_names) == 10 and ds.manifest.num_rejected == 0
    assert ds.num_examples("train") == ds.num_examples("test") == len(members) // 2


def test_tfds_source_end_to_end_with_mock_data(tmp_path):
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=12):
        ds = ingest("tfds:mnist:train", tmp_path / "out", validation_fraction=0.25)
    assert ds.class_names == [str(i) for i in range(10)]
    assert ds.image_shape == (28, 28, 1)
    assert ds.num_examples("train") + ds.num_examples("validation") == 12
    assert ds.manifest.source == "tfds:mnist:train"
    images, labels = ds.get("train", range(ds.num_examples("train")))
    assert images.dtype == np.uint8 and ((0 <= labels) & (labels < 10)).all()
