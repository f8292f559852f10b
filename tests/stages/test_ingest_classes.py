"""Ingest with a class filter (``--classes``): the public/private split by class of the quickstart."""

import numpy as np
import pytest
from click.testing import CliRunner

from dpscale.cli import cli
from dpscale.data import examples as ex
from dpscale.data.dataset import IngestedDataset
from dpscale.data.sources import ReadTask, select_classes
from dpscale.errors import DataError, InvalidConfigError
from dpscale.stages.ingest import IngestConfig, run

FAST = ("--runner=FnApiRunner", "--direct_num_workers=1", "--direct_running_mode=in_memory")


def test_select_classes_keeps_source_order_and_relabels():
    kept, label_map = select_classes(["a", "b", "c", "d"], ["d", "b"])
    assert kept == ("b", "d") and label_map == (-1, 0, -1, 1)
    with pytest.raises(DataError, match="'x'.*has a, b"):
        select_classes(["a", "b"], ["a", "x"])
    with pytest.raises(InvalidConfigError):
        IngestConfig("digits", "/tmp/x", classes=("1", "1"))


def test_process_task_counts_left_out_items_and_relabels(tmp_path):
    from PIL import Image

    for cls, value in (("a", 10), ("b", 20), ("c", 30)):
        (tmp_path / cls).mkdir()
        Image.fromarray(np.full((4, 4), value, np.uint8)).save(tmp_path / cls / "0.png")
    members = tuple(("train", cls, f"{cls}/0.png") for cls in "abc") + (("train", "zz", "zz/0.png"),)
    out = ex.process_task(
        ReadTask("files", path=str(tmp_path), members=members),
        ["a", "b", "c"],
        validation_fraction=0.0,
        shards_per_split={"train": 1},
        encoding="raw",
        label_map=(-1, -1, 0),
    )
    (kept,) = [e for batch in out.batches.values() for e in batch]
    assert kept.label == 0 and int(ex.decode_record(kept.record).image.max()) == 30  # class c
    assert out.num_excluded == 2
    assert [r.reason for r in out.rejections] == ["unknown_label"]  # not in the source at all


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    run(IngestConfig("digits", str(root / "all"), pipeline_args=FAST))
    run(IngestConfig("digits", str(root / "some"), classes=("7", "5"), pipeline_args=FAST))
    return IngestedDataset(str(root / "all")), IngestedDataset(str(root / "some"))


def test_filtered_ingest_holds_exactly_the_kept_classes_relabelled(digits):
    full, some = digits
    assert some.class_names == ["5", "7"] and some.num_classes == 2
    assert list(some.manifest.class_filter.source_class_names) == full.class_names
    assert full.manifest.class_filter is None
    kept = 0
    for split in full.splits:
        labels = full.labels(split)
        wanted = np.flatnonzero(np.isin(labels, [5, 7]))
        expected = {e.id: int(labels[i] == 7) for e, i in zip(full.examples(split, wanted), wanted)}
        got = {e.id: e.label for e in some.examples(split, range(some.num_examples(split)))}
        assert got == expected  # same images, labels 5 -> 0 and 7 -> 1
        assert some.manifest.splits[split].class_counts == {
            "5": int((labels == 5).sum()),
            "7": int((labels == 7).sum()),
        }
        kept += len(got)
    assert kept + some.manifest.class_filter.num_excluded == len(full) == 1797
    assert some.content_hash != full.content_hash


def test_cli_classes_flag_and_unknown_class_error(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(cli, ["ingest", "digits", str(tmp_path / "a"), "--classes", "0,1", "--", *FAST])
    assert ok.exit_code == 0, ok.output
    assert "kept 2 of 10 (0, 1)" in ok.output
    assert IngestedDataset(str(tmp_path / "a")).class_names == ["0", "1"]
    bad = runner.invoke(cli, ["ingest", "digits", str(tmp_path / "b"), "--classes", "0,ten"])
    assert bad.exit_code == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "'ten'" in lines[0]
