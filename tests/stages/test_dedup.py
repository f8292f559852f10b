"""End to end on tiny synthetic data: planted copies go, unrelated images stay."""

import hashlib
import json
import os

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from dpscale.cli import cli
from dpscale.data.dataset import IngestedDataset
from dpscale.dedup import output
from dpscale.dedup.image_hash import HashConfig, jpeg_roundtrip
from dpscale.errors import DataError, InvalidConfigError
from dpscale.stages import dedup as stage
from dpscale.stages.ingest import IngestConfig
from dpscale.stages.ingest import run as ingest

FAST = ("--runner=FnApiRunner", "--direct_num_workers=1", "--direct_running_mode=in_memory")


def smooth_image(seed: int, size: int = 32) -> np.ndarray:
    """A random smooth colour image (bicubic-upsampled 5x5 noise): structure at all scales."""
    low = np.random.default_rng(seed).integers(0, 256, (5, 5, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(low).resize((size, size), Image.Resampling.BICUBIC))


def crop_rescale(image: np.ndarray, *, left: int, top: int, side: int) -> np.ndarray:
    h, w = image.shape[:2]
    crop = Image.fromarray(image[top:top + side, left:left + side])
    return np.asarray(crop.resize((w, h), Image.Resampling.BICUBIC))


PLANTED = {  # name -> transform of a private image
    "exact": lambda im: im,
    "flip": lambda im: im[:, ::-1].copy(),
    "crop": lambda im: crop_rescale(im, left=3, top=1, side=27),
    "jpeg": lambda im: jpeg_roundtrip(im, 75),
    "flip_crop_jpeg": lambda im: jpeg_roundtrip(crop_rescale(im[:, ::-1], left=1, top=2,
                                                             side=28), 75),
}


def _save(root, split, cls, name, image) -> None:
    path = root / split / cls / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path)


def _ingest(root, out):
    ingest(IngestConfig(f"folder:{root}", str(out), pipeline_args=FAST))
    return str(out)


def _tree_hash(path) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        h.update(name.encode() + open(os.path.join(path, name), "rb").read())
    return h.hexdigest()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("dedup")
    private = [smooth_image(1000 + i) for i in range(len(PLANTED) + 2)]
    for i, im in enumerate(private):
        _save(root / "private_src", "test", "a" if i % 2 else "b", f"p{i}", im)
    planted = {}
    for i, (name, transform) in enumerate(PLANTED.items()):
        _save(root / "public_src", "train", "a", f"planted_{name}", transform(private[i]))
        planted[f"train/a/planted_{name}.png"] = f"test/{'a' if i % 2 else 'b'}/p{i}.png"
    for j in range(24):
        _save(root / "public_src", "train", "b" if j % 3 else "a", f"other{j}", smooth_image(j))
    return (_ingest(root / "public_src", root / "public"),
            _ingest(root / "private_src", root / "private"), planted, root)


@pytest.fixture(scope="module")
def result(data):
    public, private, _, root = data
    before = _tree_hash(private)
    res = stage.run(stage.DedupConfig(public, private, str(root / "out"), pipeline_args=FAST))
    return res, before


def test_every_planted_copy_is_removed_and_nothing_else(data, result):
    _, _, planted, _ = data
    res, _ = result
    removed = {p["public_key"]: p["private_key"] for p in res.report["removed"]}
    assert removed == planted  # recall 5/5, and none of the 24 unrelated images
    assert res.num_removed == len(PLANTED) and res.num_kept == 24


def test_report_lists_pairs_distances_threshold_and_method(data, result):
    public, private, _, root = data
    res, _ = result
    report = json.loads((root / "out" / "dedup_report.json").read_text())
    assert report == res.report
    assert report["threshold"] == HashConfig().threshold and "DCT" in report["method"]
    assert "content_hash" not in report["private"]  # a plain hash of the private data answers membership
    assert report["public"]["num_examples"] == len(PLANTED) + 24
    assert report["num_candidate_pairs"] >= len(PLANTED)
    by_key = {p["public_key"]: p for p in report["removed"]}
    assert by_key["train/a/planted_exact.png"]["distance"] < 1e-3
    assert by_key["train/a/planted_flip.png"]["view"].startswith("flip+")
    assert by_key["train/a/planted_flip.png"]["distance"] < 1e-2
    ids = IngestedDataset(public).examples("train", [by_key["train/a/planted_exact.png"]
                                                     ["public_index"]])
    assert ids[0].id == by_key["train/a/planted_exact.png"]["public_id"]
    assert by_key["train/a/planted_exact.png"]["public_id"] == by_key[
        "train/a/planted_exact.png"]["private_id"]  # same pixels, same content id
    for p in report["removed"]:
        assert 0 <= p["distance"] <= report["threshold"] and p["private_split"] == "test"
        assert 0 <= p["fine_distance"] <= report["verify_threshold"]
    assert report["num_rejected_by_verification"] >= 0


def test_output_is_an_ingested_dataset_without_the_copies(data, result):
    public, _, _, root = data
    res, _ = result
    out = IngestedDataset(str(root / "out"))
    src = IngestedDataset(public)
    assert out.num_examples("train") == 24 and out.class_names == src.class_names
    assert out.image_shape == src.image_shape
    assert out.content_hash != src.content_hash and out.manifest.dedup.num_removed == 5
    keys = {e.key for e in out.examples("train", range(24))}
    assert keys == {f"train/{'b' if j % 3 else 'a'}/other{j}.png" for j in range(24)}
    images, labels = out.get("train", [0, 23])
    assert images.shape == (2, 32, 32, 3) and labels.dtype == np.int32
    kept = {e.id: e for e in src.examples("train", range(len(src)))}
    for e in out.examples("train", range(24)):
        np.testing.assert_array_equal(e.image, kept[e.id].image)


