"""The copy-embedding experiment: its edits, loss, training loop, search and counting."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dpscale.benchmarks import dedup_copy_embedding as ce


def test_augment_edits_pixels_but_keeps_shape_and_range():
    x = torch.rand(8, 3, 32, 32)
    y = ce.augment(x, torch.Generator().manual_seed(0))
    assert y.shape == x.shape
    assert float(y.min()) >= 0.0 and float(y.max()) <= 1.0
    assert float((y - x).abs().mean()) > 0.01
    # seeded: the same generator state gives the same edits
    assert torch.equal(y, ce.augment(x, torch.Generator().manual_seed(0)))


def test_nt_xent_is_lower_when_each_view_finds_its_partner():
    z = torch.nn.functional.normalize(torch.randn(16, 128), dim=1)
    matched = ce.nt_xent(z, z)
    shuffled = ce.nt_xent(z, z[torch.randperm(16, generator=torch.Generator().manual_seed(1))])
    assert float(matched) < float(shuffled)


def test_koleo_is_lower_for_spread_embeddings_than_for_a_cluster():
    spread = torch.eye(8)
    cluster = torch.nn.functional.normalize(torch.ones(8, 8) + 0.01 * torch.eye(8), dim=1)
    assert float(ce.koleo(spread)) < float(ce.koleo(cluster))


def test_train_writes_weights_that_embed_to_unit_vectors(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (64, 32, 32, 3), dtype=np.uint8)
    info = ce.train(images, str(tmp_path), epochs=1, batch=32, koleo_weight=1.0)
    assert info["images"] == 64 and np.isfinite(info["final_loss"]) and info["koleo_weight"] == 1.0
    assert json.loads((tmp_path / "train.json").read_text())["epochs"] == 1
    e = ce.embed(ce.load(str(tmp_path)), images[:5])
    assert e.shape == (5, 128)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-5)


def test_train_refuses_fewer_images_than_a_batch(tmp_path):
    with pytest.raises(ValueError, match="one batch"):
        ce.train(np.zeros((3, 32, 32, 3), np.uint8), str(tmp_path), epochs=1, batch=4)


def test_recall_table_counts_alone_and_added_to_dedup():
    best = np.array([0.99, 0.91, 0.5, 0.95], np.float32)  # test images 0-3
    table = ce.recall_table(best, block_dup={0, 1, 2}, dedup={2})
    row = table["cosine >= 0.9"]
    assert row == {"matched": 3, "block duplicates found": 2, "added to dedup": 3,
                   "with dedup: matched": 4, "with dedup: block duplicates found": 3}
    assert table["cosine >= 0.96"]["block duplicates found"] == 1
    assert table["dedup"] == {"matched": 1, "block duplicates found": 1}


def test_label_sheet_keeps_its_labels_and_refuses_other_pairs(tmp_path):
    path = str(tmp_path / "sheet.csv")
    ce.write_label_sheet(path, [(5, 7, 0.91, False), (6, 8, 0.95, True)])
    text = (tmp_path / "sheet.csv").read_text().replace("0.9100,0,", "0.9100,0,dup")
    (tmp_path / "sheet.csv").write_text(text)
    ce.write_label_sheet(path, [(5, 7, 0.91, False), (6, 8, 0.95, True)])  # same pairs: kept
    assert "dup" in (tmp_path / "sheet.csv").read_text()
    with pytest.raises(SystemExit, match="other pairs"):
        ce.write_label_sheet(path, [(5, 9, 0.91, False)])


def test_pixel_checks_accept_a_copy_and_reject_an_unrelated_image():
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:32, 0:32]
    scene = np.stack([np.sin(xx / 3.0) * 60 + yy * 3, np.cos(yy / 4.0) * 50 + xx * 2,
                      (xx * yy) % 97], -1) + 80
    scene = np.clip(scene + rng.normal(0, 4, scene.shape), 0, 255).astype(np.uint8)
    other = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    splits = {"train": np.stack([scene, other]),
              "test": np.stack([scene[:, ::-1], scene])}  # a mirrored copy; a pair with nothing in common

    class InMemory:  # the two methods of IngestedDataset that verification reads
        image_shape = scene.shape

        def get(self, split, index):
            return splits[split][np.asarray(index)], None

    accepted = ce.pixel_checks(InMemory(), np.array([0, 1]), np.array([0, 1]), np.array([True, False]))
    assert accepted.tolist() == [True, False]


def ingest_tiny(tmp_path, train: np.ndarray, test: np.ndarray) -> tuple[str, np.ndarray, np.ndarray]:
    """train and test images as an ingested dataset (classes a / b alternating); its path and the
    images in their ingested order."""
    from PIL import Image

    from dpscale.data.dataset import IngestedDataset
    from dpscale.stages.ingest import IngestConfig
    from dpscale.stages.ingest import run as ingest

    for split, images in (("train", train), ("test", test)):
        for i, image in enumerate(images):
            path = tmp_path / "src" / split / ("a" if i % 2 else "b") / f"{i:02d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(path)
    data = str(tmp_path / "data")
    ingest(IngestConfig(f"folder:{tmp_path / 'src'}", data, pipeline_args=(
        "--runner=FnApiRunner", "--direct_num_workers=1", "--direct_running_mode=in_memory")))
    ds = IngestedDataset(data)
    return data, *(np.asarray(ds.get(s, np.arange(len(x)))[0]) for s, x in (("train", train), ("test", test)))


def test_census_and_search_run_end_to_end_on_a_tiny_ingested_set(tmp_path, capsys):
    rng = np.random.default_rng(0)
    train = rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8)
    test = np.concatenate([train[:4, :, ::-1], rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)])
    data, stored_train, stored_test = ingest_tiny(tmp_path, train, test)
    # where the ingested order put the mirrored copy of train[0], and an unrelated test image
    t_copy = next(i for i in range(8) if np.array_equal(stored_test[i], train[0, :, ::-1]))
    j_copy = next(j for j in range(64) if np.array_equal(stored_train[j], train[0]))
    t_other = next(i for i in range(8) if not any(np.array_equal(stored_test[i], x[:, ::-1]) for x in train))
    weights = str(tmp_path / "emb")
    ce.train(train, weights, epochs=1, batch=32)
    labels = tmp_path / "labels.csv"
    labels.write_text(f"rank,test_index,train_index,label,note\n0,{t_copy},{j_copy},dup,\n"
                      f"1,{t_other},{j_copy},diff,\n")
    refined = tmp_path / "refined.csv"
    refined.write_text("sample,position,public_index,private_index,view,label\n"
                       f"s,0,{j_copy},{t_copy},whole mirrored,dup\n")
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"removed": [{"private_index": t_other, "private_split": "test"}]}))
    capsys.readouterr()

    ce.main(["census", data, weights, str(labels), str(refined)])
    table = json.loads(capsys.readouterr().out)["census pairs"]
    assert table["total"] == {"dup": 1, "unsure": 0, "diff": 1}
    assert table["grid + refine"] == {"dup": 1, "unsure": 0, "diff": 0}  # the mirrored copy only

    ce.main(["search", data, weights, str(labels), "--dedup-report", str(report), "--threshold", "0.99",
             "--montage-dir", str(tmp_path)])
    found = json.loads(capsys.readouterr().out)
    assert found["dedup"] == {"matched": 1, "block duplicates found": 0}
    verified = found["nearest by cosine, verified by grid + refine"]
    assert verified["block duplicates found"] == 1 and verified["with dedup: matched"] >= 2
    for name in ("added_0.99", "verified_added"):
        assert (tmp_path / f"dedup_copy_embedding_{name}.png").exists()
        assert (tmp_path / f"dedup_copy_embedding_{name}.csv").read_text().startswith("position,")

    ce.main(["margin", data, weights, str(labels), "--dedup-report", str(report),
             "--montage-dir", str(tmp_path), "--pick", "10:1.0:0", "--judged-until", "2"])
    margins = json.loads(capsys.readouterr().out)
    counted = margins["picked, with dedup, counted with the tail samples"]
    assert counted["tail_dups_sampled"] == 0 and counted["matched"] >= 1  # dedup's own match at least
    assert margins["census pairs"]["grid + refine"] == {"dup": 1, "unsure": 0, "diff": 0}
    assert set(margins["all pairs"]) == {"cosine", *(f"k={k} beta={b}" for k in ce.MARGIN_KS for b in (0.5, 1.0))}
    census = margins["census pairs"]["k=10 beta=1.0"]
    assert census["+0 diff"]["diff"] == 0  # no look-alike allowed: the one `diff` pair stays out
    assert census["+4 diff"] == {"cut": float("-inf"), "dup": 1, "unsure": 0, "diff": 1,  # fewer than allowed
                                 "odd ranks at the even ranks' cut": {"dup": 0, "unsure": 0, "diff": 1}}
    assert margins["all pairs"]["k=10 beta=1.0"]["+4 diff"]["matched"] == 8  # every test image
    assert (tmp_path / "dedup_copy_embedding_margin_k10_beta1.0_0.csv").read_text().startswith(
        "position,test_index,train_index,score,")
    with pytest.raises(SystemExit, match="no such score"):
        ce.main(["margin", data, weights, str(labels), "--pick", "10:0.25:0", "--judged-until", "2"])
    with pytest.raises(SystemExit):  # argparse's one-line usage error, not a traceback
        ce.main(["margin", data, weights, str(labels), "--pick", "10:0.5", "--judged-until", "2"])
    assert "expected k:beta:allowance" in capsys.readouterr().err


def test_best_allowed_adds_at_most_the_allowed_look_alikes():
    labels = np.array(["dup", "dup", "diff", "dup", "diff", "unsure", "diff"])
    score = np.array([0.99, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6])
    already = np.array([False, False, False, False, False, False, True])
    cut, union = ce.best_allowed(score, labels, already, 0)
    assert cut > 0.9 and union == {"dup": 2, "unsure": 0, "diff": 1}
    cut, union = ce.best_allowed(score, labels, already, 1)
    assert 0.8 < cut <= 0.85 and union == {"dup": 3, "unsure": 0, "diff": 2}
    assert cut - 0.8 == pytest.approx(ce.CUT_MARGIN)  # robust to another summation order of 0.8
    cut, union = ce.best_allowed(score, labels, already, 5)  # more than there are: everything
    assert union == {"dup": 3, "unsure": 1, "diff": 3}
    # a pair scored -inf (out of the decision's reach) is never accepted, even with no cut left
    unreachable = np.where(np.arange(7) == 3, -np.inf, score)
    cut, union = ce.best_allowed(unreachable, labels, already, 5)
    assert union == {"dup": 2, "unsure": 1, "diff": 3}
    _, row = ce.census_row(unreachable, labels, already, np.arange(7) % 2 == 0, 5)
    assert row["odd ranks at the even ranks' cut"] == {"dup": 1, "unsure": 1, "diff": 0}  # odd 3 is out of reach


def test_candidate_column_finds_a_public_image_among_the_candidates_or_says_it_is_not():
    candidates = np.array([[4, 7, 1], [2, 4, 9]])
    np.testing.assert_array_equal(ce.candidate_column(candidates, np.array([0, 1, 1, 0]), np.array([1, 4, 7, 4])),
                                  [2, 1, -1, 0])


def test_crop_view_is_the_window_resized_back_to_full_size():
    images = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    view = ce.crop_view(images, (8, 0))
    assert view.shape == (3, 32, 32, 3) and view.dtype == np.uint8
    # a 24-px window of a picture that is constant in 8-px blocks stays constant on the matching 32/3-px blocks
    blocks = np.kron(np.arange(16, dtype=np.uint8).reshape(4, 4) * 16, np.ones((8, 8), np.uint8))
    flat = np.repeat(blocks[None, :, :, None], 3, axis=3)
    zoomed = ce.crop_view(flat, (8, 0))[0, :, :, 0].astype(int)
    assert zoomed[0, 0] == flat[0, 8, 0, 0] and zoomed[-1, -1] == flat[0, 31, 23, 0]
    assert zoomed[5, 5] == flat[0, 8 + 3, 3, 0]  # output pixel 5 sits in the window's first block


def test_views_scores_every_family_on_a_tiny_ingested_set(tmp_path, capsys):
    from dpscale.data.dataset import IngestedDataset
    from dpscale.dedup import copy_model

    rng = np.random.default_rng(1)
    train = rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8)
    zoomed = ce.crop_view(train[:2], (4, 4))  # test images that are 1.33x zooms of two train images
    test = np.concatenate([zoomed, rng.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)])
    data, stored_train, stored_test = ingest_tiny(tmp_path, train, test)
    ds = IngestedDataset(data)
    t_zoom = next(i for i in range(4) if np.array_equal(stored_test[i], zoomed[0]))
    j_zoom = next(j for j in range(64) if np.array_equal(stored_train[j], train[0]))
    model = str(tmp_path / "copy")
    params, info = copy_model.train(train, copy_model.TrainSettings(epochs=1, batch=32))
    copy_model.save(model, params, info, ds.ids("train"))
    labels = tmp_path / "labels.csv"
    labels.write_text(f"rank,test_index,train_index,label,note\n0,{t_zoom},{j_zoom},dup,\n"
                      f"1,{t_zoom},{(j_zoom + 1) % 64},diff,\n")
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"removed": []}))
    capsys.readouterr()
    ce.main(["views", data, model, str(labels), "--dedup-report", str(report), "--montage-dir", str(tmp_path),
             "--pick", "32", "--judged-until", "2"])
    out = json.loads(capsys.readouterr().out)
    assert set(out["all pairs"]) == set(ce.VIEW_SCORES) and out["k"] == 10
    for name in ce.VIEW_SCORES:
        census = out["census pairs"][name]
        assert census["+32 diff"]["dup"] == 1 and census["+32 diff"]["diff"] == 1  # fewer look-alikes than allowed
        assert out["all pairs"][name]["+32 diff"]["matched"] == 4  # no cut: every test image
    # at the cut that admits no look-alike, the exact public crop of the zoomed image outscores its
    # look-alike pair; whole-image scores need not
    assert out["census pairs"]["public crops"]["+0 diff"]["dup"] == 1
    assert out["census pairs"]["both"]["+0 diff"]["dup"] == 1
    # the census pairs alone (crop views and backgrounds of their images only) score them the same
    ce.main(["views", data, model, str(labels), "--census-only", "--judged-until", "2"])
    alone = json.loads(capsys.readouterr().out)
    assert alone["census pairs"] == out["census pairs"] and all(not v for v in alone["all pairs"].values())
    # the mutual-neighbour bonus: at bonus 0 it is the whole-image score of the views
    ce.main(["mutual", data, model, str(labels), "--dedup-report", str(report), "--judged-until", "2",
             "--montage-dir", str(tmp_path), "--pick", "0.1:0", "--lower-cut", "1.9:-1.9"])
    mutual = json.loads(capsys.readouterr().out)
    assert mutual["census pairs"]["bonus 0.0"] == out["census pairs"]["whole"]
    assert set(mutual["all pairs"]) == {f"bonus {b}" for b in ce.MUTUAL_BONUSES}
    assert 0 <= mutual["mutual over all private images"] <= 4
    assert mutual["all pairs"]["bonus 0.0"]["+32 diff"]["matched"] == 4
    frontier = [mutual["cut frontier, bonus 0"][f"{c:.2f}"]["added to dedup"] for c in ce.FRONTIER_CUTS]
    assert frontier == sorted(frontier)  # a lower cut never adds fewer
    assert list(mutual["cut montage"].values()) == [{"added by the lower cut": 4, "drawn": 4}]  # no report match
    assert (tmp_path / "dedup_copy_cut_1.9_to_-1.9_added.csv").read_text().count("\n") == 5
    assert (tmp_path / "dedup_copy_mutual_added_0.1_0.csv").read_text().startswith("position,test_index,")
    # the local agreement: a census pair the copy decision never scores (not among its test image's
    # candidates) is never accepted, even with no cut; the scores themselves are the copy
    # decision's own (test_local_scores_are_the_copy_decisions_scores)
    ce.main(["local", data, model, str(labels), "--dedup-report", str(report), "--judged-until", "2",
             "--weights", "0", "2", "--picked", "2", "--cuts", "3.9", "0", "-3.9"])
    loc = json.loads(capsys.readouterr().out)
    among = loc["census pairs"]["among the candidates"]
    assert among["dup"] == 1  # the zoomed copy is one of its image's candidates
    for weight in ("weight 0.0", "weight 2.0"):
        row = loc["census pairs"][weight]["+32 diff"]
        assert (row["dup"], row["unsure"], row["diff"]) == (1, 0, among["diff"])
    frontier = [loc["cut frontier, weight 2.0"][c]["matched"] for c in ("3.90", "0.00", "-3.90")]
    assert frontier[0] == 0 and frontier[-1] == 4 and frontier == sorted(frontier)
    with pytest.raises(SystemExit, match="--picked"):
        ce.main(["local", data, model, str(labels), "--weights", "0", "--picked", "2"])


def test_an_ensemble_of_copy_models_scores_the_mean_of_their_cosines(tmp_path):
    from dpscale.dedup import copy_model

    rng = np.random.default_rng(2)
    train = rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8)
    models = []
    for seed in (0, 1):
        models.append(str(tmp_path / f"copy{seed}"))
        params, info = copy_model.train(train, copy_model.TrainSettings(epochs=1, batch=32, seed=seed))
        copy_model.save(models[-1], params, info, np.arange(64, dtype=np.uint64))
    public, private = train[:5], train[5:8]
    one, two = (ce.embeddings(m, public, private) for m in models)
    both = ce.embeddings(",".join(models), public, private)
    assert all(e.shape == (len(x), 256) for e, x in zip(both, (public, public, private, private)))
    for i, j in ((0, 2), (1, 3), (0, 3)):  # public x private, in both mirror states
        mean = (one[i] @ one[j].T + two[i] @ two[j].T) / 2
        np.testing.assert_allclose(both[i] @ both[j].T, mean, atol=1e-5)
        assert not np.allclose(one[i] @ one[j].T, mean, atol=1e-3)  # the two models differ
    np.testing.assert_allclose(np.linalg.norm(both[0], axis=1), 1.0, atol=1e-5)


def test_local_scores_are_the_copy_decisions_scores(tmp_path):
    """What the benchmark's ``local`` counts is what ``copy_score.decide`` computes: each private
    image's best score with the local agreement, on real model cells."""
    from dpscale.dedup import copy_model, copy_score, local_match

    rng = np.random.default_rng(3)
    train = rng.integers(0, 256, (40, 32, 32, 3), dtype=np.uint8)
    test = np.concatenate([train[:3, :, ::-1], rng.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)])
    params, _ = copy_model.train(train, copy_model.TrainSettings(epochs=1, batch=20))
    tr, tr_m, te, te_m = (copy_model.embed(params, x, mirrored=m) for x in (train, test) for m in (False, True))
    agreement = local_match.Agreement(params, copy_model.thumbnails(train), copy_model.thumbnails(test))
    settings = copy_score.CopySettings(cut=3.9, k=10, beta=0.5, local_weight=2.0, candidates=20)
    decided = copy_score.decide(tr, tr_m, te, te_m, settings, local_agreement=agreement)
    sims, index, mirrored = copy_score.top_k(te, te_m, tr, k=20)
    train_sims = copy_score.top_k(tr, tr_m, tr, k=10, exclude_self=True)[0]
    score = copy_score.normalised(sims, sims[:, 9:10], train_sims[index, 9], 0.5)
    total = ce.local_scores(score, agreement(np.arange(6), index, mirrored), 2.0)
    np.testing.assert_allclose(total.max(axis=1), decided.best_score, atol=1e-5)
    assert not np.allclose(total.max(axis=1), score.max(axis=1), atol=1e-3)  # the agreement counts
