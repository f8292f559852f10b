"""Sweep faults through the real CLI: a refused sweep is one line, exit code 2, and nothing overwritten."""

import json
import os

import pytest

from dpscale.cli import cli

from ..conftest import write_synthetic_feature_cache

SIZES = {"train": 300, "test": 100}
SMALL = [
    "--epsilons",
    "2",
    "--learning-rates",
    "4",
    "--repeats",
    "1",
    "--steps",
    "3",
    "--microbatch-size",
    "64",
    "--accountant",
    "rdp",
]


def dpscale(capfd, *args):
    with pytest.raises(SystemExit) as info:
        cli.main([str(a) for a in args], prog_name="dpscale")
    out, err = capfd.readouterr()
    return info.value.code, out, err


def refused(capfd, *args, saying=()):
    code, out, err = dpscale(capfd, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dpscale: error: "), err
    assert "Traceback" not in err and out == ""
    for text in saying:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    root = tmp_path_factory.mktemp("caches")
    return [
        write_synthetic_feature_cache(str(root / name), seed=seed, sizes=SIZES, chunk_rows=128, data_hash_char=char)
        for name, seed, char in (("a", 0, "a"), ("b", 1, "b"))
    ]


@pytest.fixture(scope="module")
def finished(entries, tmp_path_factory):
    """OUT_DIR of a finished sweep on the first entry (batch size 64)."""
    out = tmp_path_factory.mktemp("sweeps") / "out"
    with pytest.raises(SystemExit) as info:
        cli.main(["sweep", entries[0], str(out), "--batch-size", "64", *SMALL], prog_name="dpscale")
    assert info.value.code == 0
    return out


def _snapshot(directory):
    return {
        os.path.join(root, name): os.stat(os.path.join(root, name)).st_mtime_ns
        for root, _, names in os.walk(directory)
        for name in names
    }


@pytest.mark.parametrize(
    "change, saying",
    [
        (["--batch-size", "32"], ("batch-size 64 there, 32 asked", "new OUT_DIR")),
        (["--batch-size", "64", "--ema-decay", "0.5"], ("ema-decay 0.999 there, 0.5 asked", "new OUT_DIR")),
    ],
)
def test_a_sweep_with_other_settings_is_refused_and_nothing_is_overwritten(capfd, entries, finished, change, saying):
    before = _snapshot(finished)
    refused(capfd, "sweep", entries[0], finished, *change, *SMALL, saying=saying)
    assert _snapshot(finished) == before


def test_a_sweep_on_other_data_is_refused_and_nothing_is_overwritten(capfd, entries, finished):
    before = _snapshot(finished)
    refused(
        capfd,
        "sweep",
        entries[1],
        finished,
        "--batch-size",
        "64",
        *SMALL,
        saying=("holds a sweep on other data", "new OUT_DIR"),
    )
    assert _snapshot(finished) == before
    privacy = json.loads((finished / "privacy.json").read_text())
    assert privacy["private_runs"] == 1


@pytest.mark.parametrize(
    "args, saying",
    [
        (["--grid", "augmult"], ("--grid", "NAME=V1,V2")),
        (["--grid", "colour=1,2"], ("--grid", "not a training option")),
        (["--grid", "augmult=1,4"], ("augmult", "does not apply to features mode")),
        (["--grid", "clip-norm=1,2", "--clip-norm", "2"], ("--clip-norm is also given",)),
        (["--grid", "learning-rate=1,2", "--learning-rates", "4"], ("--learning-rates is also given",)),
        (["--grid", "ema-decay=0,1.5"], ("--ema-decay", "1.5")),
        (["--grid", "augmult=2,2"], ("listed twice",)),
        (["--simulate-batch", "64"], ("--simulate-batch 64 must be below the batch size it simulates (64)",)),
        (["--holdout", "50"], ("--private-diagnostics",)),
    ],
)
def test_bad_sweep_flags_are_one_line(capfd, entries, tmp_path, args, saying):
    refused(
        capfd,
        "sweep",
        entries[0],
        tmp_path / "out",
        "--batch-size",
        "64",
        "--repeats",
        "1",
        "--steps",
        "2",
        "--epsilons",
        "2",
        *args,
        saying=saying,
    )
    assert not (tmp_path / "out").exists()
