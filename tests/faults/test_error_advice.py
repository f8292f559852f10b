"""The error catalogue, run: each message says what is wrong truly, and what it tells the user to do, done as
told, works (every refusal of the fault tests is also held to ``advice.check_advice``).

The repair of a damaged cache entry is run as its message gives it in ``test_runs_and_caches``; a run's
resume after Ctrl-C there too, and a sweep's here.
"""

import json
import os
import re
import shlex
from pathlib import Path

import pytest

from dpscale.training.checkpoints import Checkpoints

from .advice import check_advice, suggested
from .test_runs_and_caches import IN_MEMORY, SIZES, TRAIN, dpscale, ok, refused


@pytest.fixture(scope="module")
def cache(tmp_path_factory, synthetic_feature_cache):
    return synthetic_feature_cache(
        str(tmp_path_factory.mktemp("cache")), seed=0, sizes=SIZES, chunk_rows=64, data_hash_char="a"
    )


@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
    """Data of each kind as far as a command looks before it reads any (its metadata)."""
    root = tmp_path_factory.mktemp("kinds")
    (root / "activations").mkdir()
    (root / "activations" / "dpscale_features.json").write_text('{"key": {"cut": "scattering"}, "source": "/d/fm"}')
    (root / "images").mkdir()
    (root / "images" / "manifest.json").write_text("{}")
    return root


@pytest.fixture(scope="module")
def trained(cache, tmp_path_factory):
    """What the refusals below advise, done: the run without the option (or --mode) they refuse."""
    from dpscale.cli import cli

    run = tmp_path_factory.mktemp("trained") / "run"
    with pytest.raises(SystemExit) as info:
        cli.main(["train", str(cache), str(run), *TRAIN], prog_name="dpscale")
    assert info.value.code == 0
    return run


def test_an_option_the_run_does_not_use_is_refused_and_leaving_it_out_trains(cache, kinds, trained, tmp_path, capfd):
    """B8 and B13: accepted with exit 0 and ignored before (the config recorded cnn-small, normalization none)."""
    refused(capfd, "train", cache, tmp_path / "r", *TRAIN, "--model", "cnn", saying=("--model", "leave it out"))
    refused(
        capfd,
        "train",
        kinds / "activations",
        tmp_path / "r",
        *TRAIN,
        "--feature-normalization",
        "l2",
        saying=("--feature-normalization does not apply to activations mode", "leave it out"),
    )
    refused(capfd, "train", cache, tmp_path / "r", *TRAIN, "--model", "cnn-small", saying="--model")  # its default
    assert not (tmp_path / "r").exists()
    assert json.loads((trained / "config.json").read_text())["training"]["mode"] == "features"  # left out, it trains


def test_a_mode_of_another_kind_says_what_the_data_is_and_how_to_make_the_kind(cache, kinds, trained, tmp_path, capfd):
    line = refused(
        capfd, "train", cache, tmp_path / "r", *TRAIN, "--mode", "activations", saying="leave --mode out to train"
    )
    assert "holds pooled features" in line and "in features mode" in line  # as ``trained`` was
    line = refused(capfd, "train", kinds / "images", tmp_path / "i", "--mode", "activations", saying="holds ingested")
    assert "unfinished" not in line  # what it said of an ingested dataset before
    command = suggested(line)[0]
    assert command[:3] == ["dpscale", "featurize", str(kinds / "images")] and "--cut" in command


def test_evaluate_on_data_of_another_kind_says_what_to_featurize(kinds, trained, capfd):
    from dpscale.training.evaluation import _made_like

    line = refused(capfd, "evaluate", trained, "--data", kinds / "activations", saying="holds activations")
    assert "evaluate it on pooled features of its backbone (`dpscale featurize DATA --backbone synthetic`)" in line
    # The case the other way round: an activations run given pooled features names its cut.
    advice = _made_like("activations", {"feature_key": {"model": "scatternet-linear", "cut": "scattering"}})
    assert "--mode features" not in advice and "--cut scattering" in advice
    check_advice(advice)


