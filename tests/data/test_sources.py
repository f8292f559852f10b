"""Source parsing, layout detection and raw reading for every source kind."""

import gzip
import io
import tarfile

import numpy as np
import pytest
from PIL import Image

from dpscale.data import folder_source as sources
from dpscale.data.raw_items import UNKNOWN_LABEL, ReadTask, SourceSpec
from dpscale.data.sources import SOURCE_KINDS, parse_source, plan_source, read_task
from dpscale.errors import DataError, InvalidConfigError


def _png(value: int, size: int = 4) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((size, size, 3), value, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _read_all(plan):
    return [item for task in plan.tasks for item in read_task(task, plan.class_names)]


def write_idx(path, array: np.ndarray, *, compress: bool) -> None:
    """Write an IDX file of unsigned bytes (MNIST format)."""
    header = bytes([0, 0, 8, array.ndim]) + np.array(array.shape, ">u4").tobytes()
    data = header + array.astype(np.uint8).tobytes()
    with gzip.open(path, "wb") if compress else open(path, "wb") as f:
        f.write(data)


def test_parse_source_kinds():
    assert parse_source("tfds:mnist:train[:10%]").split == "train[:10%]"
    assert parse_source("tfds:mnist").location == "mnist"
    assert parse_source("folder:/a/b:c").location == "/a/b:c"
    assert parse_source("idx:/x").kind == "idx"
    assert parse_source("digits").kind == "digits"
    with pytest.raises(InvalidConfigError):
        parse_source("csv:/x")
    with pytest.raises(InvalidConfigError):
        parse_source("folder:")


def test_every_kind_is_one_row_of_the_table():
    assert [kind.name for kind in SOURCE_KINDS] == ["tfds", "folder", "idx", "digits"]
    task_kinds = [t for kind in SOURCE_KINDS for t in kind.task_kinds]
    assert len(task_kinds) == len(set(task_kinds))
    expected = "expected tfds:NAME[:SPLIT], folder:PATH, idx:DIR or digits"
    for text in ("csv:/x", "tfds:", "digits:x", "nope"):
        with pytest.raises(InvalidConfigError) as error:
            parse_source(text)
        assert str(error.value) == f"unknown source {text!r}; {expected}"
    with pytest.raises(InvalidConfigError, match="unknown source kind 'csv'"):
        plan_source(SourceSpec("csv", "/x"))
    with pytest.raises(ValueError, match="unknown task kind 'csv'"):
        list(read_task(ReadTask("csv"), ()))


def testsplit_layout_with_wrapper_dir_and_stray_file():
    members, classes = sources.split_layout(
        [
            "cifar/train/cat/1.png",
            "cifar/train/dog/2.png",
            "cifar/test/cat/3.png",
            "cifar/val/bird/4.png",
            "cifar/train/README",
        ]
    )
    assert classes == ["cat", "dog"]
    assert ("validation", "bird", "cifar/val/bird/4.png") in members
    assert ("train", "", "cifar/train/README") in members  # reported later, not dropped


def test_single_class_and_single_split_folders_are_not_stripped():
    assert split_layout_classes(["a/1.jpg", "a/2.jpg"]) == ["a"]
    members, classes = sources.split_layout(["wrap/test/a/1.jpg", "wrap/test/b/2.jpg"])
    assert classes == ["a", "b"] and {m[0] for m in members} == {"test"}


def split_layout_classes(paths):
    return sources.split_layout(paths)[1]


def test_class_only_layout_is_train():
    members, classes = sources.split_layout(["a/1.jpg", "b/2.jpg"])
    assert classes == ["a", "b"]
    assert {m[0] for m in members} == {"train"}


def test_folder_reads_labels_and_unknown_classes(tmp_path):
    for split, cls, value in [("train", "cat", 1), ("train", "dog", 2), ("test", "cow", 3)]:
        (tmp_path / split / cls).mkdir(parents=True)
        (tmp_path / split / cls / "x.png").write_bytes(_png(value))
    (tmp_path / "train" / ".DS_Store").write_bytes(b"junk")
    plan = plan_source(parse_source(f"folder:{tmp_path}"), chunk_size=1)
    assert plan.class_names == ("cat", "dog")
    assert plan.split_sizes == {"train": 2, "test": 1}
    assert len(plan.tasks) == 3
    items = {i.key: i for i in _read_all(plan)}
    assert items["train/dog/x.png"].label == 1
    assert items["test/cow/x.png"].label == UNKNOWN_LABEL
    assert items["test/cow/x.png"].label_name == "cow"


@pytest.mark.parametrize("suffix,mode", [(".tar.gz", "w:gz"), (".tgz", "w:gz"), (".tar", "w")])
def test_tar_source(tmp_path, suffix, mode):
    archive = tmp_path / f"data{suffix}"
    with tarfile.open(archive, mode) as tar:
        for name, value in [("d/train/a/1.png", 1), ("d/train/b/2.png", 2), ("d/test/a/3.png", 3)]:
            data = _png(value)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    plan = plan_source(parse_source(f"folder:{archive}"), chunk_size=2)
    assert plan.class_names == ("a", "b")
    assert [len(t.members) for t in plan.tasks] == [2, 1]
    assert dict(plan.tasks[1].extra)["spans"][0][0] > 0  # the second run starts mid-archive
    items = _read_all(plan)
    assert sorted((i.split, i.label) for i in items) == [("test", 0), ("train", 0), ("train", 1)]
    assert all(isinstance(i.payload, bytes) and i.payload[:4] == b"\x89PNG" for i in items)


def test_missing_paths_raise_data_error(tmp_path):
    for text in (f"folder:{tmp_path}/nope", f"idx:{tmp_path}/nope"):
        with pytest.raises(DataError):
            plan_source(parse_source(text))
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(DataError):
        plan_source(parse_source(f"folder:{tmp_path}/file.txt"))
    with pytest.raises(DataError):
        plan_source(parse_source(f"idx:{tmp_path}"))  # no IDX files


@pytest.mark.parametrize("compress", [False, True])
def test_idx_source(tmp_path, compress):
    suffix = ".gz" if compress else ""
    rng = np.random.default_rng(0)
    train = rng.integers(0, 256, (5, 3, 2), dtype=np.uint8)
    test = rng.integers(0, 256, (3, 3, 2), dtype=np.uint8)
    write_idx(tmp_path / f"train-images-idx3-ubyte{suffix}", train, compress=compress)
    write_idx(tmp_path / f"train-labels-idx1-ubyte{suffix}", np.array([0, 1, 2, 1, 0]), compress=compress)
    write_idx(tmp_path / f"t10k-images-idx3-ubyte{suffix}", test, compress=compress)
    write_idx(tmp_path / f"t10k-labels-idx1-ubyte{suffix}", np.array([2, 7, 0]), compress=compress)
    plan = plan_source(parse_source(f"idx:{tmp_path}"), chunk_size=2)
    assert plan.class_names == ("0", "1", "2")
    assert plan.split_sizes == {"train": 5, "test": 3}
    items = {(i.split, i.key): i for i in _read_all(plan)}
    assert len(items) == 8
    np.testing.assert_array_equal(items[("train", f"train-images-idx3-ubyte{suffix}[3]")].payload, train[3][..., None])
    assert items[("test", f"t10k-images-idx3-ubyte{suffix}[1]")].label == UNKNOWN_LABEL


def test_idx_class_names_file(tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((2, 2, 2)), compress=False)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.array([0, 1]), compress=False)
    (tmp_path / "classes.txt").write_text("shirt\nshoe\nbag\n")
    assert plan_source(parse_source(f"idx:{tmp_path}")).class_names == ("shirt", "shoe", "bag")


