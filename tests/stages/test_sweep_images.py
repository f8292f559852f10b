"""A sweep over augmult on images (the bundled digits), chosen on held-out rows, through the command line."""

import json
import os

import pytest
from click.testing import CliRunner

from dpscale.cli import cli
from dpscale.data.dataset import IngestedDataset
from dpscale.stages import ingest, sweep
from dpscale.training.run_directory import RunDirectory


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("data") / "digits")
    ingest.run(ingest.IngestConfig(source="digits", output_dir=out, classes=("0", "1", "2")))
    return out


def test_sweep_grids_augmult_on_images_and_chooses_on_held_out_rows(digits, tmp_path):
    out = tmp_path / "sweep"
    result = CliRunner().invoke(
        cli,
        [
            "sweep",
            digits,
            str(out),
            "--epsilons",
            "4",
            "--learning-rates",
            "2",
            "--grid",
            "augmult=1,2",
            "--repeats",
            "1",
            "--batch-size",
            "32",
            "--steps",
            "2",
            "--microbatch-size",
            "16",
            "--augment-pad",
            "1",
            "--holdout",
            "60",
            "--private-diagnostics",
            "--accountant",
            "rdp",
            "--print-private-diagnostics",
        ],
    )
    assert result.exit_code == 0, result.output
    line = json.loads(result.stdout)
    assert sorted(os.listdir(out / "runs")) == ["eps4-lr2-augmult1-r0", "eps4-lr2-augmult2-r0"]
    total = IngestedDataset(digits).num_examples("train")
    for k in (1, 2):
        spec = RunDirectory.existing(str(out / "runs" / f"eps4-lr2-augmult{k}-r0")).read_spec()
        assert spec.training.images.augmult == k and spec.plan.num_examples == total - 60
        held = json.loads((out / "runs" / f"eps4-lr2-augmult{k}-r0" / "metrics.holdout.NOT-PRIVATE.json").read_text())
        assert held["num_examples"] == 60
    assert [s["augmult"] for s in line["summary"]] == [1, 2] and {s["split"] for s in line["summary"]} == {"holdout"}
    (chosen,) = line["chosen"]
    assert chosen["augmult"] in (1, 2) and "test_median_top1" in chosen and chosen["chosen_on"] == "holdout"
    assert "chosen on the last 60 training rows" in line["selection"] and line["covered_by_epsilon"] is False
    assert "| augmult |" in (out / "summary.NOT-PRIVATE.md").read_text()
    assert not (out / sweep.SUMMARY_MD).exists()
    assert "NOT cover" in result.stderr and "dpscale: releasing every DP result" in result.stderr
    assert line["not_private"]["fields"] == ["summary", "chosen"] and "JSON line's summary, chosen" in result.stderr
    # Without --print-private-diagnostics the line names where they are instead (the runs are reused).
    again = CliRunner().invoke(
        cli,
        [
            "sweep",
            digits,
            str(out),
            "--epsilons",
            "4",
            "--learning-rates",
            "2",
            "--grid",
            "augmult=1,2",
            "--repeats",
            "1",
            "--batch-size",
            "32",
            "--steps",
            "2",
            "--microbatch-size",
            "16",
            "--augment-pad",
            "1",
            "--holdout",
            "60",
            "--private-diagnostics",
            "--accountant",
            "rdp",
        ],
    )
    assert again.exit_code == 0, again.output
    withheld = json.loads(again.stdout)
    assert "summary" not in withheld and "chosen" not in withheld and "not_private" not in withheld
    assert withheld["withheld"]["files"] == [str(out / "summary.NOT-PRIVATE.md"), str(out / "chosen.NOT-PRIVATE.csv")]
    assert not any((out / "runs" / name / "metrics.json").exists() for name in os.listdir(out / "runs"))
