"""Decoding, validation, hashing, split assignment and the record format."""

import io

import numpy as np
import pytest
from PIL import Image

from dpscale.data import examples as ex
from dpscale.data.raw_items import UNKNOWN_LABEL, RawItem


def _encoded(array: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt)
    return buf.getvalue()


def _example(seed: int, *, split: str = "train", label: int = 0, shape=(4, 5, 3)) -> ex.Example:
    image = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    return ex.Example(split, f"k{seed}", label, image, ex.content_digest(image))


def test_decode_png_rgb_and_gray_keep_channels():
    rgb = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3)
    np.testing.assert_array_equal(ex.decode_image(_encoded(rgb, "PNG")), rgb)
    gray = np.arange(20, dtype=np.uint8).reshape(4, 5)
    np.testing.assert_array_equal(ex.decode_image(_encoded(gray, "PNG")), gray[..., None])


def test_decode_jpeg_is_close():
    img = np.full((8, 8, 3), 120, np.uint8)
    assert np.abs(ex.decode_image(_encoded(img, "JPEG")).astype(int) - 120).max() <= 3


def test_to_example_reports_instead_of_raising():
    corrupt = ex.to_example(RawItem("train", "bad.jpg", 0, b"\xff\xd8 not a jpeg"))
    assert isinstance(corrupt, ex.Rejection) and corrupt.reason == "undecodable"
    empty = ex.to_example(RawItem("train", "empty.png", 0, b""))
    assert isinstance(empty, ex.Rejection) and empty.reason == "undecodable"
    unknown = ex.to_example(RawItem("test", "cow/1.png", UNKNOWN_LABEL, b"", label_name="cow"))
    assert unknown.reason == "unknown_label" and "cow" in unknown.detail
    wrong_dtype = ex.to_example(RawItem("train", "f", 0, np.zeros((2, 2, 1), np.float32)))
    assert wrong_dtype.reason == "undecodable"


def test_to_example_same_pixels_same_id_regardless_of_container():
    img = np.random.default_rng(1).integers(0, 256, (6, 6, 3), dtype=np.uint8)
    from_png = ex.to_example(RawItem("train", "a.png", 2, _encoded(img, "PNG")))
    from_array = ex.to_example(RawItem("train", "b", 2, img))
    assert from_png.id == from_array.id
    other = ex.to_example(RawItem("train", "c", 2, img[::-1].copy()))
    assert other.id != from_png.id


def test_majority_shape_and_check():
    counts = [((4, 4, 3), 10), ((4, 4, 1), 2), ((8, 8, 3), 10)]
    assert ex.majority_shape(counts) == (4, 4, 3)  # tie broken by the smaller shape
    assert ex.majority_shape([]) is None
    good, bad = _example(0, shape=(4, 4, 3)), _example(1, shape=(4, 4, 1))
    assert ex.check_shape(good, (4, 4, 3)) is good
    rejected = ex.check_shape(bad, (4, 4, 3))
    assert rejected.reason == "wrong_shape" and "(4, 4, 1)" in rejected.detail


def test_validation_assignment_by_content_fraction_and_only_from_train():
    items = [_example(i) for i in range(2000)]
    moved = [ex.assign_validation(e, 0.1) for e in items]
    share = sum(e.split == "validation" for e in moved) / len(items)
    assert 0.08 < share < 0.12
    assert [e.split for e in moved] == [ex.assign_validation(e, 0.1).split for e in items[::-1]][::-1]
    assert ex.assign_validation(_example(3, split="test"), 0.99).split == "test"
    assert all(ex.assign_validation(e, 0.0).split == "train" for e in items[:50])


def test_combined_hash_is_order_independent_and_sensitive():
    items = [_example(i, label=i % 3) for i in range(20)]
    terms = [ex.element_hash(e.split, e.label, e.digest) for e in items]
    assert ex.combine_hashes(terms) == ex.combine_hashes(terms[::-1])
    assert ex.combine_hashes(terms) != ex.combine_hashes(terms[:-1])
    assert ex.combine_hashes(terms) != ex.combine_hashes(terms + terms[:1])  # duplicates count
    relabelled = ex.element_hash("train", 2, items[0].digest)
    assert ex.combine_hashes([relabelled] + terms[1:]) != ex.combine_hashes(terms)


@pytest.mark.parametrize("encoding", ["raw", "png"])
@pytest.mark.parametrize("shape", [(4, 5, 3), (7, 3, 1)])
def test_record_round_trip(encoding, shape):
    e = _example(5, label=7, shape=shape)
    e = ex.Example("train", "train/cat/ü.png", 7, e.image, e.digest)
    record = ex.encode_record(e, encoding=encoding)
    back = ex.decode_record(record, split="train")
    np.testing.assert_array_equal(back.image, e.image)
    assert (back.label, back.key, back.digest) == (7, e.key, e.digest)
    assert ex.record_label(record) == 7 and ex.record_digest(record) == e.digest


def test_decode_record_rejects_foreign_bytes():
    with pytest.raises(ValueError):
        ex.decode_record(b"X" * 64)


def test_shard_index_uses_content():
    e = _example(9)
    assert ex.shard_index(e, 4) == ex.shard_index(ex.Example("test", "other", 1, e.image, e.digest), 4)
    assert {ex.shard_index(_example(i), 4) for i in range(50)} == {0, 1, 2, 3}


def test_process_task_batches_by_shard_and_counts_everything(tmp_path):
    from dpscale.data.raw_items import ReadTask

    good = [_encoded(_image, "PNG") for _image in (np.full((3, 3, 3), v, np.uint8) for v in range(6))]
    for i, data in enumerate(good):
        (tmp_path / f"{i}.png").write_bytes(data)
    (tmp_path / "bad.png").write_bytes(b"nope")
    members = tuple(("train", "x", f"{i}.png") for i in range(6)) + (("train", "x", "bad.png"),)
    task = ReadTask("files", path=str(tmp_path), members=members)
    out = ex.process_task(
        task, ["x"], validation_fraction=0.5, shards_per_split={"train": 2, "validation": 1}, encoding="raw"
    )
    assert out.shape_counts == {(3, 3, 3): 6}
    assert [r.key for r in out.rejections] == ["bad.png"]
    flat = [e for batch in out.batches.values() for e in batch]
    assert len(flat) == 6 and {e.split for e in flat} <= {"train", "validation"}
    for (split, shard), batch in out.batches.items():
        assert all(e.split == split and ex.shard_index(e, 2 if split == "train" else 1) == shard for e in batch)
    back = ex.decode_record(flat[0].record)
    assert back.digest == flat[0].digest and back.shape == (3, 3, 3)
