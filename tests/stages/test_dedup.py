"""End to end on tiny synthetic data: planted copies go, unrelated images stay."""

import hashlib
import io
import json
import os

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from dpscale.cli import cli
from dpscale.data.dataset import IngestedDataset
from dpscale.dedup import output
from dpscale.errors import DataError, InvalidConfigError
from dpscale.stages import dedup as stage
from dpscale.stages.ingest import IngestConfig
from dpscale.stages.ingest import run as ingest

FAST = ("--runner=FnApiRunner", "--direct_num_workers=1", "--direct_running_mode=in_memory")


def jpeg_roundtrip(image: np.ndarray, quality: int) -> np.ndarray:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=quality)
    return np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))


def shift(image: np.ndarray, dx: int, dy: int) -> np.ndarray:
    """Translate by whole pixels; the new border repeats the edge (as a re-crop would)."""
    padded = np.pad(image, ((2, 2), (2, 2), (0, 0)), mode="edge")
    h, w = image.shape[:2]
    return padded[2 - dy : 2 - dy + h, 2 - dx : 2 - dx + w].copy()


def smooth_image(seed: int, size: int = 32) -> np.ndarray:
    """A random smooth colour image (bicubic-upsampled 5x5 noise): structure at all scales."""
    low = np.random.default_rng(seed).integers(0, 256, (5, 5, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(low).resize((size, size), Image.Resampling.BICUBIC))


def crop_rescale(image: np.ndarray, *, left: int, top: int, side: int) -> np.ndarray:
    h, w = image.shape[:2]
    crop = Image.fromarray(image[top : top + side, left : left + side])
    return np.asarray(crop.resize((w, h), Image.Resampling.BICUBIC))


PLANTED = {  # name -> transform of a private image
    "exact": lambda im: im,
    "flip": lambda im: im[:, ::-1].copy(),
    "crop": lambda im: crop_rescale(im, left=3, top=1, side=27),
    "jpeg": lambda im: jpeg_roundtrip(im, 75),
    "flip_crop_jpeg": lambda im: jpeg_roundtrip(crop_rescale(im[:, ::-1], left=1, top=2, side=28), 75),
    "shift_colour": lambda im: np.clip(shift(im, 2, -1) * np.array([1.1, 0.95, 1.0]) + 12, 0, 255).astype(np.uint8),
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
    return (
        _ingest(root / "public_src", root / "public"),
        _ingest(root / "private_src", root / "private"),
        planted,
        root,
    )


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
    assert res.report["num_private_matched"] == len(PLANTED)


def test_report_is_a_private_diagnostic_listing_pairs_distances_and_views(data, result):
    public, private, _, root = data
    res, _ = result
    path = root / "out" / "dedup_report.NOT-PRIVATE.json"
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    report = json.loads(path.read_text())
    assert report == res.report and res.report_path == str(path)
    assert report["settings"]["threshold"] == 0.12 and "correlation" in report["method"]
    assert "content_hash" not in report["private"]  # no hash of the private data
    assert report["public"]["splits"] == ["train"] and report["private"]["splits"] == ["test"]
    assert report["public"]["num_examples"] == len(PLANTED) + 24
    assert report["num_candidate_pairs"] >= len(PLANTED)
    by_key = {p["public_key"]: p for p in report["removed"]}
    assert by_key["train/a/planted_exact.png"]["distance"] < 1e-3
    assert by_key["train/a/planted_flip.png"]["view"].endswith("mirrored")
    ids = IngestedDataset(public).examples("train", [by_key["train/a/planted_exact.png"]["public_index"]])
    assert ids[0].id == by_key["train/a/planted_exact.png"]["public_id"]
    for p in report["removed"]:
        if p["decided_by"] == "grid":
            assert 0 <= p["distance"] <= 0.12 and p["refined_ecc_distance"] is None
        else:
            assert p["decided_by"] == "refined" and p["refined_detail_distance"] <= 0.2
        assert p["private_split"] == "test" and p["similarity"] >= 0.8

    def no_infinity(name):
        raise AssertionError(f"{name} in the report: not JSON")

    json.loads(path.read_text(), parse_constant=no_infinity)
    for p in report["near_threshold_rejected"]:
        assert 0.12 < p["distance"] <= 0.24
    assert report["settings"]["refine"] is True and report["settings"]["opencv"]
    assert res.manifest.dedup.refine is True


def test_a_refined_pair_is_reported_with_null_grid_distance_and_its_own_distances(data):
    from dpscale.dedup.join import Candidate, Match

    public, private, planted, _ = data
    pub, priv = IngestedDataset(public), IngestedDataset(private)
    m = Match(
        Candidate("train", 0, 0, "test", 0, 6, 0.9),
        float("inf"),
        float("inf"),
        True,
        ecc_distance=0.02,
        rank_distance=0.03,
        detail_distance=0.15,
    )
    pair = output._pair(m, pub, priv)
    assert pair["decided_by"] == "refined" and pair["distance"] is None
    assert pair["coarse_distance"] is None and pair["refined_detail_distance"] == 0.15
    assert pair["refined_rank_distance"] == 0.03 and pair["refined_ecc_distance"] == 0.02
    assert pair["view"] == "whole mirrored"
    json.dumps(pair, allow_nan=False)


def test_no_refine_is_passed_through_to_the_verification_and_recorded(data, tmp_path):
    public, private, _, _ = data
    res = stage.run(stage.DedupConfig(public, private, str(tmp_path / "plain"), refine=False, pipeline_args=FAST))
    assert res.report["settings"]["refine"] is False and "opencv" not in res.report["settings"]
    assert res.manifest.dedup.refine is False
    assert all(
        p["decided_by"] == "grid" and p["refined_ecc_distance"] is None
        for p in res.report["removed"] + res.report["near_threshold_rejected"]
    )
    runner = CliRunner().invoke(cli, ["dedup", public, private, str(tmp_path / "cli"), "--no-refine", *FAST])
    assert runner.exit_code == 0, runner.output
    manifest = json.loads((tmp_path / "cli" / "manifest.json").read_text())
    assert manifest["dedup"]["refine"] is False


def test_output_is_an_ingested_dataset_without_the_copies(data, result):
    public, _, _, root = data
    res, _ = result
    out = IngestedDataset(str(root / "out"))
    src = IngestedDataset(public)
    assert out.num_examples("train") == 24 and out.class_names == src.class_names
    assert out.image_shape == src.image_shape
    assert out.content_hash != src.content_hash and out.manifest.dedup.num_removed == len(PLANTED)
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
    with pytest.raises(InvalidConfigError, match="k must"):
        stage.DedupConfig("/a", "/b", "/c", k=0)
    with pytest.raises(InvalidConfigError, match="max pages"):
        stage.DedupConfig("/a", "/b", "/c", max_pages=0)
    with pytest.raises(InvalidConfigError, match="crowded fraction"):
        stage.DedupConfig("/a", "/b", "/c", crowded_fraction=0.0)


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
    assert "NOT-PRIVATE" in ok.output and "removed" not in ok.output  # the count is private


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
    res = stage.run(
        stage.DedupConfig(
            both, both, str(tmp_path / "out"), public_splits=("train",), private_splits=("test",), pipeline_args=FAST
        )
    )
    assert [(p["public_key"], p["private_key"]) for p in res.report["removed"]] == [
        ("train/a/copy.png", "test/a/p1.png")
    ]
    out = IngestedDataset(str(tmp_path / "out"))
    assert out.splits == ["train"] and out.num_examples("train") == 5
    assert res.report["private"]["num_examples"] == 3
    with pytest.raises(DataError, match="split 'valid'"):
        stage.run(
            stage.DedupConfig(
                both,
                both,
                str(tmp_path / "o2"),
                public_splits=("train",),
                private_splits=("valid",),
                pipeline_args=FAST,
            )
        )


def test_an_output_emptied_by_dedup_is_refused_by_train_in_one_line(tmp_path):
    """Every public image a copy of a private one: dedup writes an empty dataset; training on it
    is one line naming the split, not an error from deep in the sampler."""
    root = tmp_path / "src"
    for i in range(3):
        image = smooth_image(4000 + i)
        _save(root, "test", "a", f"p{i}", image)
        _save(root, "train", "a", f"copy{i}", image)
    both = _ingest(root, tmp_path / "both")
    res = stage.run(
        stage.DedupConfig(
            both, both, str(tmp_path / "out"), public_splits=("train",), private_splits=("test",), pipeline_args=FAST
        )
    )
    assert res.num_kept == 0 and IngestedDataset(str(tmp_path / "out")).num_examples("train") == 0
    refused = CliRunner().invoke(
        cli, ["train", str(tmp_path / "out"), str(tmp_path / "run"), "--epsilon", "1", "--steps", "2"]
    )
    assert refused.exit_code == 2, refused.output
    lines = refused.output.strip().splitlines()
    assert "Traceback" not in refused.output and "holds no examples" in lines[-1] and "'train'" in lines[-1]


def test_verification_keeps_copies_and_rejects_unrelated_pairs(data):
    from dpscale.dedup.join import Candidate, verify_candidates

    public, private, planted, _ = data
    pub, priv = IngestedDataset(public), IngestedDataset(private)
    pub_index = {e.key: i for i, e in enumerate(pub.examples("train", range(len(pub))))}
    priv_index = {e.key: i for i, e in enumerate(priv.examples("test", range(len(priv))))}
    target = priv_index[planted["train/a/planted_jpeg.png"]]
    copy = Candidate("train", pub_index["train/a/planted_jpeg.png"], 0, "test", target, 0, 0.9)
    wrong = Candidate("train", pub_index["train/b/other1.png"], 0, "test", target, 0, 0.8)
    kept, rejected = verify_candidates([copy, wrong], pub, priv, threshold=0.12)
    assert kept.accepted and 0 <= kept.fine_distance < 0.12
    assert not rejected.accepted and rejected.fine_distance > 0.12


def test_a_runner_that_lost_data_fails_loudly(data, tmp_path):
    """Lost descriptors or candidates would remove nothing and look fine: counts refuse that."""
    from dpscale.dedup.method import Method

    public, private, _, _ = data
    common = dict(
        public_path=public,
        private_path=private,
        output_dir=str(tmp_path),
        summaries=[],
        removed=[],
        matches=[],
        near=[],
        method=Method(),
        num_public=len(PLANTED) + 24,
        num_private=len(PLANTED) + 2,
        public_splits=["train"],
        private_splits=["test"],
    )
    with pytest.raises(RuntimeError, match="lost or duplicated"):
        output.write_outputs(
            None,
            described={"public": len(PLANTED) + 24, "private": 0},
            num_candidates=0,
            num_verified=0,
            num_skipped=0,
            num_expanded=0,
            **common,
        )
    with pytest.raises(RuntimeError, match="lost or duplicated"):
        output.write_outputs(
            None,
            described={"public": len(PLANTED) + 24, "private": len(PLANTED) + 2},
            num_candidates=10,
            num_verified=8,
            num_skipped=1,
            num_expanded=0,
            **common,
        )
    assert not (tmp_path / "manifest.json").exists()


def test_progress_covers_verification_and_counts_only_planned_rows(data, tmp_path, monkeypatch, caplog):
    """Progress runs to exactly 100% through neighbours and verification, in planned units it names."""
    import logging

    from dpscale.pipelines import dedup as graph
    from dpscale.pipelines import progress, runner

    finished = {}

    class Recording(progress.LocalProgress):
        def __exit__(self, *exc):
            finished["done"], finished["total"] = progress._done(self.directory), self.total
            finished["label"] = self.label
            super().__exit__(*exc)

    caplog.set_level(logging.INFO, logger=stage.log.name)

    monkeypatch.setattr(runner, "LocalProgress", Recording)
    monkeypatch.setattr(stage, "PRIVATE_PER_VERIFY_TASK", 3)  # several verification blocks
    public, private, _, _ = data
    stage.run(stage.DedupConfig(public, private, str(tmp_path / "out"), examples_per_task=4, pipeline_args=FAST))
    num_public, num_private = len(PLANTED) + 24, len(PLANTED) + 2
    # the total is fixed by the image counts, not by how many candidates the private data yields
    assert finished["total"] == graph.progress_total(num_public, num_private, k=10)
    assert finished["done"] == finished["total"]
    # the unit is named: on the bar, and item by item when the run begins (the "11653/11653" said neither)
    assert finished["label"] == "dedup: images described + private images searched + pairs verified"
    total = finished["total"]
    assert (
        f"progress counts {total:,} items: {num_public + num_private:,} images described, {num_private:,} "
        f"private images searched and {10 * num_private:,} candidate pairs verified"
    ) in caplog.text


def test_verification_blocks_and_public_positions_are_planned_from_counts(data):
    from dpscale.dedup import planning

    public, private, _, _ = data
    blocks = planning.verify_blocks(IngestedDataset(private), ["test"], per_block=3)
    assert blocks == [(("test", 0), 3), (("test", 1), 3), (("test", 2), 2)]
    tasks = planning.read_tasks(IngestedDataset(public), "public", 7, ["train"])
    positions = planning.public_positions(tasks)
    assert [positions[t.name] for t in tasks] == [0, 7, 14, 21, 28][: len(tasks)]


def test_a_photo_held_many_times_in_public_is_removed_every_time(tmp_path):
    """25 copies of one private image: the first 10 crowd page 1, so pages 2 and 3 follow."""
    root = tmp_path / "src"
    private = [smooth_image(4000 + i) for i in range(3)]
    for i, im in enumerate(private):
        _save(root, "test", "a", f"p{i}", im)
    for c in range(25):
        _save(root, "train", "a", f"copy{c:02d}", private[0])
    _save(root, "train", "a", "single", PLANTED["jpeg"](private[1]))
    for j in range(8):
        _save(root, "train", "a", f"other{j}", smooth_image(5000 + j))
    both = _ingest(root, tmp_path / "both")

    def removed(**kw):
        res = stage.run(
            stage.DedupConfig(
                both,
                both,
                str(tmp_path / f"out{len(kw)}"),
                public_splits=("train",),
                private_splits=("test",),
                pipeline_args=FAST,
                **kw,
            )
        )
        return res, sorted((p["public_key"], p["private_key"]) for p in res.report["removed"])

    res, pairs = removed()
    assert pairs == sorted(
        [(f"train/a/copy{c:02d}.png", "test/a/p0.png") for c in range(25)] + [("train/a/single.png", "test/a/p1.png")]
    )
    assert res.report["num_private_expanded"] == 1
    assert res.report["num_verified_pairs"] <= res.report["num_candidate_pairs"]
    assert IngestedDataset(str(tmp_path / "out0")).num_examples("train") == 8
    res, pairs = removed(max_pages=1)  # k only (the behaviour before expansion)
    assert len(pairs) == 11 and res.report["num_private_expanded"] == 0


def test_a_private_image_whose_twin_is_credited_to_another_still_counts_as_matched(tmp_path):
    """Two private images hold the same photo; its one public copy is listed once, both match."""
    root = tmp_path / "src"
    photo = smooth_image(6000)
    _save(root, "test", "a", "p0", photo)
    _save(root, "test", "a", "p1", PLANTED["jpeg"](photo))
    _save(root, "test", "a", "p2", smooth_image(6001))
    _save(root, "train", "a", "copy", PLANTED["shift_colour"](photo))
    for j in range(6):
        _save(root, "train", "a", f"other{j}", smooth_image(7000 + j))
    both = _ingest(root, tmp_path / "both")
    res = stage.run(
        stage.DedupConfig(
            both, both, str(tmp_path / "out"), public_splits=("train",), private_splits=("test",), pipeline_args=FAST
        )
    )
    assert [p["public_key"] for p in res.report["removed"]] == ["train/a/copy.png"]
    assert res.report["num_private_matched"] == 2
    keys = {
        ex.key for p in res.report["private_matched"] for ex in IngestedDataset(both).examples("test", [p["index"]])
    }
    assert keys == {"test/a/p0.png", "test/a/p1.png"}


def test_a_removed_pair_missing_from_the_matched_private_images_is_refused(data, tmp_path):
    from dpscale.dedup.join import Candidate, Match
    from dpscale.dedup.method import Method

    public, private, _, _ = data
    match = Match(Candidate("train", 0, 0, "test", 1, 0, 0.9), 0.01, 0.01, True)
    removed = [{"split": "train", "index": 0, "id": "x", "key": "k"}]
    with pytest.raises(RuntimeError, match="matched private images"):
        output.write_outputs(
            None,
            public_path=public,
            private_path=private,
            output_dir=str(tmp_path),
            summaries=[],
            removed=removed,
            matches=[match],
            near=[],
            described={"public": 30, "private": 8},
            num_candidates=0,
            num_verified=0,
            num_skipped=0,
            num_expanded=0,
            method=Method(),
            num_public=30,
            num_private=8,
            public_splits=["train"],
            private_splits=["test"],
            matched_private=[("test", 2)],
        )


@pytest.fixture(scope="module")
def copy_models(data):
    """Tiny copy models (1 step): on the public data, and, wrongly, on a dataset that holds the
    private images again under another path, split and class, beside some public ones."""
    from dpscale.stages import train_copy_model

    public, private, _, root = data
    for i, path in enumerate(sorted((root / "private_src" / "test").glob("*/*.png"))):
        _save(root / "mixed_src", "pretrain", "zz", f"copied{i}", np.asarray(Image.open(path)))
    for j in range(4):
        _save(root / "mixed_src", "pretrain", "zz", f"other{j}", smooth_image(j))
    mixed = _ingest(root / "mixed_src", root / "mixed")
    out = {}
    for name, source in (("public", public), ("private", mixed)):
        res = train_copy_model.run(
            train_copy_model.TrainCopyModelConfig(
                source, str(root / f"copy_{name}"), epochs=1, batch=8, show_progress=False
            )
        )
        out[name] = res.output_dir
    return out


def test_the_copy_decision_removes_what_it_accepts_after_the_pixel_checks(data, copy_models):
    public, private, planted, root = data
    res = stage.run(
        stage.DedupConfig(
            public,
            private,
            str(root / "out_copy_all"),
            copy_model=copy_models["public"],
            copy_cut=-3.9,
            pipeline_args=FAST,
        )
    )
    by = {p["public_key"]: p["decided_by"] for p in res.report["removed"]}
    # each private image's 20 nearest public images all pass the cut: at least 20 of the 30 go;
    # the planted copies are still credited to the pixel checks (preferred), the rest to copy
    assert len(by) >= 20 and res.num_kept == 30 - len(by)
    assert {k for k, v in by.items() if v != "copy"} == set(planted)
    copy_pairs = [p for p in res.report["removed"] if p["decided_by"] == "copy"]
    assert all(
        p["copy_score"] >= -3.9 and p["distance"] is None and p["view"] in ("whole", "whole mirrored")
        for p in copy_pairs
    )
    decision = res.report["copy_decision"]
    assert decision["num_removed"] == len(by) - len(planted) and decision["model"]["public"]["content_hash"]
    assert res.manifest.dedup.copy_cut == -3.9 and len(res.manifest.dedup.copy_model_sha256) == 64
    assert res.manifest.dedup.copy_local_weight == 2.0  # the default
    assert IngestedDataset(str(root / "out_copy_all")).manifest.dedup.copy_cut == -3.9


def test_the_local_weight_enters_the_copy_scores_the_report_and_the_manifest(data, copy_models):
    public, private, _, root = data
    runs = {
        w: stage.run(
            stage.DedupConfig(
                public,
                private,
                str(root / f"out_copy_local{w}"),
                copy_cut=1.9 + w,
                copy_model=copy_models["public"],
                copy_local_weight=w,
                pipeline_args=FAST,
            )
        )
        for w in (0.0, 2.0)
    }
    near = {
        w: {
            (p["private_key"], p["public_key"]): p["copy_score"] for p in r.report["copy_decision"]["near_cut_rejected"]
        }
        for w, r in runs.items()
    }
    # the private images' best pairs move with their local agreement: not all by one amount
    shared = sorted(set(near[0.0]) & set(near[2.0]))
    assert shared and len({round(near[2.0][p] - near[0.0][p], 4) for p in shared}) > 1
    for w, r in runs.items():
        assert r.manifest.dedup.copy_local_weight == w and r.report["settings"]["copy"]["local_weight"] == w
    assert IngestedDataset(str(root / "out_copy_local2.0")).manifest.dedup.copy_local_weight == 2.0


def test_a_copy_cut_nothing_reaches_changes_nothing_and_lists_the_closest(data, result, copy_models):
    public, private, _, root = data
    res = stage.run(
        stage.DedupConfig(
            public,
            private,
            str(root / "out_copy_none"),
            copy_model=copy_models["public"],
            copy_cut=3.9,
            pipeline_args=FAST,
        )
    )
    assert [p["public_key"] for p in res.report["removed"]] == [p["public_key"] for p in result[0].report["removed"]]
    near = res.report["copy_decision"]["near_cut_rejected"]
    assert len(near) == 8 and near == sorted(near, key=lambda p: -p["copy_score"])
    assert result[0].report["copy_decision"] is None and result[0].manifest.dedup.copy_cut is None


def test_a_copy_model_of_the_private_data_or_none_at_all_is_refused(data, copy_models, tmp_path):
    public, private, _, _ = data
    # 8 private images re-ingested elsewhere: 7 refused; the planted exact copy is also in this
    # run's public set (dedup removes it), so having trained on it is allowed
    with pytest.raises(DataError, match="trained on 7 of the private images"):
        stage.run(
            stage.DedupConfig(
                public, private, str(tmp_path / "o"), copy_model=copy_models["private"], pipeline_args=FAST
            )
        )
    assert not (tmp_path / "o").exists()
    with pytest.raises(InvalidConfigError, match="give --copy-model too"):
        stage.DedupConfig(public, private, str(tmp_path / "o"), copy_cut=0.3)
    with pytest.raises(InvalidConfigError, match="give --copy-model too"):
        stage.DedupConfig(public, private, str(tmp_path / "o"), copy_local_weight=1.0)
    with pytest.raises(InvalidConfigError, match="copy cut"):
        stage.DedupConfig(public, private, str(tmp_path / "o"), copy_model="m", copy_cut=3.5, copy_local_weight=1.0)
    bad = CliRunner().invoke(
        cli, ["dedup", public, private, str(tmp_path / "o2"), "--copy-model", str(tmp_path / "nothing")]
    )
    assert bad.exit_code == 2 and bad.output.count("\n") == 1 and "holds no copy model" in bad.output


def test_an_existing_output_is_refused_before_the_copy_decision_runs(data, result, copy_models, monkeypatch):
    from dpscale.dedup import copy_decision

    public, private, _, root = data

    def never(*args, **kwargs):
        raise AssertionError("the copy decision ran before the output was checked")

    monkeypatch.setattr(copy_decision, "decide", never)
    with pytest.raises(DataError, match="overwrite"):
        stage.run(
            stage.DedupConfig(public, private, str(root / "out"), copy_model=copy_models["public"], pipeline_args=FAST)
        )


def test_the_copy_decision_maps_pairs_to_the_right_public_shard(data, copy_models, tmp_path):
    """A public set in shards of 7: every copy pair must land in its own shard's filter."""
    _, private, _, root = data
    sharded = str(tmp_path / "public7")
    ingest(IngestConfig(f"folder:{root / 'public_src'}", sharded, examples_per_shard=7, pipeline_args=FAST))
    assert len(IngestedDataset(sharded).manifest.splits["train"].shards) == 5
    res = stage.run(
        stage.DedupConfig(
            sharded, private, str(tmp_path / "out"), copy_model=copy_models["public"], copy_cut=-3.9, pipeline_args=FAST
        )
    )
    copied = [p for p in res.report["removed"] if p["decided_by"] == "copy"]
    assert len(copied) >= 14 and res.num_kept + res.num_removed == 30
    kept = IngestedDataset(str(tmp_path / "out"))
    assert kept.num_examples("train") == res.num_kept


def test_the_copy_decision_names_the_public_image_it_scored(data, copy_models, tmp_path, caplog):
    """Two public splits (given out of name order) in shards of 4, an exact copy of a private image
    in the second: its best pair must name that very record, in the shard that holds it."""
    from dpscale.dedup import copy_decision
    from dpscale.dedup.copy_score import CopySettings
    from dpscale.dedup.planning import shard_ranges

    _, private, _, _ = data
    priv = IngestedDataset(private)
    # p0: the model trained on its exact copy (in the module's public set) may score it only
    # when this public set holds that copy too
    index, target = next(
        (i, e)
        for i, e in enumerate(priv.examples("test", range(priv.num_examples("test"))))
        if e.key == "test/b/p0.png"
    )
    for j in range(6):
        _save(tmp_path / "src", "test", "x", f"other{j}", smooth_image(50 + j))
    _save(tmp_path / "src", "test", "x", "exact", target.image)
    for j in range(9):
        _save(tmp_path / "src", "train", "x", f"other{j}", smooth_image(70 + j))
    ingest(IngestConfig(f"folder:{tmp_path / 'src'}", str(tmp_path / "pub"), examples_per_shard=4, pipeline_args=FAST))
    pub = IngestedDataset(str(tmp_path / "pub"))
    splits = ["train", "test"]
    copy_decision.log.addHandler(caplog.handler)  # the CLI may have stopped it from reaching the root logger
    try:
        model = copy_decision.open_model(copy_models["public"], pub, splits, priv, ["test"])
    finally:
        copy_decision.log.removeHandler(caplog.handler)
    assert "trained on 29 images that are not in this run's public data" in caplog.text
    outcome = copy_decision.decide(pub, splits, priv, ["test"], model, CopySettings(cut=-3.9), show_progress=False)
    mine = [
        m.candidate
        for m in outcome.accepted
        if (m.candidate.private_split, m.candidate.private_index) == ("test", index)
    ]
    best = max(mine, key=lambda c: c.similarity)
    assert best.similarity > 0.9999 and best.public_split == "test"
    assert pub.examples("test", [best.public_index])[0].key == "test/x/exact.png"
    start, end, _ = shard_ranges(pub, splits)[("test", best.public_shard)]
    assert start <= best.public_index < end and len(pub.manifest.splits["test"].shards) >= 2
    # every accepted pair's shard holds its index
    ranges = shard_ranges(pub, splits)
    assert all(
        ranges[(c.public_split, c.public_shard)][0] <= c.public_index < ranges[(c.public_split, c.public_shard)][1]
        for c in (m.candidate for m in outcome.accepted)
    )


def test_the_copy_decision_embeds_images_of_any_size_as_the_model_does(copy_models, tmp_path):
    """40-px images are resized once for both mirror states; the embeddings are the model's own."""
    from dpscale.dedup import copy_decision, copy_model

    images = [smooth_image(90 + j, size=40) for j in range(3)]
    for j, im in enumerate(images):
        _save(tmp_path / "src", "train", "x", f"im{j}", im)
    ds = IngestedDataset(_ingest(tmp_path / "src", tmp_path / "big"))
    stored = np.asarray(ds.get("train", np.arange(3))[0])
    assert stored.shape == (3, 40, 40, 3)
    params = copy_model.load(copy_models["public"]).params
    plain, mirrored, where, thumbs = copy_decision._embed(ds, ["train"], params, "embed", False, True)
    np.testing.assert_array_equal(thumbs, copy_model.thumbnails(stored))  # what the local agreement sees
    np.testing.assert_allclose(plain, copy_model.embed(params, stored), atol=1e-6)
    np.testing.assert_allclose(mirrored, copy_model.embed(params, stored, mirrored=True), atol=1e-6)
    assert where == [("train", 0), ("train", 1), ("train", 2)]