def test_private_data_is_untouched(data, result):
    _, private, _, _ = data
    _, before = result
    assert _tree_hash(private) == before


def test_existing_output_is_refused_without_overwrite(data, result):
    public, private, _, root = data
    with pytest.raises(DataError, match="overwrite"):
        stage.run(stage.DedupConfig(public, private, str(root / "out"), pipeline_args=FAST))


def test_config_errors():
    with pytest.raises(InvalidConfigError, match="different"):
        stage.DedupConfig("/a", "/b", "/a/")
    with pytest.raises(InvalidConfigError, match="disjoint"):
        stage.DedupConfig("/a", "/a/", "/b")
    with pytest.raises(InvalidConfigError, match="disjoint"):
        stage.DedupConfig("/a", "/a", "/b", public_splits=("train",), private_splits=("train",))
    stage.DedupConfig("/a", "/a", "/b", public_splits=("train",), private_splits=("test",))
    with pytest.raises(InvalidConfigError, match="threshold"):
        stage.DedupConfig("/a", "/b", "/c", threshold=1.5)


def test_cli_runs_and_errors_are_one_line_exit_2(data, tmp_path):
    public, private, _, _ = data
    runner = CliRunner()
    missing = runner.invoke(cli, ["dedup", str(tmp_path / "nope"), private, str(tmp_path / "o")])
    assert missing.exit_code == 2
    assert missing.output.count("\n") == 1 and "not an ingested dataset" in missing.output
    bad = runner.invoke(cli, ["dedup", public, private, str(tmp_path / "o"), "--threshold", "3"])
    assert bad.exit_code == 2 and "threshold" in bad.output
    ok = runner.invoke(cli, ["dedup", public, private, str(tmp_path / "o2"), *FAST])
    assert ok.exit_code == 0, ok.output
    assert "removed 5 of 29" in ok.output


def test_one_dataset_with_disjoint_splits(tmp_path):
    """train vs test of one ingested dataset: only train is written, test is the private side."""
    root = tmp_path / "src"
    private = [smooth_image(2000 + i) for i in range(3)]
    for i, im in enumerate(private):
        _save(root, "test", "a", f"p{i}", im)
    _save(root, "train", "a", "copy", PLANTED["flip_crop_jpeg"](private[1]))
    for j in range(5):
        _save(root, "train", "a", f"other{j}", smooth_image(3000 + j))
    both = _ingest(root, tmp_path / "both")
    res = stage.run(stage.DedupConfig(both, both, str(tmp_path / "out"), public_splits=("train",),
                                      private_splits=("test",), pipeline_args=FAST))
    assert [(p["public_key"], p["private_key"]) for p in res.report["removed"]] == [
        ("train/a/copy.png", "test/a/p1.png")]
    out = IngestedDataset(str(tmp_path / "out"))
    assert out.splits == ["train"] and out.num_examples("train") == 5
    assert res.report["private"]["num_examples"] == 3
    with pytest.raises(DataError, match="split 'valid'"):
        stage.run(stage.DedupConfig(both, both, str(tmp_path / "o2"), public_splits=("train",),
                                    private_splits=("valid",), pipeline_args=FAST))


def test_verification_keeps_copies_and_rejects_unrelated_pairs(data):
    from dpscale.dedup.image_hash import HashConfig
    from dpscale.dedup.join import Match, verify

    public, private, planted, _ = data
    pub, priv = IngestedDataset(public), IngestedDataset(private)
    pub_index = {e.key: i for i, e in enumerate(pub.examples("train", range(len(pub))))}
    priv_index = {e.key: i for i, e in enumerate(priv.examples("test", range(len(priv))))}
    config = HashConfig()
    copy = Match("train", pub_index["train/a/planted_jpeg.png"], 0, "test",
                 priv_index[planted["train/a/planted_jpeg.png"]], 0, 0.01)
    kept = verify(copy, pub, priv, config)
    assert kept is not None and 0 <= kept.fine_distance < 0.05
    wrong = Match("train", pub_index["train/b/other1.png"], 0, "test",
                  priv_index[planted["train/a/planted_jpeg.png"]], 0, 0.2)
    assert verify(wrong, pub, priv, config) is None
    off = HashConfig(verify_threshold=0.0)
    assert verify(wrong, pub, priv, off) == wrong  # 0 switches the check off


def test_a_runner_that_lost_signatures_fails_loudly(data, tmp_path):
    """Lost signatures would remove nothing and look fine: the row count refuses that."""
    from dpscale.dedup.image_hash import HashConfig

    public, private, _, _ = data
    config = HashConfig()
    with pytest.raises(RuntimeError, match="lost or duplicated"):
        output.write_outputs(None, public_path=public, private_path=private,
                            output_dir=str(tmp_path), summaries=[], removed=[], matches=[],
                            candidates=0, rejected_by_verification=0, config=config,
                            num_public=29, num_private=7,
                            received={"public": 29 * config.bands, "private": 0})
    assert not (tmp_path / "manifest.json").exists()