def test_a_backbone_that_is_not_one_names_those_there_are(tmp_path, monkeypatch, capfd):
    from dpscale.models.pretrained import resolve_backbone

    monkeypatch.setenv("DPSCALE_WEIGHTS_DIR", str(tmp_path / "weights"))
    data = str(tmp_path / "d")
    ok(capfd, "ingest", "digits", data, "--classes", "0,1", "--", *IN_MEMORY)
    line = refused(
        capfd, "featurize", data, "--backbone", "scatternet-linaer", saying="did you mean scatternet-linear?"
    )
    assert "scatternet-linear-rgb" in line and "efficientnet-lite0" in line
    assert resolve_backbone("scatternet-linear").is_dir()  # the name it offers is one
    line = refused(
        capfd, "featurize", data, "--backbone", "scatternet-top-cnn", "--cut", "scattering", saying="no weights"
    )
    assert "export-backbone" in line and "no dpscale_backbone.json" not in line


def test_a_failed_beam_pipeline_names_a_log_holding_its_trace_and_verbose_shows_it(tmp_path, monkeypatch, capfd):
    """The log it named was empty; quickstart had no --verbose; with --verbose the line still said to add it."""
    from dpscale.data import examples

    def boom(shapes):
        raise RuntimeError("boom in the majority step")

    monkeypatch.setattr(examples, "majority_shape", boom)
    code, out, err = dpscale(capfd, "ingest", "digits", tmp_path / "d", "--", *IN_MEMORY)
    line = err.strip().splitlines()[-1]
    assert code == 2 and "boom in the majority step" in line and "add --verbose" in line, err
    log = re.search(r"Beam's log (\S+?)\)", line).group(1)
    trace = Path(log).read_text()
    assert "Traceback" in trace and "RuntimeError: boom in the majority step" in trace
    os.remove(log)
    code, out, err = dpscale(capfd, "ingest", "digits", tmp_path / "d", "--verbose", "--", *IN_MEMORY)
    line = err.strip().splitlines()[-1]
    assert code == 2 and "its trace is above" in line and "--verbose" not in line
    assert "RuntimeError: boom in the majority step" in err and "Traceback" in err
    code, _, err = dpscale(capfd, "quickstart", "--work-dir", tmp_path / "q", "--verbose", "--no-dedup")
    assert code == 2 and "boom in the majority step" in err and "No such option" not in err
    from dpscale.cli import cli

    for command in ("ingest", "dedup", "featurize", "quickstart"):  # every command that runs a Beam pipeline
        assert "verbose" in {param.name for param in cli.commands[command].params}, command


def test_ctrl_c_in_a_sweep_says_how_to_continue_and_that_command_does(cache, tmp_path, monkeypatch, capfd):
    sweep = ["sweep", cache, tmp_path / "s", "--epsilons", "4", "--repeats", "2", "--batch-size", "64", "--steps", "4"]
    save = Checkpoints.save
    calls = []

    def save_then_interrupt(self, step, state):
        save(self, step, state)
        calls.append(step)
        if len(calls) == 3:  # the second run, after its first checkpoint
            raise KeyboardInterrupt

    monkeypatch.setattr(Checkpoints, "save", save_then_interrupt)
    code, _, err = dpscale(capfd, *sweep, "--checkpoint-every", 2)
    monkeypatch.undo()
    line = err.strip().splitlines()[-1]
    assert code == 130 and line.startswith("dpscale: interrupted; continue the sweep with the same command"), err
    (command,) = suggested(line)
    assert command == ["dpscale", *map(str, sweep), "--checkpoint-every", "2"]
    check_advice(line)
    result = json.loads(ok(capfd, *command[1:]))
    assert (result["runs_reused"], result["runs_trained"]) == (1, 1)
    assert shlex.join(command) in line
