"""Flags that cannot apply, limits of the machine and of the accountant, through the real CLI.

Each refusal is one ``dpscale: error:`` line with exit code 2 that leaves every file as it was;
each warning reads ``dpscale: warning: ...`` like every other.
"""

import json
import os
import re
import time

import pytest

from .test_runs_and_caches import SIZES, TRAIN, dpscale, ok, refused


def snapshot(directory) -> dict[str, bytes]:
    """Every file under ``directory`` and its bytes: equal before and after means nothing was overwritten."""
    files = {}
    for folder, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, directory)] = f.read()
    return files


@pytest.fixture(scope="module")
def cache(tmp_path_factory, synthetic_feature_cache):
    return synthetic_feature_cache(
        str(tmp_path_factory.mktemp("cache")), seed=0, sizes=SIZES, chunk_rows=64, data_hash_char="e"
    )


@pytest.fixture(scope="module")
def finished(cache, tmp_path_factory):
    """A finished features-mode run (never changed by the tests below: each refuses before touching it)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    with pytest.raises(SystemExit) as info:
        from dpscale.cli import cli

        cli.main(["train", str(cache), str(run), *TRAIN], prog_name="dpscale")
    assert info.value.code == 0
    return run


# --- --resume continues with the settings the run started with -----------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        ["--steps", "900"],
        ["--learning-rate", "0.5"],
        ["--epsilon", "2"],
        ["--seed", "1"],
        ["--devices", "2"],
        ["--batch-size", "32", "--delta", "1e-6"],
    ],
)
def test_resume_refuses_a_training_option_instead_of_ignoring_it(finished, capfd, extra):
    before = snapshot(finished)
    line = refused(capfd, "train", "--resume", finished, *extra, saying=("--resume continues the run", extra[0]))
    assert "new directory" in line
    if len(extra) > 2:
        assert extra[2] in line  # every option given is named
    assert snapshot(finished) == before


def test_resume_takes_no_data_or_run_arguments(finished, capfd):
    before = snapshot(finished)
    refused(capfd, "train", "--resume", finished, finished, saying="takes no DATA or RUN_DIR")
    assert snapshot(finished) == before


# --- device counts explained ----------------------------------------------------------------------


def test_more_devices_than_exist_is_one_line_saying_how_to_get_more(cache, tmp_path, capfd):
    line = refused(
        capfd,
        "train",
        cache,
        tmp_path / "r",
        *TRAIN,
        "--devices",
        9,
        saying=("--devices 9", "4 cpu devices", "give 1 to 4", "XLA_FLAGS=--xla_force_host_platform_device_count=N"),
    )
    assert line and not (tmp_path / "r" / "config.json").exists()


def test_a_micro_batch_the_devices_cannot_share_is_one_line(cache, tmp_path, capfd):
    refused(
        capfd,
        "train",
        cache,
        tmp_path / "r",
        *TRAIN,
        "--microbatch-size",
        6,
        saying=("--microbatch-size 6", "divisible by the 4 devices: give 4 or 8", "--devices"),
    )
    assert not (tmp_path / "r" / "config.json").exists()


# --- warnings in one format -----------------------------------------------------------------------


def test_the_fixed_seed_warning_reads_like_every_other_warning(cache, tmp_path, capfd):
    code, out, err = dpscale(capfd, "train", cache, tmp_path / "r", *TRAIN, "--seed", 3)
    assert code == 0 and json.loads(out)["steps"] == 6
    seeded = [line for line in err.splitlines() if "fixed noise seed 3" in line]
    assert seeded and all(line.startswith("dpscale: warning: using the fixed noise seed 3") for line in seeded), err
    assert not any(line.startswith(("WARNING", "W1", "W0")) for line in err.splitlines()), err


# --- throughput ---------------------------------------------------------------------------------


def test_training_shows_examples_per_second_in_its_progress_and_its_result(cache, tmp_path, capfd):
    code, out, err = dpscale(capfd, "train", cache, tmp_path / "r", *TRAIN)
    assert code == 0 and json.loads(out)["examples_per_second"] > 0
    lines = err.splitlines()
    # a line at once, before the first step compiles; then one final line, not two
    assert any(line.split(" ", 1)[1].startswith("train: 0/6, compiling the DP step ...") for line in lines), err
    (final,) = [line for line in lines if line.split(" ", 1)[1].startswith("train: 6/6")]
    # one definition of examples/s: the final line shows the result's figure
    shown = float(re.search(r"([\d,.]+) examples/s", final).group(1).replace(",", ""))
    assert shown == pytest.approx(json.loads(out)["examples_per_second"], rel=0.05, abs=0.01), (final, out)


def test_ingest_shows_the_images_per_second_of_its_result(tmp_path, capfd):
    """One definition of images/s: every input read (classes left out included) over the stage's whole time.

    The progress line counted every input read since the pipeline began while the result counted only the
    kept ones over the whole stage (903 vs 211 images/s in the issue)."""
    code, out, err = dpscale(capfd, "ingest", "digits", tmp_path / "d", "--classes", "0,1")
    assert code == 0, err
    (final,) = [line for line in err.splitlines() if "ingest: read+decode: 1797/1797" in line]
    shown = float(re.search(r"([\d,.]+) images/s", final).group(1).replace(",", ""))
    assert shown == pytest.approx(json.loads(out)["images_per_second"], rel=0.1), (final, out)


# --- every accountant call bounded in time ------------------------------------------------------

PLAN = ["--noise-multiplier", "1.0", "--batch-size", "256", "--num-examples", "50000"]


@pytest.mark.parametrize(
    "command",
    [
        ["epsilon", *PLAN, "--steps", "1000000000000"],
        ["epsilon", *PLAN, "--steps", "100000001", "--accountant", "rdp"],
        ["calibrate", "--epsilon", "8", "--num-examples", "50000", "--batch-size", "256", "--steps", "1000000000000"],
    ],
)
def test_an_epsilon_that_would_take_too_long_is_refused_at_once(command, capfd):
    started = time.perf_counter()
    refused(
        capfd,
        *command,
        saying=("steps: epsilon is computed for at most 100,000,000 steps", "no training run needs as many"),
    )
    assert time.perf_counter() - started < 10


def test_a_run_whose_epsilon_would_take_too_long_is_refused_before_it_starts(cache, tmp_path, capfd):
    refused(
        capfd,
        "train",
        cache,
        tmp_path / "r",
        "--batch-size",
        "64",
        "--steps",
        "200000000",
        saying="at most 100,000,000 steps",
    )
    assert not (tmp_path / "r" / "config.json").exists()


@pytest.mark.parametrize(
    "command, says",
    [
        ("epsilon", "epsilon: loading the RDP accountant, then accounting 100 steps ..."),
        ("calibrate", "calibrate: loading"),
    ],
)
def test_the_accountant_commands_say_at_once_what_they_compute(command, says, capfd):
    """They took 6-7 s (loading dp-accounting, then accounting) before their first word; a refusal stays one line."""
    args = [*PLAN, "--steps", "100"] if command == "epsilon" else ["--epsilon", "8", *PLAN[2:], "--steps", "100"]
    code, _, err = dpscale(capfd, command, *args, "--accountant", "rdp", "--json")
    assert code == 0 and re.match(rf"\d\d:\d\d:\d\d {re.escape(says)}", err.splitlines()[0]), err


def test_the_most_steps_accounted_answer_in_seconds(capfd):
    started = time.perf_counter()
    out = ok(capfd, "epsilon", *PLAN, "--steps", "100000000", "--json")
    assert time.perf_counter() - started < 60  # measured: see the report of MAX_ACCOUNTED_STEPS
    assert json.loads(out)["steps"] == 10**8