def test_idx_count_mismatch_is_data_error(tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((3, 2, 2)), compress=False)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.array([0, 1]), compress=False)
    with pytest.raises(DataError):
        plan_source(parse_source(f"idx:{tmp_path}"))


def test_digits_split_is_deterministic_and_scaled():
    plan = plan_source(parse_source("digits"))
    assert plan.split_sizes["train"] + plan.split_sizes["test"] == 1797
    assert 0.15 < plan.split_sizes["test"] / 1797 < 0.25
    items = _read_all(plan)
    again = _read_all(plan)
    assert [i.split for i in items] == [i.split for i in again]
    assert items[0].payload.shape == (8, 8, 1) and items[0].payload.dtype == np.uint8
    assert max(int(i.payload.max()) for i in items) == 255


def test_tfds_source_with_mock_data():
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=6):
        plan = plan_source(parse_source("tfds:mnist:train"), chunk_size=4)
        assert plan.class_names == tuple(str(i) for i in range(10))
        assert plan.split_sizes == {"train": 6}
        assert len(plan.tasks) == 2
        items = _read_all(plan)
    assert len(items) == 6
    assert all(i.payload.shape == (28, 28, 1) and 0 <= i.label < 10 for i in items)
    assert {i.key for i in items} == {f"train[{k}]" for k in range(6)}


def test_tfds_unknown_dataset_is_data_error():
    with pytest.raises(DataError):
        plan_source(parse_source("tfds:no_such_dataset_xyz"))


def test_archive_truncated_after_planning_yields_empty_payloads(tmp_path):
    archive = tmp_path / "data.tar.gz"
    rng = np.random.default_rng(0)
    with tarfile.open(archive, "w:gz") as tar:
        for i in range(6):  # noisy images: the compressed stream is long enough to cut
            data = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(data, "PNG")
            info = tarfile.TarInfo(f"train/c{i % 2}/{i}.png")
            info.size = len(data.getvalue())
            tar.addfile(info, io.BytesIO(data.getvalue()))
    plan = plan_source(parse_source(f"folder:{archive}"))
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    items = _read_all(plan)
    assert len(items) == 6  # every planned member still yields an item
    assert items[0].payload[:4] == b"\x89PNG" and items[-1].payload == b""
